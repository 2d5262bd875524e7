"""Which backend serves a model on a node: chosen from the model's format, the node's GPU type,
and the backends the node actually has (Node.backends, as its agent probed them).

Returns the backend and a one-line reason the API and the Load page show. Impossible
combinations are refused with what would work instead.

`choose_backend` is the one entry that chooses: the load path calls it only through
`serving.control.planning.make_launch_plan` (a new load, a plan made again, a 0.1.0 row's plan, a
fallback); `backend_options` asks it about each backend for the Load dialog's list.
"""
from __future__ import annotations

from dataclasses import dataclass

from serving.adapters import ADAPTERS

GGUF = "gguf"
HUGGINGFACE = "huggingface"
CPU = "CPU"

GPU_LABEL = {"NVIDIA": "NVIDIA", "AMD_CDNA": "AMD CDNA (Instinct)", "AMD_RDNA": "AMD RDNA (Radeon)", CPU: "CPU-only"}

# Preference per (format, GPU type): (backend, flavour) in order; the first the node has wins.
# llama-server comes before llama-cpp-python for the same flavour: it is llama.cpp's own server,
# the faster of the two on the CPU (bench/engines.py; the README has the figures) and the one with
# every route (/v1/messages, /v1/responses, /v1/rerank, /tokenize, /slots). llama-cpp-python stays the
# fallback: where llama-server is not built, or fails to start (serving.control.starts).
PREFERENCES: dict[tuple[str, str], list[tuple[str, str]]] = {
    (GGUF, "NVIDIA"): [("llama-server", "cuda"), ("llama-server", "vulkan"), ("llama-cpp-python", "cuda"),
                       ("llama-server", "cpu"), ("llama-cpp-python", "cpu")],
    (GGUF, "AMD_CDNA"): [("llama-server", "rocm"), ("llama-server", "vulkan"), ("llama-cpp-python", "rocm"),
                         ("llama-server", "cpu"), ("llama-cpp-python", "cpu")],
    (GGUF, "AMD_RDNA"): [("llama-server", "vulkan"), ("llama-server", "rocm"), ("llama-cpp-python", "vulkan"),
                         ("llama-server", "cpu"), ("llama-cpp-python", "cpu")],
    (GGUF, CPU): [("llama-server", "cpu"), ("llama-cpp-python", "cpu")],
    (HUGGINGFACE, "NVIDIA"): [("vllm", "cuda")],
    (HUGGINGFACE, "AMD_CDNA"): [("vllm", "rocm")],
    (HUGGINGFACE, "AMD_RDNA"): [],
    (HUGGINGFACE, CPU): [],
}

# Why the table's first choice for a GGUF on the CPU is llama-server (the verdict says it).
LLAMA_SERVER_ON_CPU_WHY = ("llama.cpp's own server: faster than llama-cpp-python on the CPU and it serves "
                           "every route (/v1/messages, /v1/responses, /v1/rerank, /tokenize)")

# Flavours that use the GPU (a CPU flavour on a GPU node runs without one).
GPU_FLAVOURS = {"cuda", "rocm", "vulkan"}
FLAVOUR_FITS = {"NVIDIA": {"cuda", "vulkan"}, "AMD_CDNA": {"rocm", "vulkan"}, "AMD_RDNA": {"vulkan", "rocm"}, CPU: set()}


class BackendUnavailable(ValueError):
    """No backend can serve this model on this node (the message says why and what would)."""


@dataclass(frozen=True)
class BackendChoice:
    backend: str
    flavour: str
    version: str
    path: str
    reason: str

    @property
    def uses_gpu(self) -> bool:
        return self.flavour in GPU_FLAVOURS


def node_gpu_type(gpu_types: list[str] | set[str]) -> str:
    """The node's GPU type for selection: the first GPU's type, CPU when it has none."""
    types = [t for t in gpu_types if t and t != CPU]
    return sorted(types)[0] if types else CPU


def building(row: dict) -> str:
    """"llama.cpp 0.3.36 building: 45 %" for an engine whose build still runs on its node, else ""."""
    build = row.get("build")
    return str(build.get("label") or "") if isinstance(build, dict) and build.get("state") == "building" else ""


def _available(backends: list[dict]) -> dict[tuple[str, str], dict]:
    """Installed backends by (name, flavour), and those whose build runs: a load waits for it."""
    out: dict[tuple[str, str], dict] = {}
    for b in backends or []:
        if (b.get("available") or building(b)) and b.get("name") in ADAPTERS:
            out.setdefault((b["name"], b.get("flavour") or "cpu"), b)
    return out


def _sooner_on_cpu(prefs: list[tuple[str, str]], have: dict[tuple[str, str], dict]) -> list[tuple[str, str]]:
    """The preferences on a CPU node, an engine here now before one whose build still runs, and
    one that waits only for the build's first phase (llama-cpp-python: libllama, staged before
    llama-server compiles, minutes sooner) before one that waits for all of it. A GPU node keeps
    its order: an engine built for the GPU is worth its wait over a CPU one."""
    def wait(pref: tuple[str, str]) -> int:
        row = have.get(pref)
        if row is None or not building(row):
            return 0
        return 1 if pref[0] == "llama-cpp-python" and row["build"].get("phase") == "libraries" else 2
    return sorted(prefs, key=wait)  # stable: the table's order within each


def _waits(row: dict) -> str:
    label = building(row)
    return f" ({label}; the load starts when it is built)" if label else ""


def _have_text(backends: list[dict]) -> str:
    names = [f"{b['name']} ({b.get('flavour') or 'cpu'})" for b in backends or [] if b.get("available")]
    return ", ".join(names) if names else "none"


def _impossible(fmt: str, gpu_type: str) -> str | None:
    if fmt == HUGGINGFACE and gpu_type == "AMD_RDNA":
        return ("vLLM does not support AMD RDNA GPUs, so a Hugging Face (safetensors) model cannot run here; "
                "load a GGUF of this model instead (llama-server with Vulkan serves it on RDNA).")
    if fmt == HUGGINGFACE and gpu_type == CPU:
        return ("a Hugging Face (safetensors) model needs vLLM on an NVIDIA or AMD CDNA GPU, and this node "
                "has no GPU; load a GGUF of this model instead (llama-server or llama-cpp-python serves it on the CPU).")
    return None


def _serving(server_type: str, fmt: str) -> str:
    """The backends that serve this kind of model in this format, for a refusal's message."""
    return " or ".join(name for name, adapter in ADAPTERS.items()
                       if server_type in adapter.server_types and fmt in adapter.formats) or "none"


def fallback_backends(*, fmt: str, gpu_type: str, backends: list[dict], server_type: str,
                      failed: str) -> list[str]:
    """Other backends installed here that serve this model, in the order the table prefers them."""
    have = _available(backends)
    names: list[str] = []
    for name, flavour in PREFERENCES.get((fmt, gpu_type), []):
        if name != failed and name not in names and (name, flavour) in have \
                and server_type in ADAPTERS[name].server_types:
            names.append(name)
    return names


def backend_options(*, fmt: str, gpu_type: str, backends: list[dict], server_type: str,
                    node_name: str) -> list[dict]:
    """Every backend for the Load dialog: {name, ok, default, why}; the default first, then the
    others that can run the model, then those that cannot (why not)."""
    try:
        default = choose_backend(fmt=fmt, gpu_type=gpu_type, backends=backends, node_name=node_name,
                                 server_type=server_type)
    except BackendUnavailable:
        default = None
    rows = []
    for name in ADAPTERS:
        if default is not None and name == default.backend:
            rows.append({"name": name, "ok": True, "default": True,
                         "why": f"{default.flavour} {default.version}".strip() + f": {default.reason}"})
            continue
        try:
            choice = choose_backend(fmt=fmt, gpu_type=gpu_type, backends=backends, requested=name,
                                    node_name=node_name, server_type=server_type)
        except BackendUnavailable as exc:
            rows.append({"name": name, "ok": False, "default": False, "why": str(exc)})
        else:
            where = "; runs on the CPU" if not choice.uses_gpu and gpu_type != CPU else ""
            rows.append({"name": name, "ok": True, "default": False,
                         "why": f"{choice.flavour} {choice.version}".strip() + f": can run it if chosen{where}"})
    return sorted(rows, key=lambda r: (not r["default"], not r["ok"]))


def choose_backend(*, fmt: str, gpu_type: str, backends: list[dict], requested: str | None = None,
                   node_name: str = "this node", server_type: str = "llm") -> BackendChoice:
    """The backend for a model of format `fmt` (and kind `server_type`) on a node with `gpu_type`
    and `backends`.

    `requested` (a backend name, or None/"auto") is validated instead of chosen.
    Raises BackendUnavailable with the reason and what would work.
    """
    if fmt not in (GGUF, HUGGINGFACE):
        raise BackendUnavailable(f"unknown model format {fmt!r} (expected gguf or huggingface)")
    gpu_label = GPU_LABEL.get(gpu_type, gpu_type)
    have = _available(backends)
    impossible = _impossible(fmt, gpu_type)
    if requested and requested != "auto":
        adapter = ADAPTERS.get(requested)
        if adapter is None:
            raise BackendUnavailable(f"unknown backend {requested!r} (known: {', '.join(ADAPTERS)})")
        if fmt not in adapter.formats:
            other = "vllm" if fmt == HUGGINGFACE else "llama-server or llama-cpp-python"
            raise BackendUnavailable(f"{requested} cannot serve a {fmt} model; {other} can")
        if server_type not in adapter.server_types:
            raise BackendUnavailable(f"{requested} cannot serve a {server_type} model; {_serving(server_type, fmt)} can")
        if requested == "vllm" and gpu_type in ("AMD_RDNA", CPU):
            raise BackendUnavailable(impossible or f"vLLM cannot run on {gpu_label} GPUs")
        flavours = [fl for (name, fl) in have if name == requested]
        if not flavours:
            raise BackendUnavailable(
                f"{requested} is not installed on {node_name} (available there: {_have_text(backends)})"
            )
        # The flavour that fits the node's GPUs, else one that runs on the CPU.
        ranked = [fl for (name, fl) in PREFERENCES.get((fmt, gpu_type), []) if name == requested]
        fitting = sorted((fl for fl in flavours if fl in FLAVOUR_FITS.get(gpu_type, set())),
                         key=lambda fl: ranked.index(fl) if fl in ranked else len(ranked))
        flavour = fitting[0] if fitting else ("cpu" if "cpu" in flavours else None)
        if flavour is None:
            raise BackendUnavailable(
                f"{requested} on {node_name} is built for {', '.join(flavours)}, which does not run on {gpu_label}"
            )
        b = have[(requested, flavour)]
        return BackendChoice(requested, flavour, b.get("version") or "", b.get("path") or "",
                             f"{requested} ({flavour}) chosen explicitly" + _waits(b))
    if impossible:
        raise BackendUnavailable(impossible)
    prefs = PREFERENCES.get((fmt, gpu_type))
    if prefs is None:
        raise BackendUnavailable(f"unknown GPU type {gpu_type!r}")
    prefs = [(name, flavour) for name, flavour in prefs if server_type in ADAPTERS[name].server_types]
    if not prefs:
        raise BackendUnavailable(f"no backend serves a {server_type} model in {fmt} format on {gpu_label} "
                                 f"(only {_serving(server_type, fmt)} can)")
    first = prefs[0]
    for name, flavour in _sooner_on_cpu(prefs, have) if gpu_type == CPU else prefs:
        b = have.get((name, flavour))
        if b is None:
            continue
        fmt_label = "GGUF" if fmt == GGUF else "Hugging Face (safetensors)"
        if (name, flavour) == first:
            reason = f"{fmt_label} on {gpu_label} -> {name} ({flavour})"
            if (name, flavour) == ("llama-server", "cpu") and server_type in ADAPTERS["llama-cpp-python"].server_types:
                reason += f": {LLAMA_SERVER_ON_CPU_WHY}"  # why not the other engine that could serve it
        elif first in have:  # chosen before the first, whose build still runs (see _sooner_on_cpu)
            reason = (f"{fmt_label} on {gpu_label} -> {name} ({flavour}): {first[0]} ({first[1]}) is still "
                      f"building on {node_name} ({building(have[first])}); "
                      + ("the build makes the libraries it needs first" if building(b) else "this one serves now"))
        else:
            reason = (f"{fmt_label} on {gpu_label} -> {name} ({flavour}): {first[0]} ({first[1]}) "
                      f"is not installed on {node_name}")
            if flavour == "cpu" and gpu_type != CPU:
                reason += "; runs on the CPU, without the GPU"
        return BackendChoice(name, flavour, b.get("version") or "", b.get("path") or "", reason + _waits(b))
    wanted = " or ".join(f"{n} ({f})" for n, f in prefs[:2])
    kind = f"{server_type} " if server_type != "llm" else ""
    raise BackendUnavailable(
        f"no backend on {node_name} can serve a {kind}{fmt} model on {gpu_label}: install {wanted} "
        f"(available there: {_have_text(backends)})"
    )
