"""hub.layout: the one owner of what a model folder looks like (which files, which GGUF, which
folder is a Hugging Face model, how big the weights are)."""
from __future__ import annotations

from pathlib import Path

import pytest

from hub import layout
from tests.hub.conftest import make_model_dir


def test_model_files_leave_out_manifests_tool_folders_and_copies_in_progress(tmp_path):
    root = make_model_dir(tmp_path / "m", {
        "config.json": b"{}", "sub/w.safetensors": b"w", layout.MANIFEST_NAME: b"{}", layout.CACHE_MANIFEST_NAME: b"{}",
        ".cache/huggingface/x.json": b"", ".git/HEAD": b"", "a.gguf.part": b"", "b.xgen-part": b"", "c.incomplete": b"",
        "d.lock": b""})
    assert [rel for rel, _ in layout.model_files(root)] == ["config.json", "sub/w.safetensors"]
    assert not layout.is_model_file(".locks/x") and layout.is_model_file("sub/.hidden.json")


@pytest.mark.parametrize(("files", "chosen"), [
    ({"a-first.gguf": 10, "z-big.gguf": 99}, "z-big.gguf"),  # the largest, not the first by name
    ({"m-00002-of-00003.gguf": 90, "m-00001-of-00003.gguf": 50, "m-00003-of-00003.gguf": 90}, "m-00001-of-00003.gguf"),
    ({"mmproj-f16.gguf": 900, "model-q4.gguf": 300}, "model-q4.gguf"),  # never the vision projector ...
    ({"mmproj-f16.gguf": 900}, "mmproj-f16.gguf"),  # ... unless it is all there is
    ({"deep/x.gguf": 5, "x.gguf": 5}, "x.gguf"),  # a tie: the shallower
    ({"config.json": 2}, None),
])
def test_the_gguf_to_serve(tmp_path, files, chosen):
    assert layout.pick_gguf(files.items()) == chosen
    root = make_model_dir(tmp_path / "m", {rel: b"x" * size for rel, size in files.items()})
    found = layout.gguf_to_serve(root)
    assert (found.relative_to(root).as_posix() if found else None) == chosen
    if chosen:
        assert layout.gguf_to_serve(root / chosen) == root / chosen  # a file names itself


def test_hugging_face_folders_and_their_weights(tmp_path):
    top = make_model_dir(tmp_path / "top", {"config.json": b"{}", "a.safetensors": b"a" * 10,
                                            "b.safetensors": b"b" * 5, "tokenizer.json": b"t" * 100})
    assert layout.is_hf_folder(top) and layout.hf_root(top) == top
    assert layout.weights_bytes(top, layout.HUGGINGFACE) == 15
    nested = make_model_dir(tmp_path / "nested", {"snap/abc/config.json": b"{}", "snap/abc/pytorch_model.bin": b"p" * 7})
    assert not layout.is_hf_folder(nested) and layout.hf_root(nested) == nested / "snap/abc"
    assert layout.weights_bytes(nested, layout.HUGGINGFACE) == 7  # no safetensors: the .bin
    assert layout.hf_root(make_model_dir(tmp_path / "none", {"x.gguf": b"x"})) is None
    assert layout.format_of_local(top) == "huggingface" and layout.format_of_local(tmp_path / "none") == "gguf"
    assert layout.model_to_serve(top, "huggingface") == top


def test_a_split_gguf_weighs_all_its_shards(tmp_path):
    root = make_model_dir(tmp_path / "m", {"m-00001-of-00002.gguf": b"1" * 10, "m-00002-of-00002.gguf": b"2" * 20,
                                           "other.gguf": b"o" * 5})
    assert layout.weights_bytes(root, layout.GGUF) == 30
    assert layout.weights_bytes(root / "m-00001-of-00002.gguf", layout.GGUF) == 30
    assert layout.weights_bytes(root / "other.gguf", layout.GGUF) == 5
    assert layout.shard_set("other.gguf", ["other.gguf"]) == ["other.gguf"]


def test_layout_problem_says_why_a_source_is_no_model():
    assert layout.layout_problem("gguf", ["m.gguf"], is_dir=False, name="/x/m.gguf") is None
    assert "not a .gguf file" in layout.layout_problem("gguf", ["m.bin"], is_dir=False, name="/x/m.bin")
    assert "holds no .gguf file" in layout.layout_problem("gguf", ["a.txt"], is_dir=True, name="/x")
    assert layout.layout_problem("huggingface", ["snap/config.json"], is_dir=True, name="/x") is None
    assert "no config.json" in layout.layout_problem("huggingface", ["w.bin"], is_dir=True, name="/x")
    assert "Unknown format" in layout.layout_problem("onnx", [], is_dir=True, name="/x")


def test_a_lora_adapter_is_a_gguf_file_or_a_peft_folder(tmp_path):
    problem = layout.layout_problem
    assert problem("lora", [], is_dir=False, name="/x/a.gguf") is None
    assert problem("lora", ["a.gguf"], is_dir=True, name="/x") is None
    assert problem("lora", ["adapter_config.json", "adapter_model.safetensors"], is_dir=True, name="/x") is None
    assert "not a LoRA adapter" in problem("lora", [], is_dir=False, name="/x/a.bin")
    assert "no GGUF adapter and no adapter_config.json" in problem("lora", ["config.json"], is_dir=True, name="/x")
    assert "more than one .gguf" in problem("lora", ["a.gguf", "b.gguf"], is_dir=True, name="/x")
    assert layout.lora_base_format(["sub/a.gguf"]) == "gguf"
    assert layout.lora_base_format(["sub/adapter_config.json", "adapter_config.json"]) == "huggingface"
    assert layout.lora_base_format(["config.json"]) is None
    assert layout.peft_root_rel(["deep/x/adapter_config.json", "snap/adapter_config.json"]) == "snap"

    gguf = make_model_dir(tmp_path / "g", {"pirate.gguf": b"g" * 7, "README.md": b"r"})
    assert layout.model_to_serve(gguf, "lora") == gguf / "pirate.gguf"
    assert layout.weights_bytes(gguf, "lora") == 7
    peft = make_model_dir(tmp_path / "p", {"snap/adapter_config.json": b"{}", "snap/adapter_model.safetensors": b"w" * 9,
                                           "snap/tokenizer.json": b"t"})
    assert layout.model_to_serve(peft, "lora") == peft / "snap"
    assert layout.weights_bytes(peft, "lora") == 9
    assert layout.model_to_serve(make_model_dir(tmp_path / "n", {"x.txt": b"x"}), "lora") is None
    assert "lora" in layout.FORMATS and "lora" not in layout.MODEL_FORMATS


def test_the_node_cache_serves_what_the_layout_picks(tmp_path):
    from hub.cache import CacheError, resolve_model_path

    root = make_model_dir(tmp_path / "m", {"a-first.gguf": b"a", "z-big.gguf": b"z" * 10})
    assert resolve_model_path(root, "gguf") == layout.gguf_to_serve(root) == root / "z-big.gguf"
    assert resolve_model_path(root, "gguf", "a-first.gguf") == root / "a-first.gguf"
    with pytest.raises(CacheError, match="no config.json"):
        resolve_model_path(root, "huggingface")
    assert Path(layout.MANIFEST_NAME).name == ".xgen-manifest.json"  # the store's layout is unchanged
