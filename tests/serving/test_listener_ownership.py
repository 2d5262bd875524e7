"""Readiness needs the listening socket to be the backend's own, not another process's on the port."""
import os
import subprocess
import sys
import time

from serving.node.processes import listener_is_ours
from tests.procs import free_port


def test_the_backend_group_owns_its_listener(llama_server):
    assert listener_is_ours(llama_server.proc.pid, llama_server.port)  # own session: pgid == pid


def test_another_group_does_not(llama_server):
    assert not listener_is_ours(os.getpgid(0), llama_server.port)


def test_nobody_owns_a_port_nothing_listens_on(llama_server):
    assert not listener_is_ours(llama_server.proc.pid, free_port())
    assert not listener_is_ours(None, llama_server.port)


def test_a_listener_held_by_another_process_of_the_group_is_ours(tmp_path):
    """The leader is looked at first (the engines we start listen in it); a wrapper whose child
    listens (a launcher script, `python -m` spawning a worker) is found by scanning the group."""
    port = free_port()
    child = f"import socket, time; s = socket.socket(); s.bind(('127.0.0.1', {port})); s.listen(); time.sleep(60)"
    # bash stays the leader (no exec: the trailing `wait`) while its child python listens
    leader = subprocess.Popen(["bash", "-c", f"{sys.executable} -c \"{child}\" & wait"], start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while not listener_is_ours(leader.pid, port):
            assert time.monotonic() < deadline, "the child's listener was never found in the leader's group"
            time.sleep(0.05)
        assert not listener_is_ours(os.getpgid(0), port)
    finally:
        os.killpg(leader.pid, 9)
        leader.wait()
