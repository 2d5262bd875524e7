"""Memory estimates, GPU assignment with its verdict, and ports."""
from __future__ import annotations

import json
import socket

import pytest

from serving.control.placement import (
    GpuRoom,
    PlacementError,
    assign_gpus,
    estimate_gguf,
    estimate_hf_dir,
    gguf_header,
    pick_port,
)

GIB = 1024


def test_gguf_header_and_estimate(tiny_gguf):
    head = gguf_header(tiny_gguf)
    assert head == {"arch": "llama", "n_layers": 2, "ctx": 2048, "n_embd": 64, "n_head": 4, "n_head_kv": 4}
    est = estimate_gguf(tiny_gguf)
    assert est.weights_mib >= 1 and est.total_mib == est.weights_mib + est.kv_mib + est.overhead_mib
    assert "2048 tokens" in est.detail  # the model's own context caps the default


def test_hf_estimate_from_config(tmp_path):
    # Llama-3-8B-like: ~8.0 B params in bfloat16 -> ~15 GiB of weights.
    cfg = {"hidden_size": 4096, "num_hidden_layers": 32, "intermediate_size": 14336, "vocab_size": 128256,
           "num_attention_heads": 32, "num_key_value_heads": 8, "torch_dtype": "bfloat16",
           "max_position_embeddings": 8192}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    est = estimate_hf_dir(tmp_path, ctx=8192)
    assert 14.5 * GIB < est.weights_mib < 15.5 * GIB
    assert est.kv_mib == 1024  # 2 * 32 layers * 8192 tokens * 1024 kv dims * 2 bytes
    assert "8.03 B params" in est.detail


def test_fits_on_the_gpu_with_most_room():
    gpus = [GpuRoom(0, 3 * GIB, 24 * GIB), GpuRoom(1, 20 * GIB, 24 * GIB)]
    chosen, verdict = assign_gpus(node_name="node-a", gpus=gpus, need_mib=5 * GIB, requested=None)
    assert chosen == [1] and verdict == "fits on GPU 1 of node-a: needs ~5.0 GiB of 20.0 GiB free"


def test_refused_with_the_numbers():
    gpus = [GpuRoom(0, int(3.2 * GIB), 24 * GIB), GpuRoom(1, 2 * GIB, 24 * GIB)]
    with pytest.raises(PlacementError) as err:
        assign_gpus(node_name="node-a", gpus=gpus, need_mib=int(5.1 * GIB), requested=None)
    assert str(err.value) == "needs ~5.1 GiB, largest free is 3.2 GiB on gpu 0 of node-a"


def test_tensor_parallel_and_requested_gpus():
    gpus = [GpuRoom(i, 10 * GIB, 24 * GIB) for i in range(4)]
    chosen, _ = assign_gpus(node_name="n", gpus=gpus, need_mib=16 * GIB, requested=None, tensor_parallel_size=2)
    assert chosen == [0, 1]
    with pytest.raises(PlacementError, match="needs 8 GPUs; n has 4"):
        assign_gpus(node_name="n", gpus=gpus, need_mib=GIB, requested=None, tensor_parallel_size=8)
    assert assign_gpus(node_name="n", gpus=gpus, need_mib=GIB, requested=[3])[0] == [3]
    with pytest.raises(PlacementError, match="has no GPU 7"):
        assign_gpus(node_name="n", gpus=gpus, need_mib=GIB, requested=[7])
    with pytest.raises(PlacementError, match="GPU 2 of n has 10.0 GiB free"):
        assign_gpus(node_name="n", gpus=gpus, need_mib=12 * GIB, requested=[2])


def test_cpu_node_gets_no_gpus():
    chosen, verdict = assign_gpus(node_name="cpu-1", gpus=[], need_mib=600, requested=None)
    assert chosen == [] and "CPU of cpu-1" in verdict
    with pytest.raises(PlacementError, match="no GPUs"):
        assign_gpus(node_name="cpu-1", gpus=[], need_mib=600, requested=[0])


def test_ports_skip_taken_and_unbindable(settings):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        settings.BACKEND_PORT_MIN, settings.BACKEND_PORT_MAX = port, port + 2
        got = pick_port(taken={port + 1})
        assert got == port + 2
        with pytest.raises(PlacementError, match="no free backend port"):
            pick_port(taken={port + 1, port + 2})


def test_agents_on_one_host_start_their_port_scan_apart(settings):
    settings.BACKEND_PORT_MIN, settings.BACKEND_PORT_MAX = 18000, 18999
    firsts = {pick_port(taken=set(), spread_by=name) for name in ("node-a", "node-b")}
    assert len(firsts) == 2  # two agents racing to start a backend do not pick the same port
