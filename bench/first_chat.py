"""A newcomer's wait: `bash deploy/bootstrap.sh run` on a fresh clone until the first page and the first answered chat.

Clones this repository (its HEAD) into a temporary folder and runs the bootstrap there as a
fresh machine would: no pip cache (PIP_NO_CACHE_DIR=1) and an empty XGEN_CACHE_DIR, so
llama.cpp is compiled and every package and the demo model's wheel downloaded. Once the console
answers (the first page: the sign-in page, 200), does what the README tells a newcomer: an API key
for `admin`, load the demo chat model (it waits for the llama.cpp build when that still runs),
ask it one question. Then, on a fresh machine, waits for the rest of the llama.cpp build (llama-server
on the node API): the same run's baseline, since a first chat that waited for the whole compile (as
before the build staged its libraries) could come no sooner. Prints when each step was reached and
the first chat as a ratio to that baseline, then stops the console and deletes the clone (--keep
keeps it). Standard library only: it runs before any venv exists.

    python3 bench/first_chat.py [--keep] [--warm]   # --warm: keep pip's and XGEN_CACHE_DIR's caches
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
QUESTION = "Which city is the capital of France?"
DEMO_PREFIX = "gguf/smollm2-135m-instruct"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def call(url: str, *, body: dict | None = None, key: str = "", timeout: float = 30) -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method="POST" if body is not None else "GET",
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {key}"} if key else {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")
    except (urllib.error.URLError, OSError, ValueError):
        return 0, {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", action="store_true", help="keep the clone and its caches")
    parser.add_argument("--warm", action="store_true", help="use this machine's pip cache and XGEN_CACHE_DIR")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="xgen-first-chat-"))
    clone = work / "clone"
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
    port = free_port()
    env = {**os.environ, "XGEN_PORT": str(port), "XGEN_ADMIN_PASSWORD": "first-chat-pass-123",
           "PYTHONUNBUFFERED": "1"}
    env.pop("VIRTUAL_ENV", None)
    if not args.warm:
        env["PIP_NO_CACHE_DIR"] = "1"
        env["XGEN_CACHE_DIR"] = str(work / "cache")
    log_path = work / "bootstrap.log"
    marks: list[tuple[float, str]] = []
    start = time.monotonic()

    def mark(what: str) -> None:
        marks.append((time.monotonic() - start, what))
        print(f"{marks[-1][0] / 60:6.2f} min  {what}", flush=True)

    load_before = os.getloadavg()
    proc = subprocess.Popen(["bash", "deploy/bootstrap.sh", "run"], cwd=clone, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)

    def follow() -> None:
        with open(log_path, "w") as log:
            for raw in proc.stdout:
                line = raw.decode(errors="replace").rstrip()
                log.write(f"{time.monotonic() - start:8.1f}s {line}\n")
                log.flush()
                if line.startswith("llama.cpp") or "could not" in line or "error" in line.lower():
                    mark(f"bootstrap: {line[:150]}")

    threading.Thread(target=follow, daemon=True).start()
    base = f"http://127.0.0.1:{port}"
    answer = ""
    first_page = chat_at = built_at = float("nan")
    try:
        while call(f"{base}/healthz", timeout=2)[0] != 200:
            if proc.poll() is not None:
                raise SystemExit(f"bootstrap exited with {proc.returncode}; see {log_path}")
            time.sleep(1)
        mark("console answers /healthz")
        with urllib.request.urlopen(f"{base}/accounts/login/", timeout=30) as r:
            assert r.status == 200, r.status
        mark("first page: /accounts/login/ 200")
        first_page = marks[-1][0]
        key = subprocess.run([str(clone / ".venv/bin/python"), "manage.py", "createapikey", "--username", "admin"],
                             cwd=clone, env=env, capture_output=True, text=True, check=True).stdout.strip()
        mark("API key for admin")
        deadline = time.monotonic() + 120
        while True:
            status, body = call(f"{base}/api/management/load", key=key,
                                body={"model_path": DEMO_PREFIX, "model_name": "smollm2"})
            if status == 202 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        if status != 202:
            raise SystemExit(f"load refused: {status} {body}")
        mark(f"load accepted ({body['backend']})")
        iid = body["id"]
        while True:
            _, inst = call(f"{base}/api/management/instances/{iid}", key=key)
            if inst.get("state") in ("READY", "ERROR"):
                break
            time.sleep(0.2)
        if inst["state"] != "READY":
            raise SystemExit(f"the demo model did not load: {inst.get('error')}")
        mark("demo chat model READY")
        status, chat = call(f"{base}/v1/chat/completions", key=key, timeout=120, body={
            "model": "smollm2", "temperature": 0, "max_tokens": 48,
            "messages": [{"role": "user", "content": QUESTION}]})
        if status != 200:
            raise SystemExit(f"chat failed: {status} {chat}")
        answer = chat["choices"][0]["message"]["content"]
        mark(f"first answered chat: {QUESTION!r} -> {answer!r}")
        chat_at = marks[-1][0]
        if not args.warm:  # the baseline: the whole compile's end, llama-server on the node
            deadline = time.monotonic() + 1800
            while time.monotonic() < deadline:
                _, nodes = call(f"{base}/api/hardware/nodes", key=key)
                if isinstance(nodes, list) and nodes and "llama-server" in nodes[0].get("backends", []) \
                        and not nodes[0].get("llama_build"):
                    mark("llama.cpp built: llama-server on the node (the baseline)")
                    built_at = marks[-1][0]
                    break
                time.sleep(2)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # the console stops its backends on SIGTERM
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        if args.keep:
            print(f"kept {work} (bootstrap log: {log_path})")
        else:
            shutil.copy(log_path, Path(tempfile.gettempdir()) / "xgen-first-chat-bootstrap.log")
            shutil.rmtree(work, ignore_errors=True)
    print(f"\nfresh clone -> first page: {first_page:.0f} s; -> first answered chat: {chat_at / 60:.1f} min "
          f"({'warm caches' if args.warm else 'no pip cache, empty XGEN_CACHE_DIR'}; {os.cpu_count()} CPUs; "
          f"load average {load_before[0]:.1f} before, {os.getloadavg()[1]:.1f} over the last 5 min)")
    if built_at == built_at:  # not NaN
        print(f"the whole llama.cpp build ended at {built_at / 60:.1f} min (a first chat that waits for it comes "
              f"no sooner): first chat / that baseline = {chat_at / built_at:.2f}x")
    sys.exit(0 if answer else 1)


if __name__ == "__main__":
    main()
