"""Measured memory, fed back (issue 12 #4), with the real agent and llama-cpp-python: once READY
the instance records what its process group holds (resident memory on this CPU node), the API
and page show it beside the estimate, and the next plan of the same shape uses it."""
from __future__ import annotations

import pytest
from asgiref.sync import sync_to_async

from serving.models import InstanceEvent, InstanceState, MemoryMeasurement, ModelInstance
from tests.conftest import bearer
from tests.serving.conftest import NODE, wait_state

pytestmark = pytest.mark.django_db(transaction=True)


def _load(path, name, **kw):
    from serving.control.services import request_load

    kw.setdefault("backend", "llama-cpp-python")  # measured with its --n_ctx
    return request_load(model_path=str(path), model_name=name, **kw)


async def test_a_ready_backend_is_measured_and_the_next_plan_uses_it(agent, tiny_gguf, operator):
    from django.test import Client

    from serving.control.planning import plan_load
    from serving.control.services import request_unload

    first = await sync_to_async(plan_load)(model_path=str(tiny_gguf), model_name="m1", backend="llama-cpp-python", extra_args={"--n_ctx": 256})
    assert not first.estimate.measured
    inst = await sync_to_async(_load)(tiny_gguf, "measured", extra_args={"--n_ctx": 256})
    agent.nudge()
    inst = await wait_state(inst.pk, {InstanceState.READY, InstanceState.ERROR}, timeout=90)
    assert inst.state == InstanceState.READY, inst.last_error
    for _ in range(100):  # measured right after READY
        inst = await sync_to_async(ModelInstance.objects.get)(pk=inst.pk)
        if inst.measured_memory_mib is not None:
            break
        await wait_state(inst.pk, {InstanceState.READY}, timeout=1)
    assert inst.measured_source == "rss" and inst.measured_memory_mib > 10  # a Python process with a model
    row = await sync_to_async(MemoryMeasurement.objects.get)()
    assert (row.model_path, row.backend, row.ctx, row.tensor_parallel_size, row.node_name) == \
        (str(tiny_gguf), "llama-cpp-python (cpu)", 256, 1, NODE)

    def api_and_page():
        c = Client()
        body = c.get(f"/api/management/instances/{inst.pk}", **bearer(operator.key)).json()
        c.force_login(operator.user)
        return body, c.get(f"/instances/{inst.pk}/").content.decode(), \
            c.get("/instances/new/verdict", {"model_path": str(tiny_gguf), "backend": "llama-cpp-python",
                                             "extra_args": "--n_ctx 256"}).content.decode()

    body, page, verdict = await sync_to_async(api_and_page)()
    assert body["memory"] == {"estimate_mib": inst.estimated_memory_mib, "measured_mib": inst.measured_memory_mib,
                              "measured_source": "rss"}
    assert f"measured {inst.measured_memory_mib} MiB" in page
    # The same shape again: the plan, the dialog and placement take the measured figure.
    again = await sync_to_async(plan_load)(model_path=str(tiny_gguf), model_name="m2", backend="llama-cpp-python", extra_args={"--n_ctx": 256})
    assert again.estimate.total_mib == inst.measured_memory_mib
    assert again.estimate.measured.startswith(f"measured {inst.measured_memory_mib} MiB on {NODE}")
    assert f"measured {inst.measured_memory_mib} MiB on {NODE}" in verdict
    other = await sync_to_async(plan_load)(model_path=str(tiny_gguf), model_name="m3", backend="llama-cpp-python", extra_args={"--n_ctx": 512})
    assert not other.estimate.measured  # another context size is another shape

    await sync_to_async(request_unload)(instance=inst)
    agent.nudge()
    inst = await wait_state(inst.pk, {InstanceState.STOPPED}, timeout=60)
    notes = await sync_to_async(lambda: list(InstanceEvent.objects.filter(instance_id=inst.pk)
                                             .values_list("message", flat=True)))()
    assert not [n for n in notes if "GPU leak" in n or "still running" in n], notes  # a clean stop
