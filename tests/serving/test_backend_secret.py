"""Only the console talks to a backend (issue 34 #7): each launch makes a secret the backend
requires (llama-server reads it from a 0600 file, llama-cpp-python from its environment); the
agent's health check and warm-up send it, no argv, log or key file keeps it. Real engines."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from asgiref.sync import sync_to_async

from serving.models import InstanceState, ModelInstance
from serving.node.logs import current_log
from serving.node.processes import backend_key_file
from tests.conftest import llama_server_binary
from tests.serving.conftest import wait_state

pytestmark = pytest.mark.django_db(transaction=True)


def _load(path: Path, name: str, backend: str) -> ModelInstance:
    from serving.control.services import request_load

    return request_load(model_path=str(path), model_name=name, backend=backend)


def _start_with_plan(model: Path, name: str, change: Callable[[list[str]], list[str]]) -> ModelInstance:
    """A llama-server instance started with its stored argv changed by `change` (on_demand: it
    stays IDLE, with no process, until the plan is changed)."""
    from serving.control.services import request_load, request_start

    llama_server_binary()
    inst = request_load(model_path=str(model), model_name=name, backend="llama-server", policy="on_demand")
    inst.plan["argv"] = change(list(inst.plan["argv"]))
    ModelInstance.objects.filter(pk=inst.pk).update(plan=inst.plan)
    return request_start(instance=inst)


def _chat(port: int, model: str, secret: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {secret}"} if secret is not None else {}
    return httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", headers=headers, timeout=30,
                      json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})


async def test_a_backend_refuses_whoever_lacks_its_secret(agent, tiny_gguf, engine):
    inst = await sync_to_async(_load)(tiny_gguf, f"guarded-{engine}", engine)
    inst = await wait_state(inst.pk, {InstanceState.READY, InstanceState.ERROR})
    assert inst.state == InstanceState.READY, inst.last_error  # health and warm-up went through with it
    secret = inst.backend_key
    assert len(secret) >= 32
    assert (await sync_to_async(_chat)(inst.port, inst.model_name)).status_code == 401
    assert (await sync_to_async(_chat)(inst.port, inst.model_name, "x" * 43)).status_code == 401
    assert (await sync_to_async(_chat)(inst.port, inst.model_name, secret)).status_code == 200
    cmdline = Path(f"/proc/{inst.pid}/cmdline").read_bytes().decode()
    assert secret not in cmdline and secret not in current_log(inst.pk).read_text()
    assert not backend_key_file(inst.pk).exists(), "the key file is removed once the backend has read it"
    if engine == "llama-server":
        assert "--api-key-file" in cmdline.split("\0")
    else:
        environ = Path(f"/proc/{inst.pid}/environ").read_bytes().decode().split("\0")
        assert f"API_KEY={secret}" in environ
    # A restart is a new launch: a new secret, the old one is refused.
    await sync_to_async(inst.note_restart_requested)()
    agent.nudge()
    deadline = time.monotonic() + 60
    again = inst
    while again.backend_key in ("", secret) or again.state != InstanceState.READY:  # READY again, relaunched
        assert again.state != InstanceState.ERROR and time.monotonic() < deadline, (again.state, again.last_error)
        await asyncio.sleep(0.1)
        again = await sync_to_async(ModelInstance.objects.get)(pk=inst.pk)
    assert again.pid != inst.pid
    assert (await sync_to_async(_chat)(again.port, again.model_name, secret)).status_code == 401
    assert (await sync_to_async(_chat)(again.port, again.model_name, again.backend_key)).status_code == 200


async def test_a_llama_server_plan_stored_before_secrets_gets_one_too(agent, tiny_gguf):
    """A plan from before backend secrets has no key-file slot in its argv: the agent adds the flag
    (only llama-server takes its secret through argv, as a file; the others read their environment)."""
    from serving.control.planning import KEY_FILE_SLOT

    def as_stored_by_0_2(argv: list[str]) -> list[str]:
        at = argv.index(KEY_FILE_SLOT)
        return argv[:at - 1] + argv[at + 1:]

    inst = await sync_to_async(_start_with_plan)(tiny_gguf, "old-plan", as_stored_by_0_2)
    assert "--api-key-file" not in inst.plan["argv"]
    agent.nudge()
    inst = await wait_state(inst.pk, {InstanceState.READY, InstanceState.ERROR})
    assert inst.state == InstanceState.READY, inst.last_error
    assert (await sync_to_async(_chat)(inst.port, inst.model_name)).status_code == 401
    assert (await sync_to_async(_chat)(inst.port, inst.model_name, inst.backend_key)).status_code == 200


async def test_no_key_file_is_left_when_the_backend_cannot_start(agent, tiny_gguf):
    inst = await sync_to_async(_start_with_plan)(tiny_gguf, "no-binary",
                                                 lambda argv: ["/nonexistent/llama-server", *argv[1:]])
    agent.nudge()
    inst = await wait_state(inst.pk, {InstanceState.READY, InstanceState.ERROR})
    assert inst.state == InstanceState.ERROR and "nonexistent" in inst.last_error, inst.last_error
    assert not backend_key_file(inst.pk).exists()
    assert inst.backend_key == ""
