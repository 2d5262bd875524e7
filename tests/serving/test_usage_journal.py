"""The usage journal (issue 35 #5): every request a web process records is also appended to its
journal until written, so a process that dies without writing (kill -9) loses none. A replay
writes exactly what the writer would have, once; a live owner's segments are never taken; a
line cut by a crash mid-write is skipped; a journal that cannot be written never breaks a request.
The end-to-end run (a web process killed with kill -9 in cluster mode) is
tests/cluster/test_web_killed_usage.py."""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from accounts.credentials import Principal
from serving.models import RequestLog, UsageBucket, UsageJournalSegment
from serving.proxy.usage import RequestContext, UsageRecorder, replay_journal
from serving.proxy.usage_journal import UsageJournal, orphan_segments
from tests.conftest import REPO

AT = time.time()
ADA = Principal(user_id=1, username="ada", role="viewer", key_id=7, key_name="team 'a' key")


def _record(recorder: UsageRecorder, n: int, *, prefix: str = "req") -> None:
    """n answered requests (the first one streamed, tokens i and 10*i) and one refused (429)."""
    for i in range(n):
        ctx = RequestContext(request_id=f"{prefix}-{i}", client="10.0.0.1", principal=ADA, stream=i == 0,
                             client_request_id=f"client \"{i}\" ü", at=AT + i)
        recorder.record(ctx, model="smol \"chat\"", instance_id=3, node="node-a", status=200, error=None,
                        prompt_tokens=i, completion_tokens=10 * i, busy_s=0.25, ttft_s=0.0123, failed=False,
                        ended=ctx.t0 + 0.5)
    refused = RequestContext(request_id=f"{prefix}-refused", principal=ADA, model="other", at=AT + 0.123456)
    recorder.record_refused(refused, status=429, code="rate_limited")


def _stored() -> tuple[list[dict], list[dict]]:
    rows = [{k: v for k, v in r.items() if k not in ("id", "duration_ms")}
            for r in RequestLog.objects.order_by("request_id").values()]
    buckets = [{k: v for k, v in b.items() if k != "id"}
               for b in UsageBucket.objects.order_by("model").values()]
    return rows, buckets


def _segments(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.glob("*.jsonl")) if directory.exists() else []


@pytest.mark.django_db
def test_a_dead_recorders_journal_replays_as_its_write_would_have_once(tmp_path):
    written = UsageRecorder()
    _record(written, 3)
    assert written.flush_sync() == 6  # 2 buckets, 4 rows
    want = _stored()
    RequestLog.objects.all().delete()
    UsageBucket.objects.all().delete()

    journal = UsageJournal(tmp_path)
    crashed = UsageRecorder(journal=journal)
    _record(crashed, 3)
    assert len(_segments(tmp_path)) == 1
    journal.close()  # as a kill -9 leaves it: the locks gone, the file kept
    assert replay_journal(tmp_path) == 4
    got = _stored()
    assert got == want
    assert _segments(tmp_path) == []
    assert replay_journal(tmp_path) == 0 and _stored() == want


@pytest.mark.django_db
def test_each_write_commits_and_deletes_the_segments_it_took(tmp_path):
    journal = UsageJournal(tmp_path)
    recorder = UsageRecorder(journal=journal)
    _record(recorder, 2)
    first = _segments(tmp_path)
    assert len(first) == 1
    assert recorder.flush_sync() == 5
    assert _segments(tmp_path) == []
    assert list(UsageJournalSegment.objects.values_list("name", flat=True)) == first
    assert recorder.flush_sync() == 0 and _segments(tmp_path) == []  # no record, no new segment
    _record(recorder, 1, prefix="later")
    second = _segments(tmp_path)
    assert len(second) == 1 and second != first
    assert recorder.flush_sync() == 4
    assert UsageJournalSegment.objects.count() == 2 and RequestLog.objects.count() == 5
    assert replay_journal(tmp_path) == 0


@pytest.mark.django_db
def test_a_segment_committed_before_its_owner_died_is_deleted_not_counted_twice(tmp_path):
    journal = UsageJournal(tmp_path)
    recorder = UsageRecorder(journal=journal)
    _record(recorder, 2)
    names = _segments(tmp_path)
    # the owner's write commits (rows, buckets and the segment's name), then it dies before the delete
    from serving.proxy.usage import _write

    buckets, rows, slots, segments = recorder._take()
    assert segments == names
    _write(buckets, rows, slots, segments)
    journal.close()
    before = _stored()
    assert _segments(tmp_path) == names
    assert replay_journal(tmp_path) == 0
    assert _segments(tmp_path) == [] and _stored() == before and RequestLog.objects.count() == 3


@pytest.mark.django_db
def test_a_line_cut_by_a_crash_mid_write_is_skipped_with_a_warning(tmp_path, caplog):
    journal = UsageJournal(tmp_path)
    recorder = UsageRecorder(journal=journal)
    _record(recorder, 2)
    (name,) = _segments(tmp_path)
    journal.close()
    with open(tmp_path / name, "ab") as f:
        f.write(b'[1796301829.5,"req-cut",7,"team')  # a crash in the middle of a line
    with caplog.at_level(logging.WARNING, logger="xgen.usage"):
        assert replay_journal(tmp_path) == 3
    assert "last line is incomplete" in caplog.text
    assert sorted(RequestLog.objects.values_list("request_id", flat=True)) == ["req-0", "req-1", "req-refused"]
    assert _segments(tmp_path) == []


WRITER = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, sys.argv[2])
    from pathlib import Path
    from serving.proxy.usage_journal import UsageJournal
    journal = UsageJournal(Path(sys.argv[1]))
    journal.append(b'["a line"]\\n')
    journal.rotate()
    journal.append(b'["another"]\\n')  # two segments: one closed and pending, one live
    print("ready", flush=True)
    time.sleep(120)
""")


def test_a_live_owners_segments_are_never_taken_a_killed_ones_are(tmp_path):
    owner = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), str(REPO)], stdout=subprocess.PIPE,
                             text=True)
    try:
        assert owner.stdout.readline().strip() == "ready"
        assert len(_segments(tmp_path)) == 2
        assert list(orphan_segments(tmp_path)) == []  # both locked by a live process
        mine = UsageJournal(tmp_path)  # this process's own live segment: not an orphan either
        mine.append(b'["mine"]\n')
        assert list(orphan_segments(tmp_path)) == []
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait()
        taken = []
        for segment in orphan_segments(tmp_path):
            taken.append(segment.records)
            segment.done()
        assert sorted(taken) == [[["a line"]], [["another"]]]
        assert len(_segments(tmp_path)) == 1  # mine
        mine.close()
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()


@pytest.mark.django_db
def test_a_journal_that_cannot_be_written_never_breaks_a_request(tmp_path, caplog):
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("a file where the journal's folder should be")
    recorder = UsageRecorder(journal=UsageJournal(blocked))
    with caplog.at_level(logging.WARNING, logger="xgen.usage"):
        _record(recorder, 3)
    assert caplog.text.count("usage journal: cannot write") == 1  # once, not per request
    assert recorder.flush_sync() == 6 and RequestLog.objects.count() == 4


@pytest.mark.django_db
def test_failed_writes_keep_their_segments_as_files_until_one_commits(tmp_path):
    """A database that fails 30 writes in a row: each write closed a segment, none is deleted,
    and the process holds two descriptors (its lock and the live segment), not 30; the first
    write that succeeds commits them all."""
    from django.db import connection

    journal = UsageJournal(tmp_path)
    recorder = UsageRecorder(journal=journal)
    with connection.cursor() as cursor:
        cursor.execute("ALTER TABLE serving_requestlog RENAME TO serving_requestlog_away")
    for i in range(30):
        _record(recorder, 1, prefix=f"r{i}")
        with pytest.raises(Exception, match="serving_requestlog"):
            recorder.flush_sync()
    _record(recorder, 1, prefix="last")
    assert len(_segments(tmp_path)) == 31
    held = [os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
            if os.path.realpath(f"/proc/self/fd/{fd}").startswith(str(tmp_path))]
    assert len(held) == 2, held
    with connection.cursor() as cursor:
        cursor.execute("ALTER TABLE serving_requestlog_away RENAME TO serving_requestlog")
    assert recorder.flush_sync() > 0
    assert RequestLog.objects.count() == 62 and _segments(tmp_path) == []
    assert UsageJournalSegment.objects.count() == 31
    assert UsageBucket.objects.filter(model="other").get().requests == 31
    journal.close()
    assert replay_journal(tmp_path) == 0


@pytest.mark.django_db
def test_a_segment_that_cannot_be_written_stays_and_the_others_are_replayed(tmp_path, caplog):
    journal = UsageJournal(tmp_path)
    recorder = UsageRecorder(journal=journal)
    _record(recorder, 1, prefix="first")
    recorder._take()  # a write that took the first segment (and failed: it stays)
    _record(recorder, 1, prefix="second")
    first, second = _segments(tmp_path)
    journal.close()
    with open(tmp_path / first, "ab") as f:  # a whole line whose token count is not a number
        f.write(b'[1796301829.5,"bad",7,"k","ada","m",3,"n",200,"",null,1.0,"x",1,false,"","","engine",'
                b'1796299200,3,false,0.1]\n')
    with caplog.at_level(logging.WARNING, logger="xgen.usage"):
        assert replay_journal(tmp_path) == 2
    assert "1 segments could not be replayed" in caplog.text
    assert sorted(RequestLog.objects.values_list("request_id", flat=True)) == ["second-0", "second-refused"]
    assert _segments(tmp_path) == [first]


@pytest.mark.django_db(transaction=True)
async def test_a_node_agent_replays_its_data_dirs_journal_at_its_start(tmp_path, settings):
    from asgiref.sync import sync_to_async

    from serving.node.agent import default_workers
    from serving.node.workers import UsageJournalReplayer

    assert sum(isinstance(w, UsageJournalReplayer) for w in default_workers()) == 1
    settings.USAGE_JOURNAL_DIR = tmp_path
    journal = UsageJournal(tmp_path)
    _record(UsageRecorder(journal=journal), 2)
    journal.close()
    await UsageJournalReplayer().start(None)
    ids = await sync_to_async(lambda: sorted(RequestLog.objects.values_list("request_id", flat=True)))()
    assert ids == ["req-0", "req-1", "req-refused"] and _segments(tmp_path) == []


@pytest.mark.django_db
def test_committed_segment_names_are_forgotten_after_the_request_log_retention(settings):
    from datetime import timedelta

    from django.utils import timezone

    from serving.proxy.usage import prune_journal_segments

    settings.REQUEST_LOG_DAYS = 14
    for name, days in (("new", 1), ("kept", 14), ("old", 16)):
        segment = UsageJournalSegment.objects.create(name=name)
        UsageJournalSegment.objects.filter(pk=segment.pk).update(committed_at=timezone.now() - timedelta(days=days))
    assert prune_journal_segments() == 1
    assert sorted(UsageJournalSegment.objects.values_list("name", flat=True)) == ["kept", "new"]


@pytest.mark.django_db(transaction=True)
async def test_a_live_web_process_takes_over_a_dead_peers_journal_in_the_same_folder(tmp_path, settings):
    """Web processes sharing a data dir: at its start and before each of its writes a live one
    replays what a dead one left, never its own (nor a live peer's) segments."""
    from asgiref.sync import sync_to_async

    settings.USAGE_JOURNAL_DIR = tmp_path
    dead = UsageJournal(tmp_path)
    _record(UsageRecorder(journal=dead), 2, prefix="dead")
    dead.close()
    live = UsageRecorder(journal_from_settings=True)
    _record(live, 1, prefix="live")
    assert await live.replay_orphans() == 3
    ids = await sync_to_async(lambda: sorted(RequestLog.objects.values_list("request_id", flat=True)))()
    assert ids == ["dead-0", "dead-1", "dead-refused"]
    assert len(_segments(tmp_path)) == 1  # its own, until its write
    assert await live.flush() == 4 and _segments(tmp_path) == []  # 2 buckets, 2 rows
    await live.stop()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.django_db
def test_a_segment_of_the_version_before_team_fields_replays_under_the_keys_team(tmp_path):
    """Records written before rows named their team (three fields shorter: no team, no resumes) are
    still replayed after an upgrade, charged to the team that owns their key then (what that version
    would have read)."""
    import json

    from accounts.services import create_api_key, create_team, create_user
    from serving.proxy.usage import ROW_FIELDS

    team = create_team(name="Old", slug="old")
    key, _ = create_api_key(user=create_user(username="ada", role="viewer", password="ada-pass-1234"),
                            name="k", team=team)
    journal = UsageJournal(tmp_path)
    recorder = UsageRecorder(journal=journal)
    who = Principal(user_id=1, username="ada", role="viewer", key_id=key.pk, key_name="k")
    recorder.record(RequestContext(request_id="old-1", principal=who), model="m", instance_id=3, node="n",
                    status=200, error=None, prompt_tokens=2, completion_tokens=3, busy_s=0.5, ttft_s=None,
                    failed=False)
    (name,) = _segments(tmp_path)
    journal.close()
    lines = (tmp_path / name).read_text().splitlines()
    old = [json.loads(line) for line in lines]
    at = ROW_FIELDS.index("team_id")
    assert [r[at:at + 2] for r in old] == [[0, ""]]  # the principal named no team
    assert ROW_FIELDS[at:at + 3] == ("team_id", "team_slug", "resumes")
    (tmp_path / name).write_text("".join(json.dumps(r[:at] + r[at + 3:]) + "\n" for r in old))
    assert replay_journal(tmp_path) == 1
    assert list(RequestLog.objects.values_list("request_id", "team_id", "team_slug", "resumes")) == [
        ("old-1", team.pk, "old", 0)]
    assert list(UsageBucket.objects.values_list("team_id", "team_slug", "prompt_tokens")) == [(team.pk, "old", 2)]


@pytest.mark.django_db
def test_a_segment_of_the_version_before_resumed_streams_replays_with_no_resumes(tmp_path):
    """Records written before rows counted resumed streams (one field shorter) replay as rows with
    `resumes` 0; a record of the current length keeps its count."""
    import json

    from serving.proxy.usage import ROW_FIELDS

    journal = UsageJournal(tmp_path)
    recorder = UsageRecorder(journal=journal)
    who = Principal(user_id=1, username="ada", role="viewer", key_id=5, key_name="k")
    for n, resumes in (("before-1", 0), ("now-1", 2)):
        ctx = RequestContext(request_id=n, principal=who)
        ctx.resumes = resumes
        recorder.record(ctx, model="m", instance_id=3, node="n", status=200, error=None, prompt_tokens=2,
                        completion_tokens=3, busy_s=0.5, ttft_s=None, failed=False)
    (name,) = _segments(tmp_path)
    journal.close()
    records = [json.loads(line) for line in (tmp_path / name).read_text().splitlines()]
    at = ROW_FIELDS.index("resumes")
    assert [r[at] for r in records] == [0, 2]
    records[0] = records[0][:at] + records[0][at + 1:]  # as the version before wrote it
    (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in records))
    assert replay_journal(tmp_path) == 2
    assert sorted(RequestLog.objects.values_list("request_id", "resumes", "prompt_tokens")) == [
        ("before-1", 0, 2), ("now-1", 2, 2)]


@pytest.mark.django_db(transaction=True)
async def test_a_flush_cancelled_mid_write_writes_its_rows_once(tmp_path):
    """stop() at a shutdown cancels the writer while its write runs in a database thread: the
    thread commits all the same, and the rows it wrote were given back and written again by the
    stop's own flush (CI, 2026-12-07: two identical 499 rows in test_abandoned_requests and in
    test_web_sigterm). The cancel comes at several moments of the write, one round each."""
    import asyncio
    from collections import Counter

    from asgiref.sync import sync_to_async

    recorder = UsageRecorder(journal=UsageJournal(tmp_path))
    delays = (0.0, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032)
    for n, delay in enumerate(delays):
        _record(recorder, 2, prefix=f"r{n}")
        flushing = asyncio.ensure_future(recorder.flush())
        await asyncio.sleep(delay)
        flushing.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await flushing
        await recorder.flush()  # what stop() does next
    ids = await sync_to_async(lambda: list(RequestLog.objects.values_list("request_id", flat=True)))()
    twice = {i: c for i, c in Counter(ids).items() if c > 1}
    assert not twice, twice
    assert len(ids) == 3 * len(delays)
    assert _segments(tmp_path) == []
