"""LoRA adapters (issue 27 #1): `adapters: [{name, path, scale}]` on a load, each served as
`<model>:<adapter>` on the base's instance. On llama-server (real, the tiny llama and a tiny LoRA
GGUF written for it) the proxy sets each request's `lora`: the adapter's answers differ from the
base's at temperature 0, the base's stay the base's, usage and the request log name
`<model>:<adapter>`, and a key's allowed models take it as a model of its own."""
from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from hub.demo import write_tiny_lora_gguf
from serving.adapters import LaunchSpec, get_adapter
from tests.conftest import KeyedConsole, bearer
from tests.serving.conftest import NODE, keyed_console, node_backends, set_backends, wait_api

ENV = {"XGEN_RESTART_BACKOFF": "0", "XGEN_RECONCILE_INTERVAL": "1", "XGEN_STOP_GRACE": "5",
       "XGEN_USAGE_FLUSH": "1"}
PROMPT = {"prompt": "hello world", "max_tokens": 8, "temperature": 0}


@pytest.fixture(scope="session")
def tiny_lora(tmp_path_factory) -> Path:
    return write_tiny_lora_gguf(tmp_path_factory.mktemp("loras") / "tiny-lora.gguf")


# ---------------------------------------------------------------- the argv
def test_llama_server_gets_lora_scaled_and_vllm_lora_modules():
    spec = LaunchSpec(model_file=Path("/m/base.gguf"), model_name="base", server_type="llm", host="127.0.0.1",
                      port=8000, version="0.5.0-dev (build 0, commit 0c1e570)",
                      adapters=(("a", "/m/a.gguf", 1.0), ("b", "/m/b.gguf", 0.5)))
    argv = get_adapter("llama-server").build_command(spec)
    assert argv[argv.index("--lora-scaled") + 1] == "/m/a.gguf:1,/m/b.gguf:0.5"
    vllm = get_adapter("vllm").build_command(LaunchSpec(**{**spec.__dict__, "version": "0.17.0"}))
    i = vllm.index("--lora-modules")
    assert "--enable-lora" in vllm and vllm[i + 1:i + 3] == ["base:a=/m/a.gguf", "base:b=/m/b.gguf"]
    assert not get_adapter("llama-cpp-python").supports_adapters


def test_the_recorded_help_knows_the_flags():
    """--lora-scaled (FNAME:SCALE,...) is in the pinned llama-server's --help; vLLM's recordings
    have --enable-lora and --lora-modules."""
    import subprocess

    from tests.conftest import llama_server_binary

    out = subprocess.run([llama_server_binary(), "--help"], capture_output=True, text=True, timeout=30)
    assert "--lora-scaled FNAME:SCALE,..." in out.stdout + out.stderr
    for text in (Path(__file__).parent / "vllm_help").glob("*.txt"):
        assert "--enable-lora" in text.read_text() and "--lora-modules" in text.read_text(), text


# ---------------------------------------------------------------- the load's checks
def _load(client, operator, model, adapters, **fields):
    body = {"model_path": str(model), "model_name": "based", "adapters": adapters, **fields}
    return client.post("/api/management/load", body, content_type="application/json", **bearer(operator.key))


@pytest.mark.django_db
def test_adapters_are_checked_at_load(client, node, operator, tiny_gguf, tiny_lora, tmp_path):
    set_backends(NODE, node_backends())
    other_arch = write_tiny_lora_gguf(tmp_path / "qwen-lora.gguf", architecture="qwen2")
    refused = [
        ([{"name": "a", "path": str(tiny_lora)}], "llama-cpp-python", "adapters_unsupported"),
        ([{"name": "Bad Name", "path": str(tiny_lora)}], "llama-server", "invalid_request"),
        ([{"name": "a", "path": str(tiny_lora)}, {"name": "a", "path": str(tiny_lora)}], "llama-server",
         "invalid_request"),
        ([{"name": "a", "path": str(tiny_lora.parent / ".." / tiny_lora.parent.name / tiny_lora.name)}],
         "llama-server", "invalid_path"),
        ([{"name": "a", "path": "/etc/passwd"}], "llama-server", "invalid_path"),
        ([{"name": "a", "path": "loras/tiny"}], "llama-server", "invalid_path"),
        ([{"name": "a", "path": str(tiny_gguf)}], "llama-server", "invalid_adapter"),  # a model, not an adapter
        ([{"name": "a", "path": str(other_arch)}], "llama-server", "invalid_adapter"),  # qwen2 vs llama
    ]
    for adapters, backend, code in refused:
        r = _load(client, operator, tiny_gguf, adapters, backend=backend)
        assert r.status_code == 400 and r.json()["error"]["code"] == code, (adapters, backend, r.content)
    r = _load(client, operator, tiny_gguf, [{"name": "a", "path": str(tiny_lora), "scale": 99}],
              backend="llama-server")
    assert r.status_code == 400, r.content  # the schema's range
    r = _load(client, operator, tiny_gguf, [{"name": "pirate", "path": str(tiny_lora), "scale": 0.5}],
              backend="llama-server", policy="on_demand")
    assert r.status_code == 202, r.content
    from serving.models import ModelInstance

    inst = ModelInstance.objects.get(pk=r.json()["id"])
    assert inst.adapters == [{"name": "pirate", "path": str(tiny_lora), "scale": 0.5}]
    assert f"{tiny_lora}:0.5" in inst.plan["argv"]
    r = _load(client, operator, tiny_gguf, [], backend="llama-server", model_name="based:pirate")
    assert r.status_code == 409 and r.json()["error"]["code"] == "duplicate_model_name", r.content


@pytest.mark.django_db
def test_the_load_dialog_takes_adapters_one_per_line(node, operator, tiny_gguf, tiny_lora):
    from django.test import Client

    from serving.models import ModelInstance

    set_backends(NODE, node_backends())
    c = Client()
    c.force_login(operator.user)
    page = c.get("/instances/new/").content.decode()
    assert 'name="adapters"' in page and "load again (on llama-server the engine restarts" in page
    v = c.get("/instances/new/verdict", {"model_path": str(tiny_gguf), "backend": "llama-server",
                                         "adapters": f"pirate {tiny_lora} 0.5"}).content.decode()
    assert "--lora-scaled" in v and f"{tiny_lora}:0.5" in v, v
    bad = c.get("/instances/new/verdict", {"model_path": str(tiny_gguf), "backend": "llama-server",
                                           "adapters": "pirate"}).content.decode()
    assert "LoRA adapters: line 1" in bad
    r = c.post("/instances/new/", {"model_path": str(tiny_gguf), "model_name": "paged", "server_type": "llm",
                                   "backend": "llama-server", "node": NODE, "adapters": f"pirate {tiny_lora}\n"})
    assert r.status_code == 302, r.content.decode()[-2000:]
    assert ModelInstance.objects.get(model_name="paged").adapters == [
        {"name": "pirate", "path": str(tiny_lora), "scale": 1.0}]


# ---------------------------------------------------------------- adapters in the store (lora/<name>)
@pytest.fixture
def store(settings, tmp_path):
    settings.STORE_DIR, settings.MINIO_ENDPOINT = tmp_path / "store", ""
    from hub.store import get_store

    return get_store()


@pytest.mark.django_db
def test_adapters_from_the_store_are_checked_at_load(client, node, operator, tiny_gguf, tiny_lora, store, tmp_path):
    from django.test import Client

    from hub.index import index_prefix
    from serving.control.allocation import cache_users
    from serving.control.planning import LaunchPlan
    from serving.models import ModelInstance

    set_backends(NODE, node_backends())
    store.upload_model("lora/pirate", tiny_lora)
    index_prefix("lora/pirate", store=store)
    store.upload_model("lora/unindexed", tiny_lora)  # in the store, not yet in the index: its manifest is read
    peft = tmp_path / "peft"
    peft.mkdir()
    (peft / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8}')
    (peft / "adapter_model.safetensors").write_bytes(b"x" * 32)
    store.upload_model("lora/peft", peft)
    index_prefix("lora/peft", store=store)
    refused = [("lora/missing", "adapter_not_found"), ("gguf/pirate", "invalid_path"),
               ("lora/pirate/tiny-lora.gguf", "invalid_path"), ("lora/../gguf/x", "invalid_path"),
               ("lora/peft", "invalid_adapter")]  # a PEFT folder for vLLM, not for a GGUF on llama-server
    for path, code in refused:
        r = _load(client, operator, tiny_gguf, [{"name": "a", "path": path}], backend="llama-server")
        assert r.status_code == 400 and r.json()["error"]["code"] == code, (path, r.content)
    r = client.post("/api/management/load", {"model_path": "lora/pirate"}, content_type="application/json",
                    **bearer(operator.key))
    assert r.status_code == 400 and "is a LoRA adapter: load its base model with it" in r.json()["error"]["message"]

    r = _load(client, operator, tiny_gguf, [{"name": "pirate", "path": "lora/pirate", "scale": 0.5},
                                            {"name": "other", "path": "lora/unindexed/"}], backend="llama-server")
    assert r.status_code == 202, r.content
    inst = ModelInstance.objects.get(pk=r.json()["id"])
    assert inst.adapters == [{"name": "pirate", "path": "lora/pirate", "scale": 0.5},
                             {"name": "other", "path": "lora/unindexed", "scale": 1.0}]
    assert "{adapter:pirate}:0.5,{adapter:other}:1" in inst.plan["argv"]  # the node fills in its cached copies
    argv = LaunchPlan.from_json(inst.plan).command(adapters={"pirate": "/cache/p.gguf", "other": "/cache/o.gguf"})
    assert "/cache/p.gguf:0.5,/cache/o.gguf:1" in argv
    users = cache_users(NODE)  # the node's cache keeps them while the instance runs
    assert [u.id for u in users["lora/pirate"]] == [inst.pk] == [u.id for u in users["lora/unindexed"]]

    # The pages: the store lists the adapter as one that loads with its base; the Load page offers it.
    c = Client()
    c.force_login(operator.user)
    listing = c.get("/models/?format=lora").content.decode()
    assert "lora/pirate" in listing and "loads with its base" in listing
    page = c.get("/instances/new/").content.decode()
    assert 'data-line="pirate lora/pirate 1.0"' in page and "GGUF, for llama-server" in page
    assert 'data-line="peft lora/peft 1.0"' in page and "PEFT, for vLLM" in page
    assert '<option value="lora/pirate">' not in page  # not offered as a model to load


# ---------------------------------------------------------------- end to end, llama-server
@pytest.fixture(scope="module")
def lc(tmp_path_factory) -> Iterator[KeyedConsole]:
    yield from keyed_console(tmp_path_factory.mktemp("lora"), extra_env=ENV)


def _complete(lc: KeyedConsole, model: str, key: str | None = None, **extra) -> httpx.Response:
    return httpx.post(f"{lc.url}/v1/completions", timeout=60, json={"model": model, **PROMPT, **extra},
                      headers={"Authorization": f"Bearer {key or lc.key}"})


def _text(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


@pytest.mark.slow  # a real llama-server with two adapters: 26 s of the quick run
def test_an_adapter_is_a_model_of_its_own_on_llama_server(lc, tiny_gguf, tiny_lora):
    r = httpx.post(f"{lc.url}/api/management/load", headers=lc.auth, timeout=30, json={
        "model_path": str(tiny_gguf), "model_name": "tl", "backend": "llama-server",
        "adapters": [{"name": "pirate", "path": str(tiny_lora)}, {"name": "calm", "path": str(tiny_lora),
                                                                   "scale": 0.25}]})
    assert r.status_code == 202, r.text
    pk = r.json()["id"]
    inst = wait_api(f"{lc.url}/api/management/instances/{pk}", lc.key, lambda b: b["state"] in ("READY", "ERROR"),
                    timeout=120)
    assert inst["state"] == "READY", inst
    assert inst["adapters"][0] == {"name": "pirate", "path": str(tiny_lora), "scale": 1.0}
    models = {m["id"]: m for m in httpx.get(f"{lc.url}/v1/models", headers=lc.auth, timeout=10).json()["data"]}
    assert {"tl", "tl:pirate", "tl:calm"} <= set(models) and models["tl:pirate"]["parent"] == "tl"

    base = _text(_complete(lc, "tl"))
    pirate = _text(_complete(lc, "tl:pirate"))
    assert pirate != base, "the adapter changes the answer at temperature 0"
    assert _text(_complete(lc, "tl")) == base, "a request for the base runs with every adapter at 0"
    assert _text(_complete(lc, "tl:pirate")) == pirate
    assert _text(_complete(lc, "tl:pirate", lora_scale=0)) == base, "a request's own scale"
    assert _text(_complete(lc, "tl:calm", lora_scale=1.0)) == pirate  # the same file at the same scale
    assert _complete(lc, "tl:pirate", lora_scale="x").status_code == 400
    # The client's own `lora` does not turn an adapter on for the base.
    assert _text(_complete(lc, "tl", lora=[{"id": 0, "scale": 1.0}])) == base
    chat = httpx.post(f"{lc.url}/v1/chat/completions", headers=lc.auth, timeout=60, json={
        "model": "tl:pirate", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert chat.status_code == 200, chat.text

    # A key allowed the adapter only: the adapter, not the base.
    only = lc.console.manage("createapikey", "--username", "admin", "--name", "pirate-only",
                             "--allowed-models", "tl:pirate").stdout.strip().splitlines()[-1]
    assert _complete(lc, "tl:pirate", key=only).status_code == 200
    denied = _complete(lc, "tl", key=only)
    assert denied.status_code == 403 and denied.json()["error"]["code"] == "model_not_allowed"
    listed = httpx.get(f"{lc.url}/v1/models", headers={"Authorization": f"Bearer {only}"}, timeout=10).json()
    assert [m["id"] for m in listed["data"]] == ["tl:pirate"]

    # Usage and the request log under the adapter's name.
    code = ("import json; from serving.models import RequestLog; from django.db.models import Count; "
            "print(json.dumps(dict(RequestLog.objects.values_list('model').annotate(n=Count('id')))))")
    counts: dict = {}
    deadline = time.monotonic() + 30
    while counts.get("tl:pirate", 0) < 5 or not counts.get("tl:calm"):
        assert time.monotonic() < deadline, counts
        time.sleep(0.5)
        counts = json.loads(lc.console.manage("shell", "-v", "0", "-c", code).stdout.strip().splitlines()[-1])
    assert counts["tl"] >= 3, counts  # the base's own requests stay the base's
    httpx.post(f"{lc.url}/api/management/unload", headers=lc.auth, json={"id": pk}, timeout=10)
    wait_api(f"{lc.url}/api/management/instances/{pk}", lc.key, lambda b: b["state"] == "STOPPED", timeout=60)


@pytest.mark.slow  # a real llama-server, model and adapter copied from the store: 15 s
def test_a_model_and_its_adapter_from_the_store(lc, tiny_gguf, tiny_lora, tmp_path):
    """What an air-gapped node does: the base and the adapter come from the store into the node's
    cache; the adapter's architecture is checked there against the base."""
    for path, fmt, name in ((tiny_gguf, "gguf", "tiny-base"), (tiny_lora, "lora", "pirate"),
                            (write_tiny_lora_gguf(tmp_path / "qwen-lora.gguf", architecture="qwen2"), "lora", "qwen")):
        done = lc.console.manage("hub_upload", str(path), "--format", fmt, "--name", name)
        assert done.returncode == 0, done.stdout + done.stderr
    listed = httpx.get(f"{lc.url}/api/storage/models", headers=lc.auth, params={"prefix": "lora/"}, timeout=10).json()
    assert {"lora/pirate", "lora/qwen"} <= {m["prefix"] for m in listed["items"]}, listed

    load = {"model_path": "gguf/tiny-base", "model_name": "st", "backend": "llama-server"}
    r = httpx.post(f"{lc.url}/api/management/load", headers=lc.auth, timeout=30,
                   json={**load, "adapters": [{"name": "pirate", "path": "lora/pirate"}]})
    assert r.status_code == 202, r.text
    pk = r.json()["id"]
    inst = wait_api(f"{lc.url}/api/management/instances/{pk}", lc.key, lambda b: b["state"] in ("READY", "ERROR"),
                    timeout=120)
    assert inst["state"] == "READY", inst
    cached = lc.console.data_dir / "models" / "lora" / "pirate" / tiny_lora.name
    assert cached.is_file() and cached.read_bytes() == tiny_lora.read_bytes()
    assert _text(_complete(lc, "st:pirate")) != _text(_complete(lc, "st"))
    httpx.post(f"{lc.url}/api/management/unload", headers=lc.auth, json={"id": pk}, timeout=10)
    wait_api(f"{lc.url}/api/management/instances/{pk}", lc.key, lambda b: b["state"] == "STOPPED", timeout=60)

    # An adapter made for another architecture: refused on the node before llama-server starts.
    r = httpx.post(f"{lc.url}/api/management/load", headers=lc.auth, timeout=30,
                   json={**load, "model_name": "st2", "adapters": [{"name": "qwen", "path": "lora/qwen"}]})
    assert r.status_code == 202, r.text
    inst = wait_api(f"{lc.url}/api/management/instances/{r.json()['id']}", lc.key,
                    lambda b: b["state"] in ("READY", "ERROR"), timeout=120)
    assert inst["state"] == "ERROR" and "is for 'qwen2'; the base model is 'llama'" in inst["error"], inst
    assert inst["pid"] is None
