"""CPU per request of the proxy's HTTP/1.1 client (serving/proxy/http1.py) against the 0.2 client
it hardened (the same file at 7a3a6ad, read from git), in the same rounds, on one event loop:
small JSON answers (keep-alive, one at a time and 16 at once) and streams of 100 SSE events
(chunked). The backend is a separate process (a bare asyncio server answering canned bytes),
so only the client's CPU is counted (this process's CPU time while the round runs).

    python bench/http1_client.py [--rounds N] [--scale S] [--baseline COMMIT]
"""
from __future__ import annotations

import argparse
import asyncio
import importlib.util
import multiprocessing
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

JSON_BODY = b'{"id":"x","object":"chat.completion","choices":[{"message":{"content":"hi"}}],' \
            b'"usage":{"prompt_tokens":3,"completion_tokens":1}}'
JSON_ANSWER = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
    len(JSON_BODY), JSON_BODY)
EVENT = b'data: {"choices":[{"delta":{"content":"tok"}}]}\n\n'
STREAM_ANSWER = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                 + b"".join(b"%x\r\n%s\r\n" % (len(EVENT), EVENT) for _ in range(100))
                 + b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n")
REQUEST_BODY = b'{"model":"m","messages":[{"role":"user","content":"hello"}]}'
HEADERS = b"content-type: application/json\r\n"


def _backend(port: int, ready) -> None:
    """Answer every request: /stream with STREAM_ANSWER, anything else with JSON_ANSWER."""

    class Canned(asyncio.Protocol):
        def connection_made(self, transport) -> None:
            self.transport = transport
            self.buf = b""

        def data_received(self, data: bytes) -> None:
            self.buf += data
            while True:
                end = self.buf.find(b"\r\n\r\n")
                if end < 0:
                    return
                head = self.buf[:end]
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                if len(self.buf) < end + 4 + length:
                    return
                self.buf = self.buf[end + 4 + length:]
                self.transport.write(STREAM_ANSWER if b" /stream " in head.split(b"\r\n", 1)[0] else JSON_ANSWER)

    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(Canned, "127.0.0.1", port, backlog=1024)
        ready.set()
        async with server:
            await server.serve_forever()

    asyncio.run(main())


def load_client(label: str, source: str):
    """The module `source` (a file's text) imported under its own name."""
    path = Path(tempfile.mkdtemp()) / f"http1_{label}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"http1_{label}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def one(client, base: str, target: str) -> int:
    response = await client.post(base, target, REQUEST_BODY, HEADERS)
    data = await response.read()
    response.release()
    return len(data)


async def round_cpu(client, base: str, target: str, n: int, concurrency: int) -> float:
    """CPU seconds of this process per request for n requests, `concurrency` at a time."""
    async def worker(count: int) -> None:
        for _ in range(count):
            await one(client, base, target)

    t0 = time.process_time()
    await asyncio.gather(*(worker(n // concurrency) for _ in range(concurrency)))
    return (time.process_time() - t0) / (n // concurrency * concurrency)


async def measure(modules: dict, base: str, rounds: int, scale: float) -> None:
    cases = [("small, c=1", "/v1/chat/completions", int(3000 * scale), 1),
             ("small, c=16", "/v1/chat/completions", int(8000 * scale), 16),
             ("stream of 100 events, c=1", "/stream", int(600 * scale), 1),
             ("stream of 100 events, c=16", "/stream", int(1600 * scale), 16)]
    clients = {label: m.Client(connect_timeout_s=5) for label, m in modules.items()}
    for client in clients.values():  # warm: connections made, code paths run
        await round_cpu(client, base, "/v1/chat/completions", 200, 16)
        await round_cpu(client, base, "/stream", 32, 16)
    for name, target, n, concurrency in cases:
        best = dict.fromkeys(clients, float("inf"))
        for _ in range(rounds):  # interleaved, the least of each taken (the least disturbed)
            for label, client in clients.items():
                best[label] = min(best[label], await round_cpu(client, base, target, n, concurrency))
        old, new = best["0.2"], best["now"]
        print(f"{name:28s} 0.2 client {1e6 * old:7.1f} us/req | now {1e6 * new:7.1f} us/req | "
              f"{new / old:.3f}x ({100 * (new / old - 1):+.1f} %)")
    for client in clients.values():
        await client.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--scale", type=float, default=1.0, help="multiply request counts")
    parser.add_argument("--baseline", default="7a3a6ad", help="the commit whose client is the baseline")
    args = parser.parse_args()
    try:
        old_source = subprocess.run(["git", "-C", str(ROOT), "show", f"{args.baseline}:serving/proxy/http1.py"],
                                    check=True, capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        sys.exit(f"cannot read the baseline client from git ({args.baseline}): {exc}")
    modules = {"0.2": load_client("baseline", old_source),
               "now": load_client("now", (ROOT / "serving/proxy/http1.py").read_text())}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ready = multiprocessing.Event()
    backend = multiprocessing.Process(target=_backend, args=(port, ready), daemon=True)
    backend.start()
    try:
        assert ready.wait(10), "the backend did not start"
        print(f"client CPU per request, least of {args.rounds} interleaved rounds (backend in its own process)")
        asyncio.run(measure(modules, f"http://127.0.0.1:{port}", args.rounds, args.scale))
    finally:
        backend.terminate()
        backend.join(5)


if __name__ == "__main__":
    main()
