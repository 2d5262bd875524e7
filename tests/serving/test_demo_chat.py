"""The embedded default's demo chat model (SmolLM2-135M-Instruct, from its wheel) answers in English.

The only test with XGEN_DEMO_MODEL=true and a real model: a console puts the model in its store
on first start, loads it on the CPU default (llama-server where it is built) and answers a question through the proxy.
"""
from __future__ import annotations

import re
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import start_console
from tests.procs import stop_process
from tests.serving.conftest import set_console_backends, wait_api


def test_the_demo_chat_model_answers_an_english_question(tmp_path):
    from django.conf import settings

    from hub.demo import CHAT_DEMO

    wheels = Path(settings.CACHE_DIR) / "wheels"
    if not (wheels / CHAT_DEMO.wheel_name).is_file():
        pytest.fail(f"no {CHAT_DEMO.wheel_name} in {wheels}: `{CHAT_DEMO.fetch_command(wheels)}` "
                    "(deploy/bootstrap.sh does)")
    c = start_console(tmp_path / "console", extra_env={"XGEN_DEMO_MODEL": "true", "XGEN_CACHE_DIR": str(settings.CACHE_DIR)})
    try:
        set_console_backends(c)
        key = c.manage("createapikey", "--username", "admin").stdout.strip()
        auth = {"Authorization": f"Bearer {key}"}
        deadline = time.monotonic() + 60  # the agent puts the demo models in the store as it starts
        while True:
            r = httpx.post(f"{c.url}/api/management/load", headers=auth, timeout=10,
                           json={"model_path": CHAT_DEMO.prefix, "model_name": "smollm2"})
            if r.status_code == 202 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert r.status_code == 202, r.text
        assert r.json()["backend"] == "llama-server", "the CPU default (llama-server, built here) serves the demo"
        url = f"{c.url}/api/management/instances/{r.json()['id']}"
        inst = wait_api(url, key, lambda b: b["state"] in ("READY", "ERROR"), timeout=180)
        assert inst["state"] == "READY", inst
        chat = httpx.post(f"{c.url}/v1/chat/completions", headers=auth, timeout=120, json={
            "model": "smollm2", "temperature": 0, "max_tokens": 48,
            # Not "What is the capital of France?": to that SmolLM2 Q4_1 answers, greedily, with a French
            # phrase first ("L'Étoile, la Marseillaise. Paris is ..."), on both engines.
            "messages": [{"role": "user", "content": "Which city is the capital of France?"}]})
        assert chat.status_code == 200, chat.text
        answer = chat.json()["choices"][0]["message"]["content"]
        print(f"\nSmolLM2, temperature 0: {answer!r}")
        words = re.findall(r"[A-Za-z]+", answer)
        assert answer.strip() and answer.isascii() and len(words) >= 3, answer
        assert "the chat demo model" not in c.log, "the wheel was there: nothing to say about it"
    finally:
        assert stop_process(c.proc, timeout=30) == 0, c.log[-3000:]
