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


async def test_a_bare_connect_says_whether_a_port_listens():
    """What the health wait asks before its HTTP probe while a backend starts (a connect costs tens
    of microseconds; an HTTP request to a closed port every 10 ms took CPU from the engine's start)."""
    import socket

    from serving.node.supervisor import port_listens

    port = free_port()
    assert not await port_listens("127.0.0.1", port)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
        assert not await port_listens("127.0.0.1", port)  # bound, not listening yet
        sock.listen()
        assert await port_listens("127.0.0.1", port)
    with socket.socket(socket.AF_INET6) as sock6:
        sock6.bind(("::1", 0))
        sock6.listen()
        assert await port_listens("::1", sock6.getsockname()[1])
        assert await port_listens("[::1]", sock6.getsockname()[1])
