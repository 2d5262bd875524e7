"""SIGTERM to the web process while a stream is answered and requests wait in the queue (issue 23,
item 4): the process ends within its shutdown grace, every client gets an end (the stream an end
of its own, the queued requests an answer), the request log holds each request exactly once
after the restart, and nothing is left running."""
from __future__ import annotations

import signal
import threading
import time

import httpx

from tests.faults.conftest import open_console, serve_backends

ENDLESS = "root ::= [a-z ] root"


class Client(threading.Thread):
    """One request in its own thread: the status, the text received and whether it ended (any way)."""

    def __init__(self, url: str, auth: dict, body: dict) -> None:
        super().__init__(daemon=True)
        self.url, self.auth, self.body = url, auth, body
        self.status: int | None = None
        self.text = ""
        self.ended = threading.Event()
        self.first_event = threading.Event()
        self.start()

    def run(self) -> None:
        try:
            with httpx.stream("POST", f"{self.url}/v1/chat/completions", json=self.body, headers=self.auth,
                              timeout=httpx.Timeout(120.0)) as r:
                self.status = r.status_code
                for text in r.iter_text():
                    self.text += text
                    if "data: " in self.text:
                        self.first_event.set()
        except httpx.HTTPError as exc:
            self.text += f"\n<{exc.__class__.__name__}>"
        finally:
            self.ended.set()


def _rows(c, model: str) -> list[dict]:
    r = httpx.get(f"{c.url}/api/requests", params={"model": model, "limit": 100}, headers=c.auth, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()["items"]


def test_sigterm_with_a_stream_and_a_queue_ends_everything_and_loses_no_row(tmp_path, tiny_gguf, consoles):
    env = {"XGEN_USAGE_FLUSH": "1", "XGEN_SHUTDOWN_GRACE_S": "5", "XGEN_QUEUE_TIMEOUT_S": "120"}
    c = open_console(tmp_path / "console", extra_env=env)
    consoles.append(c)
    r = c.post("/api/management/load", {"model_path": str(tiny_gguf), "model_name": "tiny-term",
                                        "extra_args": {"--n_ctx": 4096}, "max_concurrency": 1})
    assert r.status_code == 202, r.text
    iid = r.json()["id"]
    assert c.wait_instance(iid, lambda b: b["state"] in ("READY", "ERROR"))["state"] == "READY"

    long = {"model": "tiny-term", "stream": True, "max_tokens": 4000, "grammar": ENDLESS,
            "messages": [{"role": "user", "content": "a long story"}]}
    stream = Client(c.url, c.auth, long)
    assert stream.first_event.wait(60), stream.text
    queued = [Client(c.url, c.auth, {**long, "stream": i == 0, "max_tokens": 4}) for i in range(2)]
    deadline = time.monotonic() + 20
    while "xgen_queue_depth{model=\"tiny-term\"} 2.0" not in httpx.get(f"{c.url}/metrics", headers=c.auth).text:
        assert time.monotonic() < deadline, "the two requests never waited in the queue"
        time.sleep(0.05)

    sent = time.monotonic()
    c.console.proc.send_signal(signal.SIGTERM)
    code = c.console.proc.wait(timeout=60)
    exited_s = time.monotonic() - sent
    assert code == 0, c.console.log[-3000:]
    assert exited_s < 30, f"the console took {exited_s:.1f} s to stop"
    for client in (stream, *queued):
        assert client.ended.wait(10), "a client is still waiting after the console stopped"
    assert not stream.text.rstrip().endswith("[DONE]"), "the long stream finished: the test proves nothing"
    assert serve_backends(c.console.data_dir) == [], "a backend outlived the console"
    assert "Traceback" not in c.console.log, c.console.log[-5000:]

    again = open_console(c.console.data_dir, key=c.key)  # the same data dir and database
    consoles.append(again)
    rows = _rows(again, "tiny-term")
    print(f"\nexited after {exited_s:.2f} s; rows: {[(r['status'], r['error']) for r in rows]}; "
          f"stream tail: {stream.text[-160:]!r}; queued: {[(q.status, q.text[-120:]) for q in queued]}")
    assert '"code": "shutting_down"' in stream.text.rsplit("data: ", 1)[-1], "the stream is told why it ends"
    assert [q.status for q in queued] == [503, 503] and all("shutting_down" in q.text for q in queued)
    assert len(rows) == 3, [(r["status"], r["error"], r["request_id"]) for r in rows]
    assert len({r["request_id"] for r in rows}) == 3
