"""The supervisor with real llama.cpp backends on the tiny GGUF, driven in-process; the tests that
take `engine` run on both llama-cpp-python and llama-server."""
from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest
from asgiref.sync import sync_to_async

from serving.control.placement import port_bindable
from serving.models import InstanceState, ModelInstance
from tests.procs import children_of
from tests.serving.conftest import backend_pids, wait_state

pytestmark = pytest.mark.django_db(transaction=True)


def _load(path, name, server_type="llm", backend=None, fallback=None):
    from serving.control.services import request_load

    return request_load(model_path=str(path), model_name=name, server_type=server_type, backend=backend,
                        fallback=fallback)


def _events(instance_id):
    from serving.models import InstanceEvent

    return list(InstanceEvent.objects.filter(instance_id=instance_id).values_list("from_state", "to_state"))


async def test_load_chat_unload_leaves_nothing(agent, tiny_gguf, engine):
    inst = await sync_to_async(_load)(tiny_gguf, "tiny-chat", backend=engine)
    assert inst.state == InstanceState.PENDING and inst.backend == engine
    inst = await wait_state(inst.pk, {InstanceState.READY, InstanceState.ERROR})
    assert inst.state == InstanceState.READY, inst.last_error
    assert [to for _, to in await sync_to_async(_events)(inst.pk)] == ["PENDING", "LOADING", "WARMING", "READY"]
    assert inst.pid and inst.pgid == inst.pid and inst.ready_at
    async with httpx.AsyncClient(trust_env=False, headers={"Authorization": f"Bearer {inst.backend_key}"}) as client:
        r = await client.post(f"http://127.0.0.1:{inst.port}/v1/chat/completions", timeout=30,
                              json={"model": "tiny-chat", "messages": [{"role": "user", "content": "hello"}],
                                    "max_tokens": 4})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"
    # The tail is saved on a 0.5 s cadence, so it may land just after READY.
    deadline = time.monotonic() + 10
    while not inst.log_tail and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
        inst = await sync_to_async(ModelInstance.objects.get)(pk=inst.pk)
    assert inst.log_tail, "the log tail is saved"
    pid, port = inst.pid, inst.port

    from serving.control.services import request_unload
    await sync_to_async(request_unload)(instance=inst)
    inst = await wait_state(inst.pk, {InstanceState.STOPPED}, timeout=30)
    assert inst.pid is None and inst.port is None and inst.gpus == []
    assert [to for _, to in await sync_to_async(_events)(inst.pk)][-2:] == ["UNLOADING", "STOPPED"]
    assert pid not in [p for p, _ in children_of(os.getpid())], "reaped: no defunct child"
    assert not os.path.exists(f"/proc/{pid}")
    assert port_bindable(port)
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2, trust_env=False)


async def test_embedding_instance_answers_embeddings(agent, tiny_gguf, engine):
    inst = await sync_to_async(_load)(tiny_gguf, "tiny-embed", "embedding", backend=engine)
    inst = await wait_state(inst.pk, {InstanceState.READY, InstanceState.ERROR})
    assert inst.state == InstanceState.READY, inst.last_error
    async with httpx.AsyncClient(trust_env=False, headers={"Authorization": f"Bearer {inst.backend_key}"}) as client:
        r = await client.post(f"http://127.0.0.1:{inst.port}/v1/embeddings", json={"model": "tiny-embed", "input": "x"})
    assert r.status_code == 200 and len(r.json()["data"][0]["embedding"]) == 64


async def test_killed_backend_goes_to_error_then_is_restarted(agent, tiny_gguf, engine):
    inst = await sync_to_async(_load)(tiny_gguf, "tiny-crash", backend=engine)
    inst = await wait_state(inst.pk, {InstanceState.READY, InstanceState.ERROR})
    assert inst.state == InstanceState.READY, inst.last_error
    first_pid = inst.pid
    os.kill(first_pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        inst = await wait_state(inst.pk, {InstanceState.READY, InstanceState.ERROR})
        if inst.state == InstanceState.READY and inst.pid != first_pid:
            break
        await __import__("asyncio").sleep(0.1)
    assert inst.state == InstanceState.READY and inst.pid != first_pid
    assert inst.restarts == 1
    assert inst.exit_code == -9 or "SIGKILL" in inst.last_error
    transitions = await sync_to_async(_events)(inst.pk)
    assert ("READY", "ERROR") in transitions
    assert transitions[-1] == ("WARMING", "READY")
    assert first_pid not in [p for p, _ in children_of(os.getpid())]
    assert backend_pids("tiny-crash", inst.port) == [inst.pid]


async def test_backend_that_exits_at_once_is_an_error_with_its_last_lines(agent, tmp_path, engine):
    bad = tmp_path / "not-a-model.gguf"
    bad.write_bytes(b"GGUF" + b"this is not a GGUF file\n" * 10)  # the magic passes the load's check, no more
    started = time.monotonic()
    inst = await sync_to_async(_load)(bad, "broken", backend=engine)
    inst = await wait_state(inst.pk, {InstanceState.READY, InstanceState.ERROR}, timeout=30)
    assert inst.state == InstanceState.ERROR
    assert time.monotonic() - started < 30
    assert "while loading" in inst.state_message and "exited with code" in inst.state_message
    assert inst.exit_code not in (None, 0)
    assert inst.last_error.count("\n") >= 2, "the error carries the backend's last log lines"
    assert "failed to load model" in inst.last_error.lower(), inst.last_error  # the engine's own words
    assert inst.pid is None
    # An ERROR after a failed load is not retried in a loop.
    await __import__("asyncio").sleep(1.5)
    again = await wait_state(inst.pk, {InstanceState.ERROR})
    assert again.restarts == 0


async def test_store_prefix_is_cached_then_served(agent, tiny_gguf, settings, tmp_path):
    settings.MODELS_DIR = tmp_path / "models"
    settings.STORE_DIR = tmp_path / "store"
    settings.MINIO_ENDPOINT = ""
    from hub.store import get_store

    await sync_to_async(get_store().upload_model)("gguf/tiny-store", tiny_gguf)
    from serving.control.services import request_load

    inst = await sync_to_async(request_load)(model_path="gguf/tiny-store", model_name="tiny-store")
    inst = await wait_state(inst.pk, {InstanceState.READY, InstanceState.ERROR})
    assert inst.state == InstanceState.READY, inst.last_error
    states = [to for _, to in await sync_to_async(_events)(inst.pk)]
    assert states == ["PENDING", "CACHING", "LOADING", "WARMING", "READY"]
    assert inst.progress_pct is None
    cached = settings.MODELS_DIR / "gguf" / "tiny-store"
    assert any(p.suffix == ".gguf" for p in cached.rglob("*"))


async def test_restart_of_a_ready_instance_gives_a_new_process(agent, tiny_gguf):
    from serving.control.services import request_restart

    inst = await sync_to_async(_load)(tiny_gguf, "tiny-restart")
    inst = await wait_state(inst.pk, {InstanceState.READY, InstanceState.ERROR})
    assert inst.state == InstanceState.READY, inst.last_error
    first = inst.pid
    await sync_to_async(request_restart)(instance=inst)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        inst = await wait_state(inst.pk, {InstanceState.READY, InstanceState.ERROR})
        if inst.pid != first:
            break
        await __import__("asyncio").sleep(0.1)
    assert inst.state == InstanceState.READY and inst.pid != first and not inst.restart_requested
    assert not os.path.exists(f"/proc/{first}")
    assert backend_pids("tiny-restart", inst.port) == [inst.pid]
    tos = [to for _, to in await sync_to_async(_events)(inst.pk)]
    assert tos[-6:] == ["UNLOADING", "STOPPED", "PENDING", "LOADING", "WARMING", "READY"]
    from serving.node.logs import previous_log

    assert previous_log(inst.pk).exists(), "the previous run's log is kept"


async def test_unload_while_loading_leaves_nothing(agent, tiny_gguf):
    from serving.control.services import request_unload

    inst = await sync_to_async(_load)(tiny_gguf, "tiny-early")
    inst = await wait_state(inst.pk, {InstanceState.LOADING, InstanceState.WARMING, InstanceState.READY})
    pid, port = inst.pid, inst.port
    assert pid
    await sync_to_async(request_unload)(instance=inst)
    inst = await wait_state(inst.pk, {InstanceState.STOPPED}, timeout=30)
    await __import__("asyncio").sleep(0.5)  # nothing may come back after a stop
    inst = await wait_state(inst.pk, {InstanceState.STOPPED})
    assert inst.pid is None and inst.port is None
    assert not os.path.exists(f"/proc/{pid}"), "killed and reaped"
    assert backend_pids("tiny-early", port) == []


async def test_crash_beyond_the_restart_limit_stays_in_error(agent, tiny_gguf, serving_settings):
    serving_settings.RESTART_LIMIT = 0
    inst = await sync_to_async(_load)(tiny_gguf, "tiny-limit")
    inst = await wait_state(inst.pk, {InstanceState.READY, InstanceState.ERROR})
    os.kill(inst.pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        inst = await wait_state(inst.pk, {InstanceState.ERROR})
        if "gave up" in inst.state_message:
            break
        await __import__("asyncio").sleep(0.1)
    assert "gave up after 0 restarts" in inst.state_message and "SIGKILL" in inst.state_message
    assert inst.restarts == 0 and inst.pid is None


async def test_a_backend_that_is_not_healthy_in_time_is_stopped_with_an_error(agent, tiny_gguf, serving_settings):
    # Far below the interpreter's own start-up time: the health check cannot answer in time.
    serving_settings.LOAD_TIMEOUT_LLAMA_S = 0.05
    inst = await sync_to_async(_load)(tiny_gguf, "tiny-slow", backend="llama-cpp-python")  # llama-server may be in time
    inst = await wait_state(inst.pk, {InstanceState.ERROR}, timeout=30)
    assert inst.state_message == "llama-cpp-python did not answer /v1/models within 0.05 s"
    assert inst.pid is None and inst.restarts == 0
    assert [to for _, to in await sync_to_async(_events)(inst.pk)] == ["PENDING", "LOADING", "ERROR"]
    from serving.models import InstanceEvent

    started = await sync_to_async(InstanceEvent.objects.get)(instance_id=inst.pk, to_state="LOADING")
    port = int(started.message.rsplit(" ", 1)[1])
    assert backend_pids("tiny-slow", port) == [], "the backend was stopped"


async def test_a_stop_that_failed_midway_is_tried_again_by_the_next_reconcile(agent, tiny_gguf, caplog):
    """A stop task that raised (a database call failing mid-stop) left its run in the supervisor's
    table with the task set, and reconcile skipped any run with a stop task: the row stayed where
    the failed stop left it (UNLOADING) for good. Now the ended task is logged and the run stopped again."""
    inst = await sync_to_async(_load)(tiny_gguf, "tiny-stop-again")
    inst = await wait_state(inst.pk, {InstanceState.READY, InstanceState.ERROR})
    assert inst.state == InstanceState.READY, inst.last_error
    run = agent.supervisor.runs[inst.pk]

    async def failed_stop() -> None:
        raise RuntimeError("the database went away mid-stop")

    run.stopper = asyncio.create_task(failed_stop())
    await asyncio.wait([run.stopper])
    from serving.control.services import request_unload
    await sync_to_async(request_unload)(instance=inst)
    inst = await wait_state(inst.pk, {InstanceState.STOPPED}, timeout=30)
    assert inst.pid is None and inst.pk not in agent.supervisor.runs
    assert "ended without stopping it (RuntimeError: the database went away mid-stop)" in caplog.text
