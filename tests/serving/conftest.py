"""Serving fixtures: a node whose agent runs the real Supervisor in this process."""
from __future__ import annotations

import asyncio
import functools
import json
import time
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
from asgiref.sync import sync_to_async

from tests.conftest import ENGINES, KeyedConsole, llama_server_binary, start_console
from tests.procs import stop_process

LLAMA_CPP_PYTHON = {"name": "llama-cpp-python", "available": True, "version": "0.3.16", "flavour": "cpu",
                    "path": "", "reason": ""}
NODE = "node-t"


@functools.cache
def llama_server_row() -> dict:
    """The real probe's row for llama-server here (the cached CPU build; unavailable without one)."""
    from hardware.backends import probe_llama_server

    return probe_llama_server()


def node_backends() -> list[dict]:
    """What the node's probe records here: llama-cpp-python and llama-server, both on the CPU."""
    return [LLAMA_CPP_PYTHON, llama_server_row()]


@pytest.fixture(params=ENGINES)
def engine(request) -> str:
    """Each GGUF engine in turn; a test loads with `backend=engine` (the CPU default is llama-cpp-python)."""
    if request.param == "llama-server":
        llama_server_binary()  # fails the test at once, saying how to build it, when there is none
    return request.param


@pytest.fixture
def serving_settings(settings, tmp_path):
    settings.NODE_NAME = NODE
    settings.LOG_DIR = tmp_path / "logs"
    settings.RESTART_BACKOFF_S = 0
    settings.RESTART_LIMIT = 3
    settings.STOP_GRACE_S = 5
    settings.RECONCILE_INTERVAL_S = 1
    settings.LOAD_TIMEOUT_LLAMA_S = 60
    return settings


def set_backends(name: str, backends: list[dict]) -> None:
    from hardware.models import Node

    Node.objects.filter(name=name).update(backends=backends)


@pytest.fixture
async def agent(serving_settings, transactional_db) -> AsyncIterator[object]:
    """A real NodeAgent with the real Supervisor, on node-t, for the test."""
    from hardware.services import register_node
    from serving.node.agent import NodeAgent
    from serving.node.supervisor import Supervisor

    await sync_to_async(register_node)(name=NODE, address="127.0.0.1")
    await sync_to_async(set_backends)(NODE, node_backends())
    supervisor = Supervisor()
    node_agent = NodeAgent(name=NODE, address="127.0.0.1", workers=[supervisor])
    node_agent.supervisor = supervisor
    stop = asyncio.Event()
    task = asyncio.create_task(node_agent.run(stop))
    await asyncio.wait_for(node_agent.started.wait(), 30)
    yield node_agent
    stop.set()
    await asyncio.wait_for(task, 60)


async def wait_state(instance_id: int, states: set[str], *, timeout: float = 60) -> object:
    """Poll the row until its state is one of `states`."""
    from serving.models import ModelInstance

    deadline = time.monotonic() + timeout
    inst = None
    while time.monotonic() < deadline:
        inst = await sync_to_async(ModelInstance.objects.get)(pk=instance_id)
        if inst.state in states:
            return inst
        await asyncio.sleep(0.1)
    raise AssertionError(f"instance {instance_id} stayed {inst.state if inst else '?'} "
                         f"({inst.state_message if inst else ''}); wanted {states}")


def backend_pids(model_name: str, port: int) -> list[int]:
    """Processes whose command line serves `model_name` on `port` (any parent)."""
    import os
    from pathlib import Path

    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and model_name.encode() in cmd and str(port).encode() in cmd:
            out.append(int(entry))
    return out


def set_console_backends(console) -> None:
    """Record node_backends() for a console's node (test-node), once its agent has registered it."""
    code = ("import json; from hardware.models import Node; "
            f"print(Node.objects.filter(name='test-node').update(backends=json.loads({json.dumps(node_backends())!r})))")
    deadline = time.monotonic() + 30
    while console.manage("shell", "-v", "0", "-c", code).stdout.strip() != "1":
        assert time.monotonic() < deadline, "the node never registered"
        time.sleep(0.2)


def keyed_console(workdir, extra_env: dict | None = None) -> Iterator[KeyedConsole]:
    """A console (tests.conftest.start_console) whose node has node_backends(), with an admin's
    key; a module fixture yields from it. It must stop cleanly, and no request may crash the proxy."""
    console = start_console(workdir, extra_env=extra_env)
    try:
        set_console_backends(console)
        key = console.manage("createapikey", "--username", "admin").stdout.strip().splitlines()[-1]
        yield KeyedConsole(console=console, key=key)
    finally:
        code = stop_process(console.proc, timeout=60)
    assert code == 0, console.log[-3000:]
    assert "proxy failed" not in console.log, console.log[-5000:]


def wait_api(url: str, key: str, predicate, timeout: float = 60) -> dict:
    """GET `url` with the key until `predicate(body)` holds; its body."""
    deadline = time.monotonic() + timeout
    body: dict = {}
    while time.monotonic() < deadline:
        body = httpx.get(url, headers={"Authorization": f"Bearer {key}"}, timeout=5).json()
        if predicate(body):
            return body
        time.sleep(0.1)
    raise AssertionError(f"timed out; last: {body}")


@pytest.fixture
def node(serving_settings, db):
    """node-t, registered, with llama-cpp-python as its only backend (no agent runs)."""
    from hardware.services import register_node

    n = register_node(name=NODE, address="127.0.0.1")
    n.backends = [LLAMA_CPP_PYTHON]
    n.save()
    return n
