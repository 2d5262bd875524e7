"""Backend adapters, chosen by name through one explicit registry."""
from __future__ import annotations

from serving.adapters.base import BackendAdapter, InvalidExtraArgs, LaunchSpec
from serving.adapters.llama_cpp_python import LlamaCppPythonServer
from serving.adapters.llama_server import LlamaServer
from serving.adapters.vllm import VllmServer

ADAPTERS: dict[str, BackendAdapter] = {
    VllmServer.name: VllmServer(),
    LlamaServer.name: LlamaServer(),
    LlamaCppPythonServer.name: LlamaCppPythonServer(),
}


def get_adapter(name: str) -> BackendAdapter:
    """The adapter for a backend name; KeyError for an unknown one."""
    return ADAPTERS[name]


__all__ = ["ADAPTERS", "BackendAdapter", "InvalidExtraArgs", "LaunchSpec", "get_adapter"]
