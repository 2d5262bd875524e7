"""Engine presets (issue 27 #3): a model's named settings, stored, held against each engine
version's flags, chosen at load (the API's `preset`, the Load dialog), and run by the real
llama-server."""
from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from serving.control import presets
from serving.control.presets import PresetInvalid, applied, clean_settings, flags_for
from tests.conftest import KeyedConsole, bearer
from tests.serving.conftest import (
    LLAMA_CPP_PYTHON,
    keyed_console,
    node_backends,
    set_backends,
    wait_api,
)
from tests.serving.test_vllm_help import VERSIONS as VLLM_VERSIONS
from tests.serving.test_vllm_help import recorded

EVERYTHING = {"context_size": 8192, "parallel": 4, "kv_cache_type": "bf16", "flash_attention": True,
              "tool_call_parser": "hermes", "reasoning_parser": "deepseek_r1",
              "chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}",
              "speculative": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}}


# ---------------------------------------------------------------- the settings and each engine's flags
@pytest.mark.parametrize("raw, needle", [
    ([], "JSON object"),
    ({"ctx": 1}, "unknown setting ctx"),
    ({"context_size": 10}, "context_size must be 64..4194304"),
    ({"context_size": "2k"}, "whole number"),
    ({"context_size": True}, "whole number"),
    ({"parallel": 0}, "parallel must be 1..1024"),
    ({"kv_cache_type": "q2_k"}, "kv_cache_type must be one of"),
    ({"flash_attention": "yes"}, "true or false"),
    ({"tool_call_parser": "--enable-x"}, "tool_call_parser is a name"),
    ({"reasoning_parser": "a b"}, "reasoning_parser is a name"),
    ({"chat_template": "x" * 513}, "at most 512"),
    ({"speculative": {"method": "ngram", "model": "/etc/passwd"}}, "does not take model"),
    ({"speculative": {"method": "draft"}}, "speculative.method must be one of"),
    ({"speculative": {"method": "ngram", "num_speculative_tokens": 99}}, "1..64"),
])
def test_bad_settings_are_refused_naming_the_field(raw, needle):
    with pytest.raises(PresetInvalid, match=needle):
        clean_settings(raw)


def test_settings_keep_what_is_set():
    assert clean_settings({**EVERYTHING, "parallel": "4", "reasoning_parser": None}) == {
        **{k: v for k, v in EVERYTHING.items() if k != "reasoning_parser"}, "parallel": 4}


def test_each_engine_gets_its_own_flags():
    llama = {k: v for k, v in EVERYTHING.items() if k != "speculative"}
    assert flags_for("llama-server", llama | {"tool_call_parser": "auto", "reasoning_parser": "deepseek"}) == {
        "--ctx-size": 8192, "--parallel": 4, "--cache-type-k": "bf16", "--cache-type-v": "bf16",
        "--flash-attn": True, "--jinja": True, "--reasoning-format": "deepseek",
        "--chat-template": EVERYTHING["chat_template"]}
    assert flags_for("vllm", EVERYTHING) == {
        "--max-model-len": 8192, "--max-num-seqs": 4, "--kv-cache-dtype": "auto", "--enable-auto-tool-choice": True,
        "--tool-call-parser": "hermes", "--reasoning-parser": "deepseek_r1",
        "--chat-template": EVERYTHING["chat_template"],
        "--speculative-config": '{"method":"ngram","num_speculative_tokens":4,"prompt_lookup_max":3}'}
    assert flags_for("llama-cpp-python", {"context_size": 2048, "parallel": 1, "flash_attention": False,
                                          "chat_template": "chatml"}) == {
        "--n_ctx": 2048, "--flash_attn": False, "--chat_format": "chatml"}


@pytest.mark.parametrize("engine, settings, needle", [
    ("llama-server", {"kv_cache_type": "fp8"}, "no fp8 KV cache"),
    ("llama-server", {"speculative": {"method": "ngram"}}, "draft model"),
    ("llama-server", {"tool_call_parser": "hermes"}, "use auto"),
    ("vllm", {"kv_cache_type": "q4_0"}, "f16/bf16 \\(auto\\) or fp8"),
    ("vllm", {"flash_attention": False}, "attention backend"),
    ("llama-cpp-python", {"parallel": 2}, "one request at a time"),
    ("llama-cpp-python", {"kv_cache_type": "f16"}, "no such setting"),
    ("llama-cpp-python", {"chat_template": "{{ x }}"}, "chat format's name"),
])
def test_what_an_engine_cannot_take_is_refused_naming_it(engine, settings, needle):
    with pytest.raises(PresetInvalid, match=needle):
        flags_for(engine, settings)


def test_flags_are_held_against_the_engine_version():
    """The flags go through the engine's extra_args check at the node's version: a flag that
    version lacks is refused naming the version; a switch that became a value follows the version."""
    preset = {"name": "fast", "settings": {"flash_attention": True, "reasoning_parser": "deepseek"}}
    assert applied("llama-server", "b6500", preset) == {"--flash-attn": "on", "--reasoning-format": "deepseek"}
    with pytest.raises(PresetInvalid, match="preset 'fast' on llama-server b4500: .*does not accept "
                                            "--reasoning-format"):
        applied("llama-server", "b4500", preset)
    old = {"name": "fa", "settings": {"flash_attention": True}}
    assert applied("llama-server", "b5000", old) == {"--flash-attn": True}  # a bare switch before b6325
    assert applied("llama-cpp-python", "0.3.16", old) == {"--flash_attn": "true"}
    with pytest.raises(PresetInvalid, match="--reasoning-format must be one of none, deepseek, auto"):
        applied("llama-server", "", {"name": "r", "settings": {"reasoning_parser": "qwen3"}})


@pytest.mark.parametrize("version", VLLM_VERSIONS)
def test_every_vllm_flag_a_preset_writes_is_in_that_releases_help(version):
    flags = applied("vllm", version, {"name": "all", "settings": EVERYTHING})
    known, _ = recorded(version)
    assert set(flags) <= set(known), set(flags) - set(known)


# ---------------------------------------------------------------- the API and a load with a preset
def put(client, key, body):
    return client.put("/api/management/presets", json.dumps(body), content_type="application/json", **bearer(key))


def load(client, key, body):
    return client.post("/api/management/load", body, content_type="application/json", **bearer(key))


@pytest.mark.django_db
def test_presets_are_saved_checked_and_applied_at_load(client, node, operator, viewer, tiny_gguf):
    set_backends(node.name, node_backends())  # llama-cpp-python and the real llama-server probe's row
    path = str(tiny_gguf)
    r = put(client, operator.key, {"model_path": path, "name": "small", "default": True,
                                   "settings": {"context_size": 384, "parallel": 2}})
    assert r.status_code == 201, r.content
    body = r.json()
    assert body["settings"] == {"context_size": 384, "parallel": 2} and body["default"] is True
    verdicts = {e["backend"]: e for e in body["engines"]}
    assert verdicts["llama-server"]["ok"] and not verdicts["llama-cpp-python"]["ok"]
    assert "one request at a time" in verdicts["llama-cpp-python"]["message"]
    # Only operators; a viewer's key is refused before the body is read.
    assert put(client, viewer.key, {"model_path": path, "name": "x", "settings": {}}).status_code == 403
    assert client.get("/api/management/presets", **bearer(viewer.key)).status_code == 403
    for bad, needle in (({"name": "none"}, "not 'none'"), ({"name": "Big Ctx"}, "a-z 0-9"),
                        ({"settings": {}}, "at least one"), ({"model_path": "gguf/../x"}, "model path"),
                        ({"settings": {"kv_cache_type": "fp8"}}, "no engine the nodes have can apply it")):
        r = put(client, operator.key, {"model_path": path, "name": "bad", "settings": {"parallel": 1}} | bad)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_preset", r.content
        assert needle in r.json()["error"]["message"], r.content
    # A second default replaces the first.
    assert put(client, operator.key, {"model_path": path, "name": "one", "default": True,
                                      "settings": {"parallel": 1}}).status_code == 201
    listed = client.get(f"/api/management/presets?model_path={path}", **bearer(operator.key)).json()
    assert [(p["name"], p["default"]) for p in listed] == [("one", True), ("small", False)]
    assert put(client, operator.key, {"model_path": path, "name": "small", "default": True,
                                      "settings": {"context_size": 384, "parallel": 2}}).status_code == 200

    # A load that names no preset gets the default one; its own extra_args win on the same flag.
    r = load(client, operator.key, {"model_path": path, "model_name": "p1", "backend": "llama-server",
                                    "extra_args": {"--parallel": 3}})
    assert r.status_code == 202, r.content
    inst = client.get(f"/api/management/instances/{r.json()['id']}", **bearer(operator.key)).json()
    assert inst["preset"] == {"name": "small", "settings": {"context_size": 384, "parallel": 2}}
    assert inst["extra_args"] == {"--parallel": 3}  # the load's own, as given
    argv = inst["command"]
    assert argv[argv.index("--ctx-size") + 1] == "384" and argv[argv.index("--parallel") + 1] == "3"
    assert argv.count("--parallel") == 1
    # A preset named; "none"; one the model lacks (404); one the chosen engine cannot take (400).
    r = load(client, operator.key, {"model_path": path, "model_name": "p2", "backend": "llama-server",
                                    "preset": "one"})
    assert r.status_code == 202
    argv = client.get(f"/api/management/instances/{r.json()['id']}", **bearer(operator.key)).json()["command"]
    assert argv[argv.index("--ctx-size") + 1] == "2048"  # not the default preset's 384: the model's own
    r = load(client, operator.key, {"model_path": path, "model_name": "p3", "backend": "llama-server",
                                    "preset": "none"})
    assert r.status_code == 202 and client.get(f"/api/management/instances/{r.json()['id']}",
                                               **bearer(operator.key)).json()["preset"] is None
    r = load(client, operator.key, {"model_path": path, "model_name": "p4", "preset": "huge"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "preset_not_found", r.content
    assert "its presets: one, small" in r.json()["error"]["message"]
    r = load(client, operator.key, {"model_path": path, "model_name": "p5", "backend": "llama-cpp-python"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_preset", r.content
    assert "preset 'small'" in r.json()["error"]["message"] and "llama-cpp-python" in r.json()["error"]["message"]

    # Deleting it leaves the instances loaded with it as they were.
    r = client.delete(f"/api/management/presets?model_path={path}&name=small", **bearer(operator.key))
    assert r.status_code == 204
    r = client.delete(f"/api/management/presets?model_path={path}&name=small", **bearer(operator.key))
    assert r.status_code == 404 and r.json()["error"]["code"] == "preset_not_found"
    from serving.models import ModelInstance

    assert ModelInstance.objects.get(model_name="p1").preset["name"] == "small"
    from accounts.models import AuditEvent

    actions = list(AuditEvent.objects.filter(action__startswith="preset").values_list("action", "outcome"))
    assert ("preset", "success") in actions and ("preset", "refused") in actions
    assert ("preset_delete", "success") in actions


@pytest.mark.django_db
def test_a_preset_no_node_can_check_is_stored_unchecked(client, node, operator, tiny_gguf):
    set_backends(node.name, [LLAMA_CPP_PYTHON])
    r = put(client, operator.key, {"model_path": "huggingface/org/model", "name": "tools",
                                   "settings": {"tool_call_parser": "hermes", "context_size": 32768}})
    assert r.status_code == 201 and r.json()["engines"] == [], r.content
    assert presets.find("huggingface/org/model/", None) is None  # not the default
    assert presets.find("huggingface/org/model", "tools").engine_settings["tool_call_parser"] == "hermes"


@pytest.mark.django_db
def test_the_load_dialog_offers_the_models_presets(node, operator, tiny_gguf):
    from django.test import Client

    from serving.models import ModelInstance

    set_backends(node.name, node_backends())
    presets.save(model_path=str(tiny_gguf), name="small", settings={"context_size": 384}, default=True)
    presets.save(model_path=str(tiny_gguf), name="tools", settings={"tool_call_parser": "auto"}, default=False)
    web = Client()
    web.force_login(operator.user)
    page = web.get(f"/instances/new/?model_path={tiny_gguf}").content.decode()
    assert 'name="preset"' in page and ">small (default)<" in page and ">tools<" in page
    verdict = web.get("/instances/new/verdict", {"model_path": str(tiny_gguf), "backend": "llama-server",
                                                 "node": node.name, "preset": "tools"}).content.decode()
    assert "--jinja" in verdict and "--ctx-size 384" not in verdict and "--ctx-size 2048" in verdict
    r = web.post("/instances/new/", {"model_path": str(tiny_gguf), "model_name": "d1", "backend": "llama-server",
                                     "server_type": "llm", "node": node.name, "policy": "always", "preset": "tools"})
    assert r.status_code == 302, r.content.decode()[:2000]
    assert ModelInstance.objects.get(model_name="d1").preset["name"] == "tools"
    r = web.post("/instances/new/", {"model_path": str(tiny_gguf), "model_name": "d2", "backend": "llama-cpp-python",
                                     "server_type": "llm", "node": node.name, "policy": "always", "preset": "tools"})
    assert r.status_code == 400 and "cannot be applied to llama-cpp-python" in r.content.decode()


# ---------------------------------------------------------------- end to end, the real llama-server
@pytest.fixture(scope="module")
def pc(tmp_path_factory) -> Iterator[KeyedConsole]:
    yield from keyed_console(tmp_path_factory.mktemp("presets"))


@pytest.mark.slow  # a real llama-server
def test_the_engine_runs_with_the_default_preset(pc, tiny_gguf):
    r = httpx.put(f"{pc.url}/api/management/presets", headers=pc.auth, timeout=30, json={
        "model_path": str(tiny_gguf), "name": "two-slots", "default": True,
        "settings": {"context_size": 384, "parallel": 2, "flash_attention": True, "kv_cache_type": "bf16"}})
    assert r.status_code == 201, r.text
    r = httpx.post(f"{pc.url}/api/management/load", headers=pc.auth, timeout=30,
                   json={"model_path": str(tiny_gguf), "model_name": "tp"})
    assert r.status_code == 202 and r.json()["backend"] == "llama-server", r.text
    pk = r.json()["id"]
    inst = wait_api(f"{pc.url}/api/management/instances/{pk}", pc.key, lambda b: b["state"] in ("READY", "ERROR"),
                    timeout=120)
    assert inst["state"] == "READY", inst
    argv = inst["command"]
    for flag, value in (("--ctx-size", "384"), ("--parallel", "2"), ("--flash-attn", "on"),
                        ("--cache-type-k", "bf16"), ("--cache-type-v", "bf16")):
        assert argv[argv.index(flag) + 1] == value, argv
    code = ("from serving.node.logs import current_log; "
            f"print(current_log({pk}).read_text(errors='replace'))")
    log = pc.console.manage("shell", "-v", "0", "-c", code).stdout
    assert "n_slots = 2" in log, log[-3000:]  # llama-server's own account of the slots it made
    chat = httpx.post(f"{pc.url}/v1/chat/completions", headers=pc.auth, timeout=60, json={
        "model": "tp", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert chat.status_code == 200, chat.text
    httpx.post(f"{pc.url}/api/management/unload", headers=pc.auth, json={"id": pk}, timeout=10)
    wait_api(f"{pc.url}/api/management/instances/{pk}", pc.key, lambda b: b["state"] == "STOPPED", timeout=60)


@pytest.mark.slow  # a real llama-server
def test_a_chat_model_gets_sixteen_slots_over_the_whole_context_by_default(pc, tiny_gguf):
    """Issue 28 #2: with no preset and no --parallel, llama-server runs DEFAULT_SLOTS slots over
    one unified KV cache, so each slot still takes the model's whole context (2,048 for the tiny
    model), and the verdict says why."""
    r = httpx.post(f"{pc.url}/api/management/load", headers=pc.auth, timeout=30,
                   json={"model_path": str(tiny_gguf), "model_name": "slots16", "preset": "none"})
    assert r.status_code == 202 and r.json()["backend"] == "llama-server", r.text
    pk = r.json()["id"]
    inst = wait_api(f"{pc.url}/api/management/instances/{pk}", pc.key, lambda b: b["state"] in ("READY", "ERROR"),
                    timeout=120)
    assert inst["state"] == "READY", inst
    argv = inst["command"]
    assert argv[argv.index("--parallel") + 1] == "16" and "--kv-unified" in argv, argv
    assert "16 slots sharing one KV cache" in inst["backend_reason"], inst["backend_reason"]
    code = ("from serving.node.logs import current_log; "
            f"print(current_log({pk}).read_text(errors='replace'))")
    log = pc.console.manage("shell", "-v", "0", "-c", code).stdout
    # llama-server's own account: every slot takes the whole 2,048 (not 2,048 / 16)
    assert "n_slots = 16, n_ctx_slot = 2048, kv_unified = 'true'" in log, log[-3000:]
    chats = [httpx.post(f"{pc.url}/v1/chat/completions", headers=pc.auth, timeout=60, json={
        "model": "slots16", "messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": 2}) for i in range(2)]
    assert [c.status_code for c in chats] == [200, 200], [c.text for c in chats]
    httpx.post(f"{pc.url}/api/management/unload", headers=pc.auth, json={"id": pk}, timeout=10)
    wait_api(f"{pc.url}/api/management/instances/{pk}", pc.key, lambda b: b["state"] == "STOPPED", timeout=60)
