"""How many requests an engine says it is answering (what a stopping agent waits for, issue 31 #4).
llama-server's /slots is read from a real llama-server in tests/cluster/test_agent_sigterm_drain.py;
vLLM's /metrics (not installed here) from its Prometheus text as vLLM 0.10-0.11 writes it."""
from __future__ import annotations

from serving.adapters import get_adapter

VLLM_METRICS = b"""# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
vllm:num_requests_running_total_unrelated 9.0
"""


def test_vllm_counts_running_and_waiting_requests():
    vllm = get_adapter("vllm")
    assert vllm.busy_path == "/metrics"
    assert vllm.requests_in_flight(VLLM_METRICS) == 3
    assert vllm.requests_in_flight(VLLM_METRICS.replace(b"} 2.0", b"} 0.0").replace(b"} 1.0", b"} 0.0")) == 0
    assert vllm.requests_in_flight(b"# no vllm gauges\nprocess_cpu_seconds_total 1.0\n") is None


def test_llama_server_counts_slots_processing():
    llama = get_adapter("llama-server")
    assert llama.busy_path == "/slots"
    slots = b'[{"id": 0, "is_processing": true}, {"id": 1, "is_processing": false}, {"id": 2, "is_processing": true}]'
    assert llama.requests_in_flight(slots) == 2
    assert llama.requests_in_flight(b'{"error": {"code": 501}}') is None
    assert llama.requests_in_flight(b"not json") is None


def test_an_engine_that_cannot_say_is_not_waited_for():
    python = get_adapter("llama-cpp-python")
    assert python.busy_path == "" and python.requests_in_flight(b"[]") is None
