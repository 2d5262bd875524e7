"""Which local paths an upload may read (issue 17 items 1 and 6): only under XGEN_IMPORT_DIRS, never
the console's own data, store, models or log dir, never through a symlink that leads out, and never
a FIFO, socket or device. Real files, real symlinks, real FIFOs and sockets; nothing mocked."""
from __future__ import annotations

import json
import os
import socket
import sqlite3
import subprocess
import tempfile
import threading
from pathlib import Path

import pytest
from django.test import Client

from hub.imports import HubInputError, check_import_path, console_paths
from hub.models import ModelArtifact, PrefixLock, UploadJob
from hub.store import FilesystemModelStore
from tests.conftest import REPO, bearer
from tests.hub.conftest import make_model_dir, run_uploads
from tests.procs import PYTHON

pytestmark = pytest.mark.django_db

HF_FILES = {"config.json": b'{"model_type": "llama"}', "model.safetensors": b"\x01" * 1000}


@pytest.fixture
def imports(settings, hub_dirs) -> Path:
    """One import dir in the test's tmp dir; the store and models dirs are beside it (hub_dirs)."""
    root = hub_dirs / "imports"
    root.mkdir()
    settings.IMPORT_DIRS = [root]
    return root


def _upload(key: str, local_path, fmt: str = "gguf", name: str = "loot"):
    body = {"local_path": str(local_path), "format": fmt, "name": name}
    return Client().post("/api/storage/upload", data=json.dumps(body), content_type="application/json",
                         **bearer(key))


def _refused(resp, *words: str) -> str:
    """A 400 in the OpenAI error shape; returns the message (which must hold every word)."""
    assert resp.status_code == 400, resp.content
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "code"}
    assert err["type"] == "invalid_request_error" and err["code"] == "invalid_request"
    for word in words:
        assert word in err["message"], err["message"]
    return err["message"]


def _store_is_empty(hub_dirs: Path) -> None:
    assert FilesystemModelStore(hub_dirs / "store").scan_models() == []
    assert not ModelArtifact.objects.exists()
    assert not UploadJob.objects.exists() and not PrefixLock.objects.exists()  # refused before any job
    store_root = hub_dirs / "store"
    assert not store_root.exists() or not any(p.is_file() for p in store_root.rglob("*"))


# ---------------------------------------------------------------- the console's own dirs
@pytest.fixture
def loot_in_data_dir(settings):
    """A .gguf file in the real data dir (beside secret_key and the test database), as in the issue."""
    loot = Path(settings.DATA_DIR) / "loot.gguf"
    loot.write_bytes(b"GGUF" + b"\0" * 100)
    yield loot
    loot.unlink(missing_ok=True)


def test_the_data_dir_and_a_file_in_it_are_refused(settings, hub_dirs, operator, loot_in_data_dir):
    # Even with an import dir that covers the data dir (the system temp dir holds it here).
    settings.IMPORT_DIRS = [Path(tempfile.gettempdir()).resolve()]
    data_dir = Path(settings.DATA_DIR)
    _refused(_upload(operator.key, data_dir), "data dir")
    _refused(_upload(operator.key, loot_in_data_dir), "data dir")
    _refused(_upload(operator.key, f"{data_dir}/../{data_dir.name}/loot.gguf"), "data dir")
    # A folder that holds the data dir is refused as a whole.
    _refused(_upload(operator.key, data_dir.parent), "holds the console's data dir")
    _store_is_empty(hub_dirs)


@pytest.mark.parametrize("which", ["STORE_DIR", "MODELS_DIR", "LOG_DIR"])
def test_the_store_models_and_log_dirs_are_refused(settings, hub_dirs, operator, which):
    settings.IMPORT_DIRS = [hub_dirs]  # the import dir covers them all: still refused
    settings.LOG_DIR = hub_dirs / "logs"
    store = FilesystemModelStore(settings.STORE_DIR)
    store.upload_model("gguf/kept", make_model_dir(hub_dirs / "src", {"kept.gguf": b"k" * 10}))
    target = Path(getattr(settings, which))
    if which != "STORE_DIR":
        make_model_dir(target / "x", {"weights.gguf": b"w" * 10})
    inner = next(target.rglob("*.gguf"))
    dir_word = {"STORE_DIR": "store dir", "MODELS_DIR": "models dir", "LOG_DIR": "log dir"}[which]
    _refused(_upload(operator.key, target), dir_word)
    _refused(_upload(operator.key, inner), dir_word)
    _refused(_upload(operator.key, hub_dirs), "holds the console's")
    assert [m.prefix for m in store.scan_models()] == ["gguf/kept"]
    assert not ModelArtifact.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_a_refused_upload_of_the_data_dir_leaves_the_live_database_alone(settings, hub_dirs, operator,
                                                                          loot_in_data_dir):
    from django.db import connection

    from accounts.models import User

    settings.IMPORT_DIRS = [Path(tempfile.gettempdir()).resolve()]
    db_file = Path(connection.settings_dict["NAME"])
    assert db_file.parent.resolve() == Path(settings.DATA_DIR).resolve() and db_file.is_file()
    assert any(what == "database" and path == db_file.resolve() for what, path in console_paths())
    _refused(_upload(operator.key, settings.DATA_DIR), "data dir")
    _refused(_upload(operator.key, db_file), "data dir")
    # Another SQLite client comes and goes (the step that removed -shm after the locks were dropped) ...
    outside = subprocess.run([PYTHON, "-c", "import sqlite3, sys; c = sqlite3.connect(sys.argv[1]); "
                              "print(c.execute('select count(*) from xgenconsole_user').fetchone()[0]); c.close()",
                              str(db_file)], capture_output=True, text=True, timeout=60)
    assert outside.returncode == 0 and int(outside.stdout) == User.objects.count() == 1, outside.stderr
    # ... and the server's connection still reads a sound database.
    assert User.objects.get().username == operator.user.username
    with connection.cursor() as cur:
        cur.execute("PRAGMA quick_check")
        assert cur.fetchone()[0] == "ok"
    with sqlite3.connect(db_file) as check:
        assert check.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    _store_is_empty(hub_dirs)


# ---------------------------------------------------------------- XGEN_IMPORT_DIRS
def test_a_path_outside_the_import_dirs_is_refused(imports, hub_dirs, operator, tiny_gguf):
    elsewhere = make_model_dir(hub_dirs / "elsewhere", {"m.gguf": b"m" * 10})
    for path in (elsewhere / "m.gguf", elsewhere, tiny_gguf, f"{imports}/../elsewhere/m.gguf", "/etc/passwd",
                 "/no/such/file.gguf"):
        _refused(_upload(operator.key, path), "not under XGEN_IMPORT_DIRS", str(imports))
    with pytest.raises(HubInputError, match="not a valid file name"):  # the API's schema refuses it first
        check_import_path(f"{imports}/\ud800.gguf")
    _store_is_empty(hub_dirs)


def test_no_import_dirs_refuses_every_local_path(settings, imports, hub_dirs, operator, admin):
    model = make_model_dir(imports / "ok", {"ok.gguf": b"o" * 10})
    settings.IMPORT_DIRS = []
    _refused(_upload(operator.key, model / "ok.gguf"), "set XGEN_IMPORT_DIRS")
    _refused(_upload(operator.key, model), "set XGEN_IMPORT_DIRS")
    c = Client()
    c.force_login(admin.user)
    resp = c.post("/models/upload/", {"local_path": str(model / "ok.gguf"), "format": "gguf", "name": "ok"})
    assert resp.status_code == 400 and "set XGEN_IMPORT_DIRS" in resp.content.decode()
    assert "Uploads from local paths are off" in c.get("/models/upload/").content.decode()
    _store_is_empty(hub_dirs)


# ---------------------------------------------------------------- symlinks
def test_a_symlink_that_leads_out_of_the_import_dirs_is_refused(settings, imports, hub_dirs, operator,
                                                                loot_in_data_dir):
    outside = make_model_dir(hub_dirs / "outside", {"secret.gguf": b"s" * 10})
    # The path named is itself a symlink, to a file or a folder outside.
    (imports / "link.gguf").symlink_to(outside / "secret.gguf")
    (imports / "linkdir").symlink_to(outside)
    (imports / "datalink").symlink_to(settings.DATA_DIR)
    for path in ("link.gguf", "linkdir", "datalink"):
        _refused(_upload(operator.key, imports / path), "not under XGEN_IMPORT_DIRS", "leads to")
    # A file inside a folder under the import dir is a symlink to /etc, to a file outside, or into the data dir.
    hf = make_model_dir(imports / "hf", HF_FILES)
    (hf / "tokenizer.json").symlink_to("/etc/passwd")
    _refused(_upload(operator.key, hf, "huggingface"), "tokenizer.json", "/etc/passwd", "not under XGEN_IMPORT_DIRS")
    gg = make_model_dir(imports / "gg", {"a.gguf": b"a" * 10})
    (gg / "b.gguf").symlink_to(outside / "secret.gguf")
    _refused(_upload(operator.key, gg), "b.gguf", "not under XGEN_IMPORT_DIRS")
    # Even when the import dir covers the data dir, a symlink into it is refused.
    settings.IMPORT_DIRS = [imports, Path(tempfile.gettempdir()).resolve()]
    dd = make_model_dir(imports / "dd", {"a.gguf": b"a" * 10})
    (dd / "key.gguf").symlink_to(loot_in_data_dir)
    _refused(_upload(operator.key, dd), "key.gguf", "data dir")
    (imports / "loot.gguf").symlink_to(loot_in_data_dir)
    _refused(_upload(operator.key, imports / "loot.gguf"), "data dir")
    _store_is_empty(hub_dirs)


# ---------------------------------------------------------------- special files
@pytest.mark.timeout(60)
@pytest.mark.django_db(transaction=True)  # the request runs in a thread, on its own connection
@pytest.mark.parametrize("special", ["fifo", "socket", "symlink-to-fifo"])
def test_a_folder_with_a_fifo_or_socket_is_refused_without_blocking(imports, hub_dirs, operator, special):
    from django.db import connection

    model = make_model_dir(imports / "m", {"a.gguf": b"a" * 10})
    sock = None
    if special == "fifo":
        os.mkfifo(model / "b.gguf")
    elif special == "socket":
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(model / "b.gguf"))
    else:
        os.mkfifo(imports / "pipe")
        (model / "b.gguf").symlink_to(imports / "pipe")
    result: dict = {}

    def request() -> None:
        try:
            result["resp"] = _upload(operator.key, model)
        finally:
            connection.close()

    # In a thread, so a request that blocks on the FIFO fails the test instead of hanging the run.
    t = threading.Thread(target=request, daemon=True)
    t.start()
    t.join(15)
    try:
        assert not t.is_alive(), "the upload request blocked on a special file"
        kind = "socket" if special == "socket" else "FIFO"
        _refused(result["resp"], "b.gguf", kind, "not a regular file")
    finally:
        for fifo in (model / "b.gguf", imports / "pipe"):  # release a reader stuck on a FIFO
            if fifo.exists() and fifo.is_fifo():
                try:
                    os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
                except OSError:  # no reader waits on it
                    pass
        t.join(5)
        if sock is not None:
            sock.close()
    _store_is_empty(hub_dirs)


def test_a_device_is_refused(settings, imports, hub_dirs, operator):
    settings.IMPORT_DIRS = [imports, Path("/dev")]  # allowed folders: refused for being a device
    (imports / "zero.gguf").symlink_to("/dev/zero")
    _refused(_upload(operator.key, imports / "zero.gguf"), "character device")
    m = make_model_dir(imports / "m", {"a.gguf": b"a"})
    (m / "b.gguf").symlink_to("/dev/zero")
    _refused(_upload(operator.key, m), "character device")
    _store_is_empty(hub_dirs)


# ---------------------------------------------------------------- what is still allowed
def test_an_allowed_path_still_uploads(imports, hub_dirs, operator, tiny_gguf):
    inside = make_model_dir(imports / "shared", {"w.gguf": b"w" * 100})
    gg = make_model_dir(imports / "gg", {"a.gguf": b"a" * 10})
    (gg / "b.gguf").symlink_to(inside / "w.gguf")  # a symlink that stays inside the import dirs
    (gg / "sub").symlink_to(hub_dirs)  # a symlinked folder is not walked, so it reads nothing
    resp = _upload(operator.key, gg, name="gg")
    assert resp.status_code == 202, resp.content
    assert [j.status for j in run_uploads()] == ["COMPLETED"]
    store = FilesystemModelStore(hub_dirs / "store")
    assert sorted(f.path for f in store.read_manifest("gguf/gg").files) == ["a.gguf", "b.gguf"]
    (imports / "tiny.gguf").symlink_to(inside / "w.gguf")
    resp = _upload(operator.key, imports / "tiny.gguf", name="single")
    assert resp.status_code == 202 and resp.json()["bytes_total"] == 100
    hf = make_model_dir(imports / "hf", HF_FILES)
    assert _upload(operator.key, hf, "huggingface", "hf").status_code == 202
    assert [j.status for j in run_uploads()] == ["COMPLETED", "COMPLETED"]
    assert ModelArtifact.objects.get(prefix="gguf/single").file_count == 1
    assert sorted(m.prefix for m in store.scan_models()) == ["gguf/gg", "gguf/single", "huggingface/hf"]


def test_the_upload_page_follows_the_same_rule(settings, imports, hub_dirs, admin, loot_in_data_dir):
    c = Client()
    c.force_login(admin.user)
    page = c.get("/models/upload/").content.decode()
    assert str(imports) in page  # the page says where uploads may come from
    for path, word in ((loot_in_data_dir, "not under XGEN_IMPORT_DIRS"), ("/etc/passwd", "not under")):
        resp = c.post("/models/upload/", {"local_path": str(path), "format": "gguf", "name": "loot"})
        assert resp.status_code == 400 and word in resp.content.decode()
    settings.IMPORT_DIRS = [Path(tempfile.gettempdir()).resolve()]
    resp = c.post("/models/upload/", {"local_path": str(settings.DATA_DIR), "format": "gguf", "name": "loot"})
    assert resp.status_code == 400 and "data dir" in resp.content.decode()
    _store_is_empty(hub_dirs)
    ok = make_model_dir(imports / "ok", {"ok.gguf": b"o" * 10})
    resp = c.post("/models/upload/", {"local_path": str(ok), "format": "gguf", "name": "ok"})
    assert resp.status_code == 302
    assert [j.status for j in run_uploads()] == ["COMPLETED"]


# ---------------------------------------------------------------- the admin's CLI
def test_hub_upload_is_not_limited_to_the_import_dirs_but_refuses_the_consoles_dirs(
        settings, imports, hub_dirs, loot_in_data_dir, capsys):
    from django.core.management import CommandError, call_command

    settings.IMPORT_DIRS = []
    elsewhere = make_model_dir(hub_dirs / "elsewhere", {"m.gguf": b"m" * 10})
    call_command("hub_upload", str(elsewhere), "--format", "gguf", "--name", "cli-elsewhere")
    assert "gguf/cli-elsewhere: 1 files" in capsys.readouterr().out
    for path in (settings.DATA_DIR, loot_in_data_dir):
        with pytest.raises(CommandError, match="data dir"):
            call_command("hub_upload", str(path), "--format", "gguf", "--name", "loot")
    with pytest.raises(CommandError, match="store dir"):
        call_command("hub_upload", str(hub_dirs / "store"), "--format", "gguf", "--name", "loot")
    os.mkfifo(elsewhere / "pipe.gguf")
    with pytest.raises(CommandError, match="FIFO"):
        call_command("hub_upload", str(elsewhere), "--format", "gguf", "--name", "cli-elsewhere")
    assert [m.prefix for m in FilesystemModelStore(hub_dirs / "store").scan_models()] == ["gguf/cli-elsewhere"]


def test_an_import_dir_inside_the_data_dir_stops_the_start(tmp_path):
    data = tmp_path / "data"
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "xgenconsole.settings", "XGEN_DATA_DIR": str(data),
           "XGEN_IMPORT_DIRS": f"{tmp_path / 'ok'},{data / 'imports'}"}
    proc = subprocess.run([PYTHON, str(REPO / "manage.py"), "check"], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0 and "XGEN_IMPORT_DIRS" in proc.stderr and "inside XGEN_DATA_DIR" in proc.stderr


def test_a_split_gguf_loads_with_each_shard_checked_under_the_same_rules(settings, imports, hub_dirs):
    """check_load_path on the first shard of a split GGUF: the siblings a backend opens are found by
    name and checked like the file named (the rules resolved once for all of them); one that leads
    out of the import dirs (here into the console's data dir) refuses the load."""
    from hub.imports import check_load_path

    folder = imports / "split"
    folder.mkdir()
    sizes = {}
    for i in (1, 2, 3):
        name = f"model-{i:05d}-of-00003.gguf"
        (folder / name).write_bytes(b"GGUF" + b"\0" * (100 * i))
        sizes[name] = 4 + 100 * i
    source = check_load_path(str(folder / "model-00001-of-00003.gguf"))
    assert (source.format, source.size_bytes) == ("gguf", sum(sizes.values()))
    assert source.serve == Path(os.path.realpath(folder)) / "model-00001-of-00003.gguf"

    secret = Path(settings.DATA_DIR) / "model-00002-of-00003.gguf"
    secret.parent.mkdir(parents=True, exist_ok=True)
    secret.write_bytes(b"GGUF" + b"\0" * 10)
    (folder / "model-00002-of-00003.gguf").unlink()
    (folder / "model-00002-of-00003.gguf").symlink_to(secret)
    with pytest.raises(HubInputError, match="model-00002-of-00003.gguf .* is not under XGEN_IMPORT_DIRS"):
        check_load_path(str(folder / "model-00001-of-00003.gguf"))
