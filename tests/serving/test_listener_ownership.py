"""Readiness needs the listening socket to be the backend's own, not another process's on the port."""
import os

from serving.node.processes import listener_is_ours
from tests.procs import free_port


def test_the_backend_group_owns_its_listener(llama_server):
    assert listener_is_ours(llama_server.proc.pid, llama_server.port)  # own session: pgid == pid


def test_another_group_does_not(llama_server):
    assert not listener_is_ours(os.getpgid(0), llama_server.port)


def test_nobody_owns_a_port_nothing_listens_on(llama_server):
    assert not listener_is_ours(llama_server.proc.pid, free_port())
    assert not listener_is_ours(None, llama_server.port)
