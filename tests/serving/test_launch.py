"""The agent launches from the stored LaunchPlan, with real llama-cpp-python backends: instances
from before plans, the backend's environment, an unload while the model is copied, and an agent
that stops while its database fails."""
from __future__ import annotations

import asyncio
import os
import shlex
import signal
import sys
import time
from pathlib import Path

import pytest
from asgiref.sync import sync_to_async

from serving.models import InstanceEvent, InstanceState, ModelInstance
from serving.node.logs import current_log
from tests.serving.conftest import LLAMA_CPP_PYTHON, NODE, backend_pids, set_backends, wait_state

pytestmark = pytest.mark.django_db(transaction=True)


def _load(path, name, **kw):
    from serving.control.services import request_load

    kw.setdefault("backend", "llama-cpp-python")  # these tests read its argv (--n_ctx)
    return request_load(model_path=str(path), model_name=name, **kw)


def _states(instance_id: int) -> list[str]:
    return list(InstanceEvent.objects.filter(instance_id=instance_id).values_list("to_state", flat=True))


def _first_log_line(instance_id: int) -> str:
    return current_log(instance_id).read_text().splitlines()[0]


def _pid_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


async def test_the_agent_launches_the_stored_plan(agent, tiny_gguf):
    from serving.control.planning import plan_load

    def create():
        plan = plan_load(model_path=str(tiny_gguf), model_name="from-plan", backend="llama-cpp-python")
        launch = plan.launch.to_json()
        launch["argv"] += ["--n_ctx", "256"]  # only the stored plan says so: the agent must not decide again
        return ModelInstance.create_requested(
            message="load requested", model_name="from-plan", model_path=str(tiny_gguf), backend="llama-cpp-python",
            node=plan.node, plan=launch, estimated_memory_mib=plan.estimate.total_mib)

    inst = await sync_to_async(create)()
    agent.nudge()
    inst = await wait_state(inst.pk, {InstanceState.READY, InstanceState.ERROR})
    assert inst.state == InstanceState.READY, inst.last_error
    argv = list(inst.plan["argv"])
    argv[argv.index("{port}")], argv[argv.index("{model}")] = str(inst.port), str(tiny_gguf)
    argv[argv.index("{python}")] = sys.executable  # the agent's own interpreter
    assert _first_log_line(inst.pk) == "$ " + shlex.join(argv)
    assert "--n_ctx 256" in _first_log_line(inst.pk)


async def test_an_instance_from_before_plans_is_planned_once_on_the_node(agent, tiny_gguf):
    from hardware.models import Node

    def create_as_0_1_0():
        # What request_load of 0.1.0 wrote: no plan.
        return ModelInstance.create_requested(
            message="load requested", model_name="legacy", model_path=str(tiny_gguf), backend="llama-cpp-python",
            backend_reason="GGUF on CPU-only -> llama-cpp-python (cpu) (on node-t)",
            node=Node.objects.get(name=NODE), extra_args={"--n_ctx": 512, "--verbose": "false"})

    inst = await sync_to_async(create_as_0_1_0)()
    assert inst.plan is None
    agent.nudge()
    inst = await wait_state(inst.pk, {InstanceState.READY, InstanceState.ERROR})
    assert inst.state == InstanceState.READY, inst.last_error
    assert inst.plan and inst.plan["backend"] == "llama-cpp-python" and inst.plan["version"] == "0.3.16"
    from serving.control.planning import LaunchPlan

    plan = LaunchPlan.from_json(inst.plan)
    assert _first_log_line(inst.pk) == "$ " + shlex.join(plan.command(port=inst.port, model=tiny_gguf,
                                                                      python=sys.executable))
    assert "--n_ctx 512" in _first_log_line(inst.pk) and "--verbose false" in _first_log_line(inst.pk)
    assert [s for s in await sync_to_async(_states)(inst.pk)] == ["PENDING", "LOADING", "WARMING", "READY"]


# Issue 17 #9: backends saw the console's whole environment (XGEN_SECRET_KEY in /proc/<pid>/environ).
async def test_a_backend_sees_an_allowlisted_environment(agent, tiny_gguf, monkeypatch, serving_settings):
    markers = {"XGEN_SECRET_KEY": "marker-secret-key", "DATABASE_URL": "postgres://marker:pw@db/x",
               "MINIO_SECRET_KEY": "marker-minio", "XGEN_ADMIN_PASSWORD": "marker-admin",
               "AWS_SECRET_ACCESS_KEY": "marker-aws", "HF_TOKEN": "marker-hf"}
    for name, value in markers.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("LC_ALL", "C.UTF-8")
    monkeypatch.setenv("XGEN_PASS_ME", "passed")
    # Where the one-compile install keeps libllama (or the binding's own library folder): the
    # backend must be told, or llama-cpp-python cannot start.
    import llama_cpp

    lib_dir = os.environ.get("LLAMA_CPP_LIB_PATH") or str(Path(llama_cpp.__file__).parent / "lib")
    monkeypatch.setenv("LLAMA_CPP_LIB_PATH", lib_dir)
    serving_settings.BACKEND_ENV_PASS = ["XGEN_PASS_ME"]
    inst = await sync_to_async(_load)(tiny_gguf, "tiny-env")
    inst = await wait_state(inst.pk, {InstanceState.READY, InstanceState.ERROR})
    assert inst.state == InstanceState.READY, inst.last_error
    raw = Path(f"/proc/{inst.pid}/environ").read_bytes()
    env = dict(item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)
    assert not [k for k, v in env.items() if "marker" in v], env
    assert not set(markers) & set(env)
    assert env["PATH"] == os.environ["PATH"] and env["LC_ALL"] == "C.UTF-8" and env["XGEN_PASS_ME"] == "passed"
    assert env["HF_HUB_OFFLINE"] == "1" and env["TRANSFORMERS_OFFLINE"] == "1"
    assert env["LLAMA_CPP_LIB_PATH"] == lib_dir
    assert not [k for k in env if k.startswith(("DJANGO", "XGEN_")) and k != "XGEN_PASS_ME"], env


# Issue 17 #7: an unload during CACHING did not stop the copy; its progress ticks took the
# instance back to CACHING after STOPPED.
async def test_an_unload_while_caching_stops_the_copy_and_stays_stopped(agent, settings, tmp_path, monkeypatch):
    settings.MODELS_DIR = tmp_path / "models"
    settings.STORE_DIR = tmp_path / "store"
    settings.MINIO_ENDPOINT = ""
    from hub.store import FilesystemModelStore, get_store

    src = tmp_path / "src" / "slow.gguf"
    src.parent.mkdir()
    with open(src, "wb") as fh:
        fh.truncate(24 * 1024 * 1024)
    await sync_to_async(get_store().upload_model)("gguf/slow-model", src.parent)
    stream_to = FilesystemModelStore.stream_to

    def slow_stream_to(self, key, fh, *, on_chunk):  # a store that delivers 1 MiB per 0.2 s
        def throttled(chunk: bytes) -> None:
            time.sleep(0.2)
            on_chunk(chunk)

        return stream_to(self, key, fh, on_chunk=throttled)

    monkeypatch.setattr(FilesystemModelStore, "stream_to", slow_stream_to)
    from serving.control.services import request_unload

    inst = await sync_to_async(_load)("gguf/slow-model", "slow")
    deadline = time.monotonic() + 30
    while True:
        inst = await sync_to_async(ModelInstance.objects.select_related("node").get)(pk=inst.pk)
        if inst.state == InstanceState.CACHING and (inst.progress_pct or 0) > 0:
            break
        assert time.monotonic() < deadline and inst.state in (InstanceState.PENDING, InstanceState.CACHING), \
            (inst.state, inst.state_message)
        await asyncio.sleep(0.05)
    assert inst.progress_pct < 50
    await sync_to_async(request_unload)(instance=inst)
    inst = await wait_state(inst.pk, {InstanceState.STOPPED}, timeout=30)
    assert not list(settings.MODELS_DIR.rglob("*.part")), "the cancelled copy left partial files"
    # Nothing brings it back: the copy is stopped, not merely ignored.
    until = time.monotonic() + 3
    while time.monotonic() < until:
        now = await sync_to_async(ModelInstance.objects.get)(pk=inst.pk)
        assert now.state == InstanceState.STOPPED and now.progress_pct is None, (now.state, now.state_message)
        await asyncio.sleep(0.1)
    states = await sync_to_async(_states)(inst.pk)
    assert states == ["PENDING", "CACHING", "UNLOADING", "STOPPED"], states
    assert not list(settings.MODELS_DIR.rglob("*.part"))
    assert not (settings.MODELS_DIR / "gguf" / "slow-model" / "slow.gguf").exists(), "the copy ran on to the end"


async def _start_agent():
    from hardware.services import register_node
    from serving.node.agent import NodeAgent
    from serving.node.supervisor import Supervisor

    await sync_to_async(register_node)(name=NODE, address="127.0.0.1")
    await sync_to_async(set_backends)(NODE, [LLAMA_CPP_PYTHON])
    node_agent = NodeAgent(name=NODE, address="127.0.0.1", workers=[Supervisor()])
    stop = asyncio.Event()
    task = asyncio.create_task(node_agent.run(stop))
    await asyncio.wait_for(node_agent.started.wait(), 30)
    return node_agent, stop, task


MOVED = ".moved-away"


def _break_database() -> str:
    """Make the database unreachable for the agent's DB thread: the SQLite file is gone and a
    folder stands in its place, so every new connection fails ("unable to open database file")."""
    from django.db import connection

    name = connection.settings_dict["NAME"]
    connection.close()
    for suffix in ("", "-wal", "-shm"):
        if os.path.exists(name + suffix):
            os.rename(name + suffix, name + suffix + MOVED)
    os.mkdir(name)
    return name


def _mend_database(name: str) -> None:
    from django.db import connection

    connection.close()
    if os.path.isdir(name):
        os.rmdir(name)
    for suffix in ("", "-wal", "-shm"):
        if os.path.exists(name + suffix + MOVED):
            os.rename(name + suffix + MOVED, name + suffix)


# Issue 17 #8: the stop path read the database before killing; with the database down the
# backends outlived the agent, reparented to init and still serving.
async def test_agent_shutdown_while_the_database_fails_still_kills_its_backends(serving_settings, transactional_db,
                                                                                tiny_gguf):
    node_agent, stop, task = await _start_agent()
    name = None
    pid = port = None
    try:
        inst = await sync_to_async(_load)(tiny_gguf, "tiny-dbdown")
        inst = await wait_state(inst.pk, {InstanceState.READY, InstanceState.ERROR})
        assert inst.state == InstanceState.READY, inst.last_error
        pid, port = inst.pid, inst.port
        name = await sync_to_async(_break_database)()
        with pytest.raises(Exception):  # noqa: B017 (any database error: it is really down)
            await sync_to_async(lambda: ModelInstance.objects.count())()
        stop.set()
        await asyncio.wait_for(task, 60)
        assert not _pid_alive(pid), "the backend outlived the agent"
        assert backend_pids("tiny-dbdown", port) == []
    finally:
        stop.set()
        if not task.done():
            await asyncio.wait_for(task, 60)
        if name:
            await sync_to_async(_mend_database)(name)
        for p in backend_pids("tiny-dbdown", port) if port else []:
            os.kill(p, signal.SIGKILL)
    # The database recovers; the next agent reconciles what could not be recorded.
    inst = await sync_to_async(ModelInstance.objects.get)(pk=inst.pk)
    assert inst.pid == pid, "nothing could be recorded while the database was down"
    node_agent, stop, task = await _start_agent()
    try:
        inst = await wait_state(inst.pk, {InstanceState.READY, InstanceState.ERROR})
        assert inst.state == InstanceState.READY and inst.pid != pid, (inst.state, inst.state_message)
    finally:
        stop.set()
        await asyncio.wait_for(task, 60)
