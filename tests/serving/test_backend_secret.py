"""Only the console talks to a backend (issue 34 #7): each launch makes a secret the backend
requires (llama-server reads it from a 0600 file, llama-cpp-python from its environment); the
agent's health check and warm-up send it, no argv, log or key file keeps it. Real engines."""
from __future__ import annotations

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
    from serving.services import request_load

    return request_load(model_path=str(path), model_name=name, backend=backend)


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
    await wait_state(inst.pk, {InstanceState.UNLOADING, InstanceState.STOPPED, InstanceState.PENDING,
                               InstanceState.LOADING}, timeout=30)
    again = await wait_state(inst.pk, {InstanceState.READY, InstanceState.ERROR})
    assert again.state == InstanceState.READY, again.last_error
    assert again.backend_key and again.backend_key != secret
    assert (await sync_to_async(_chat)(again.port, again.model_name, secret)).status_code == 401
    assert (await sync_to_async(_chat)(again.port, again.model_name, again.backend_key)).status_code == 200


async def test_a_llama_server_plan_stored_before_secrets_gets_one_too(agent, tiny_gguf):
    """A plan from before backend secrets has no key-file slot in its argv: the agent adds the flag
    (only llama-server takes its secret through argv, as a file; the others read their environment)."""
    from serving.planning import KEY_FILE_SLOT
    from serving.services import request_load, request_start

    llama_server_binary()

    def load_with_an_old_plan() -> ModelInstance:
        # on_demand: it stays IDLE (no process) while its stored plan is made what 0.2's planner stored.
        inst = request_load(model_path=str(tiny_gguf), model_name="old-plan", backend="llama-server",
                            policy="on_demand")
        argv = inst.plan["argv"]
        at = argv.index(KEY_FILE_SLOT)
        inst.plan["argv"] = argv[:at - 1] + argv[at + 1:]
        ModelInstance.objects.filter(pk=inst.pk).update(plan=inst.plan)
        return request_start(instance=inst)

    inst = await sync_to_async(load_with_an_old_plan)()
    assert "--api-key-file" not in inst.plan["argv"]
    agent.nudge()
    inst = await wait_state(inst.pk, {InstanceState.READY, InstanceState.ERROR})
    assert inst.state == InstanceState.READY, inst.last_error
    assert (await sync_to_async(_chat)(inst.port, inst.model_name)).status_code == 401
    assert (await sync_to_async(_chat)(inst.port, inst.model_name, inst.backend_key)).status_code == 200
