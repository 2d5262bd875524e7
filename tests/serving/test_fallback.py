"""Automatic backend fallback (issue 12 #3), with the real agent and real engines: a llama-server
that cannot start (XGEN_LLAMA_SERVER_BIN at a binary that answers --version like llama-server,
then exits 1 on a load) ends READY on llama-cpp-python, both attempts in the timeline."""
from __future__ import annotations

import pytest
from asgiref.sync import sync_to_async

from hardware.backends import probe_llama_server
from serving.models import InstanceEvent, InstanceState, ModelInstance
from tests.conftest import bearer
from tests.serving.conftest import LLAMA_CPP_PYTHON, NODE, set_backends, wait_state

pytestmark = pytest.mark.django_db(transaction=True)

BROKEN = """#!/bin/sh
if [ "$1" = "--version" ]; then
  echo "version: 6500 (0c1e570)"; echo "built with cc (Debian 12.2.0) for x86_64-linux-gnu"; exit 0
fi
echo "llama_model_load: error loading model: this build cannot load it" >&2
exit 1
"""


@pytest.fixture
def broken_llama_server(tmp_path, agent):
    path = tmp_path / "llama-server"
    path.write_text(BROKEN)
    path.chmod(0o755)
    row = probe_llama_server(str(path))
    assert row["available"], row  # the probe takes it for a llama-server
    set_backends(NODE, [LLAMA_CPP_PYTHON, row])
    return path


def _timeline(pk: int) -> list[tuple[str, str]]:
    return list(InstanceEvent.objects.filter(instance_id=pk).order_by("pk").values_list("to_state", "message"))


def _load(path, name, **kw):
    from serving.control.services import request_load

    return request_load(model_path=str(path), model_name=name, **kw)


async def test_a_backend_that_does_not_come_up_falls_back_to_the_next(agent, broken_llama_server, tiny_gguf):
    inst = await sync_to_async(_load)(tiny_gguf, "falls-back", backend="llama-server", fallback=True)
    assert inst.backend == "llama-server" and inst.plan["fallback"] is True
    agent.nudge()
    inst = await wait_state(inst.pk, {InstanceState.READY}, timeout=90)
    assert inst.backend == "llama-cpp-python"
    assert "llama-server did not come up; fallback to llama-cpp-python" in inst.backend_reason
    assert inst.plan["backend"] == "llama-cpp-python" and inst.plan["fell_back_from"] == "llama-server"
    timeline = await sync_to_async(_timeline)(inst.pk)
    states = [s for s, _ in timeline]
    assert states[:2] == ["PENDING", "LOADING"] and "ERROR" in states and states[-1] == "READY"
    error = next(m for s, m in timeline if s == "ERROR")
    trying = next(m for s, m in timeline[states.index("ERROR"):] if s == "PENDING")
    assert "llama-server exited with" in error and "1" in error
    assert "this build cannot load it" in trying and trying.endswith("; trying llama-cpp-python")


async def test_a_backend_named_without_fallback_stays_in_error(agent, broken_llama_server, tiny_gguf):
    inst = await sync_to_async(_load)(tiny_gguf, "no-fallback", backend="llama-server")
    assert inst.plan["fallback"] is False
    agent.nudge()
    inst = await wait_state(inst.pk, {InstanceState.ERROR}, timeout=60)
    assert inst.backend == "llama-server" and "this build cannot load it" in inst.last_error
    timeline = await sync_to_async(_timeline)(inst.pk)
    assert "trying" not in " ".join(m for _, m in timeline)


async def test_the_setting_turns_fallback_off(agent, broken_llama_server, tiny_gguf, settings):
    settings.BACKEND_FALLBACK = False
    inst = await sync_to_async(_load)(tiny_gguf, "off", backend="llama-server", fallback=True)
    agent.nudge()
    inst = await wait_state(inst.pk, {InstanceState.ERROR}, timeout=60)
    assert inst.backend == "llama-server"


async def test_a_fallback_is_tried_once(agent, tiny_gguf, tmp_path):
    """Both backends fail (the model file is not a model): ERROR after llama-cpp-python, no loop."""
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 4000)
    path = tmp_path / "llama-server"
    path.write_text(BROKEN)
    path.chmod(0o755)
    await sync_to_async(set_backends)(NODE, [LLAMA_CPP_PYTHON, probe_llama_server(str(path))])
    from serving.control.planning import plan_load

    def create():
        plan = plan_load(model_path=str(tiny_gguf), model_name="twice", backend="llama-server")
        import dataclasses

        launch = dataclasses.replace(plan.launch, fallback=True, model_path=str(bad),
                                     argv=tuple(str(bad) if a == str(tiny_gguf) else a for a in plan.launch.argv))
        return ModelInstance.create_requested(
            message="load requested", model_name="twice", model_path=str(bad), backend="llama-server",
            node=plan.node, plan=launch.to_json(), estimated_memory_mib=plan.estimate.total_mib)

    inst = await sync_to_async(create)()
    agent.nudge()
    inst = await wait_state(inst.pk, {InstanceState.ERROR}, timeout=90)
    for _ in range(30):  # the fallback's own failure lands as the second ERROR
        timeline = await sync_to_async(_timeline)(inst.pk)
        if [s for s, _ in timeline].count("ERROR") >= 2:
            break
        await wait_state(inst.pk, {InstanceState.ERROR}, timeout=5)
    inst = await sync_to_async(ModelInstance.objects.get)(pk=inst.pk)
    assert inst.state == InstanceState.ERROR and inst.backend == "llama-cpp-python"
    assert sum(1 for _, m in timeline if m.endswith("trying llama-cpp-python")) == 1


def test_the_load_api_takes_fallback(client, operator, serving_settings, tiny_gguf):
    from hardware.services import register_node

    register_node(name=NODE, address="127.0.0.1")
    set_backends(NODE, [LLAMA_CPP_PYTHON])
    r = client.post("/api/management/load", {"model_path": str(tiny_gguf), "model_name": "api-fb", "fallback": False},
                    content_type="application/json", **bearer(operator.key))
    assert r.status_code == 202, r.content
    assert ModelInstance.objects.get(pk=r.json()["id"]).plan["fallback"] is False
    r = client.post("/api/management/load", {"model_path": str(tiny_gguf), "model_name": "api-auto"},
                    content_type="application/json", **bearer(operator.key))
    assert ModelInstance.objects.get(pk=r.json()["id"]).plan["fallback"] is True  # auto falls back by default
    r = client.post("/api/management/load", {"model_path": str(tiny_gguf), "fallback": "sometimes"},
                    content_type="application/json", **bearer(operator.key))
    assert r.status_code in (400, 422)
