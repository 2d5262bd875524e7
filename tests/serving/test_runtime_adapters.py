"""LoRA adapters added to and removed from a loaded model (issue 27 #1): at runtime on vLLM
(held against its recorded route tables; a stand-in engine records the calls, as no GPU is here),
by a rolling restart on llama-server."""
from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from hub.demo import write_tiny_lora_gguf
from serving.adapters import get_adapter
from tests.conftest import bearer
from tests.serving.conftest import NODE, node_backends, set_backends
from tests.serving.test_engine_routes import VLLM_VERSIONS, vllm_routes

pytestmark = pytest.mark.django_db
VLLM = {"name": "vllm", "available": True, "version": "0.17.0", "flavour": "cuda", "path": "", "reason": ""}


class StandIn:
    """A vLLM stand-in: answers the LoRA routes, records each call (path, body, bearer); a
    lora_name in `refuse` gets vLLM's 400."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict, str]] = []
        self.refuse: set[str] = set()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
                body = json.loads(self.rfile.read(int(self.headers.get("content-length") or 0)) or b"{}")
                outer.calls.append((self.path, body, self.headers.get("authorization", "")))
                if body.get("lora_name") in outer.refuse:
                    status, answer = 400, {"error": {"message": "The lora adapter could not be loaded.",
                                                     "type": "BadRequestError", "code": 400}}
                else:
                    status, answer = 200, f"Success: LoRA adapter '{body.get('lora_name')}' added successfully."
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def stand_ins() -> Iterator[list[StandIn]]:
    made = [StandIn(), StandIn()]
    yield made
    for one in made:
        one.close()


@pytest.fixture
def gpu_node(serving_settings, db):
    """This node (its paths are checked here), with two GPUs and vLLM 0.17.0."""
    from hardware.models import GpuDevice
    from hardware.services import register_node

    node = register_node(name=NODE, address="127.0.0.1")
    node.backends, node.detector = [VLLM], "nvml"
    node.memory_total_mib, node.memory_used_mib = 65536, 1024
    node.save()
    for index in (0, 1):
        GpuDevice.objects.create(node=node, index=index, vendor="NVIDIA", type="NVIDIA", name="L4",
                                 memory_total_mib=24000, memory_used_mib=500)
    return node


def _folder(path: Path, files: dict[str, str]) -> Path:
    path.mkdir(parents=True)
    for name, text in files.items():
        (path / name).write_text(text)
    return path


@pytest.fixture
def hf_model(tmp_path) -> Path:
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 256,
              "intermediate_size": 128, "max_position_embeddings": 512, "torch_dtype": "float16"}
    return _folder(tmp_path / "base", {"config.json": json.dumps(config), "model.safetensors": "x" * 64})


def _peft(tmp_path: Path, name: str, peft_type: str = "LORA") -> Path:
    return _folder(tmp_path / name, {"adapter_config.json": json.dumps({"peft_type": peft_type, "r": 8}),
                                     "adapter_model.safetensors": "x" * 32})


def _ready(model_name: str, stand_ins: list[StandIn]) -> list:
    """What the agent does once the engines answer: READY on their ports, each with its secret."""
    from serving.models import ModelInstance

    rows = list(ModelInstance.objects.filter(model_name=model_name).order_by("replica"))
    for row, stand_in in zip(rows, stand_ins, strict=False):
        ModelInstance.objects.filter(pk=row.pk).update(state="READY", port=stand_in.port,
                                                       backend_key=f"secret-{row.replica}")
    return rows


def _add(client, key, body):
    return client.post("/api/management/adapters", body, content_type="application/json", **bearer(key))


def test_the_runtime_routes_are_held_against_vllms_recorded_route_tables():
    vllm = get_adapter("vllm")
    assert VLLM_VERSIONS
    for version in VLLM_VERSIONS:
        has = {"/v1/load_lora_adapter", "/v1/unload_lora_adapter"} <= vllm_routes(version)
        assert vllm.runtime_adapters(version) == has, version
    assert not vllm.runtime_adapters("0.6.1") and vllm.runtime_adapters("")
    assert not get_adapter("llama-server").runtime_adapters("")


def test_vllm_adds_and_removes_adapters_at_runtime_on_every_replica(client, gpu_node, operator, hf_model, tmp_path,
                                                                    stand_ins):
    from serving.models import ModelInstance

    r = client.post("/api/management/load", {"model_path": str(hf_model), "model_name": "hf", "replicas": 2,
                                             "extra_args": {"--enable-lora": True}},
                    content_type="application/json", **bearer(operator.key))
    assert r.status_code == 202 and r.json()["backend"] == "vllm", r.content
    plan = ModelInstance.objects.get(model_name="hf", replica=0).plan
    assert "--enable-lora" in plan["argv"] and plan["env"]["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    sql = _peft(tmp_path, "sql-lora")

    # Not while a replica is loading; then on both READY replicas, each called with its own secret.
    r = _add(client, operator.key, {"model_name": "hf", "name": "sql", "path": str(sql)})
    assert r.status_code == 409 and r.json()["error"]["code"] == "not_ready", r.content
    rows = _ready("hf", stand_ins)
    r = _add(client, operator.key, {"model_name": "hf", "name": "sql", "path": str(sql)})
    assert r.status_code == 200, r.content
    assert r.json() == {"model_name": "hf", "adapter": "hf:sql", "applied": "runtime", "replicas": [i.pk for i in rows]}
    for replica, stand_in in enumerate(stand_ins):
        assert stand_in.calls == [("/v1/load_lora_adapter", {"lora_name": "hf:sql", "lora_path": str(sql)},
                                   f"Bearer secret-{replica}")]
    for row in ModelInstance.objects.filter(model_name="hf"):
        assert row.adapters == [{"name": "sql", "path": str(sql), "scale": 1.0}]
        argv = row.plan["argv"]  # a restart starts with the set
        assert argv[argv.index("--lora-modules") + 1] == f"hf:sql={sql}" and argv.count("--enable-lora") == 1
    listed = client.get("/api/management/instances", **bearer(operator.key)).json()
    assert all(i["adapters"][0]["name"] == "sql" for i in listed)

    # All or none: replica 1 refuses the next one; replica 0, which took it, is told to drop it.
    stand_ins[1].refuse.add("hf:geo")
    geo = _peft(tmp_path, "geo-lora")
    r = _add(client, operator.key, {"model_name": "hf", "name": "geo", "path": str(geo)})
    assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_error", r.content
    assert "replica 1 of hf" in r.json()["error"]["message"] and "could not be loaded" in r.json()["error"]["message"]
    assert [c[0] for c in stand_ins[0].calls[1:]] == ["/v1/load_lora_adapter", "/v1/unload_lora_adapter"]
    assert all(len(row.adapters) == 1 for row in ModelInstance.objects.filter(model_name="hf"))

    # Refused before any call: a name taken, a folder that is not a LoRA, a path outside the allowed dirs.
    before = [len(s.calls) for s in stand_ins]
    for body, code in (({"name": "sql", "path": str(sql)}, "invalid_request"),
                       ({"name": "ia3", "path": str(_peft(tmp_path, "ia3", "IA3"))}, "invalid_adapter"),
                       ({"name": "etc", "path": "/etc"}, "invalid_path"),
                       ({"name": "Bad Name", "path": str(sql)}, "invalid_request")):
        r = _add(client, operator.key, {"model_name": "hf", **body})
        assert r.status_code == 400 and r.json()["error"]["code"] == code, (body, r.content)
    r = _add(client, operator.key, {"model_name": "nope", "name": "x", "path": str(sql)})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert [len(s.calls) for s in stand_ins] == before

    r = client.delete("/api/management/adapters?model_name=hf&name=sql", **bearer(operator.key))
    assert r.status_code == 200 and r.json()["applied"] == "runtime", r.content
    assert all(s.calls[-1][:2] == ("/v1/unload_lora_adapter", {"lora_name": "hf:sql"}) for s in stand_ins)
    assert all(row.adapters == [] for row in ModelInstance.objects.filter(model_name="hf"))
    r = client.delete("/api/management/adapters?model_name=hf&name=sql", **bearer(operator.key))
    assert r.status_code == 404 and r.json()["error"]["code"] == "adapter_not_found"
    from accounts.models import AuditEvent

    audited = set(AuditEvent.objects.filter(action__startswith="adapter_").values_list("action", "outcome"))
    assert audited == {("adapter_add", "success"), ("adapter_add", "refused"), ("adapter_remove", "success"),
                       ("adapter_remove", "refused")}


def test_vllm_that_cannot_change_them_at_runtime_is_refused_by_name(client, gpu_node, operator, hf_model, tmp_path,
                                                                   stand_ins):
    from serving.models import ModelInstance

    r = client.post("/api/management/load", {"model_path": str(hf_model), "model_name": "plain"},
                    content_type="application/json", **bearer(operator.key))
    assert r.status_code == 202, r.content
    _ready("plain", stand_ins)
    body = {"model_name": "plain", "name": "sql", "path": str(_peft(tmp_path, "sql"))}
    r = _add(client, operator.key, body)
    assert r.status_code == 409 and r.json()["error"]["code"] == "lora_not_enabled", r.content
    row = ModelInstance.objects.get(model_name="plain")
    ModelInstance.objects.filter(pk=row.pk).update(plan={**row.plan, "version": "0.6.1"})
    r = _add(client, operator.key, body)
    assert r.status_code == 409 and r.json()["error"]["code"] == "runtime_adapters_unsupported", r.content
    assert "vLLM 0.6.1" in r.json()["error"]["message"]
    assert not any(s.calls for s in stand_ins)


def test_llama_server_restarts_its_replicas_with_the_new_set(client, node, operator, tiny_gguf, tmp_path):
    from serving.control.rollout import progress_rollouts
    from serving.models import ModelDeployment, ModelInstance

    set_backends(node.name, node_backends())
    lora = write_tiny_lora_gguf(tmp_path / "pirate.gguf")
    r = client.post("/api/management/load", {"model_path": str(tiny_gguf), "model_name": "tl",
                                             "backend": "llama-server"},
                    content_type="application/json", **bearer(operator.key))
    assert r.status_code == 202, r.content
    pk = r.json()["id"]
    ModelInstance.objects.filter(pk=pk).update(state="READY")
    r = _add(client, operator.key, {"model_name": "tl", "name": "pirate", "path": str(lora), "scale": 0.5})
    assert r.status_code == 202, r.content
    assert r.json() == {"model_name": "tl", "adapter": "tl:pirate", "applied": "rolling_restart", "replicas": [pk]}
    inst = ModelInstance.objects.get(pk=pk)
    assert inst.adapters == []  # the engine runs without it until it restarts with it
    assert any("restart one at a time with the new set" in e.message for e in inst.events.all())
    assert ModelDeployment.objects.get(model_name="tl").rollout["adapters"] == [
        {"name": "pirate", "path": str(lora), "scale": 0.5}]
    assert progress_rollouts() == [pk]
    inst = ModelInstance.objects.get(pk=pk)
    assert inst.restart_requested and inst.adapters == [{"name": "pirate", "path": str(lora), "scale": 0.5}]
    assert f"{lora}:0.5" in inst.plan["argv"]


def test_an_adapter_from_the_store_added_to_vllm_takes_a_rolling_restart(client, gpu_node, operator, hf_model,
                                                                        tmp_path, stand_ins, settings):
    """vLLM's /v1/load_lora_adapter reads a path on the engine's node: one from the store must be
    copied into that node's cache first, which a replica's start does (the supervisor)."""
    from hub.index import index_prefix
    from hub.store import get_store
    from serving.control.rollout import progress_rollouts
    from serving.models import ModelInstance

    settings.STORE_DIR, settings.MINIO_ENDPOINT = tmp_path / "store", ""
    get_store().upload_model("lora/sql", _peft(tmp_path, "sql"))
    index_prefix("lora/sql")
    r = client.post("/api/management/load", {"model_path": str(hf_model), "model_name": "hf",
                                             "extra_args": {"--enable-lora": True}},
                    content_type="application/json", **bearer(operator.key))
    assert r.status_code == 202, r.content
    rows = _ready("hf", stand_ins)
    r = _add(client, operator.key, {"model_name": "hf", "name": "sql", "path": "lora/sql"})
    assert r.status_code == 202, r.content
    assert r.json() == {"model_name": "hf", "adapter": "hf:sql", "applied": "rolling_restart",
                        "replicas": [rows[0].pk]}
    assert not any(s.calls for s in stand_ins)
    assert any("copies an adapter from the store" in e.message for e in rows[0].events.all())
    assert progress_rollouts() == [rows[0].pk]
    inst = ModelInstance.objects.get(pk=rows[0].pk)
    assert inst.adapters == [{"name": "sql", "path": "lora/sql", "scale": 1.0}]
    argv = inst.plan["argv"]
    assert argv[argv.index("--lora-modules") + 1] == "hf:sql={adapter:sql}"  # the agent fills in its copy
