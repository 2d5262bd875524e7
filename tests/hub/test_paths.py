from pathlib import Path

import pytest

from hub.paths import InvalidPrefix, name_from_repo_id, safe_join, validate_name, validate_prefix

BAD = [
    "", "gguf", "gguf/", "../etc", "gguf/../../etc/passwd", "gguf/a/../../b", "/gguf/x", "gguf//x",
    "gguf\\x", "gguf/x\x00y", "gguf/x\ny", "models/x", "gguf/./x", "~/gguf/x", "huggingface/..",
    "lora", "lora/", "lora/../gguf/x", "loras/x",
]


@pytest.mark.parametrize("prefix", BAD)
def test_it_refuses_bad_prefixes(prefix):
    with pytest.raises(InvalidPrefix):
        validate_prefix(prefix)


def test_it_normalises_good_prefixes():
    assert validate_prefix("gguf/Qwen_Qwen3-4B/") == "gguf/Qwen_Qwen3-4B"
    assert validate_prefix("huggingface/m/sub/file.bin") == "huggingface/m/sub/file.bin"
    assert validate_prefix("lora/pirate/") == "lora/pirate"  # LoRA adapters (issue 27)


def test_repo_ids_become_one_safe_segment():
    assert name_from_repo_id("Qwen/Qwen3-4B") == "Qwen_Qwen3-4B"
    assert name_from_repo_id("../../etc") == "etc"
    assert "/" not in name_from_repo_id("a/b/c")


@pytest.mark.parametrize("name", ["", "..", "a/b", "a\\b", "../x", ".hidden", "x" * 300, "a b"])
def test_it_refuses_bad_names(name):
    with pytest.raises(InvalidPrefix):
        validate_name(name)


def test_safe_join_never_escapes(tmp_path: Path):
    root = tmp_path / "root"
    root.mkdir()
    (root / "gguf").mkdir()
    (root / "gguf" / "link").symlink_to(tmp_path)  # a symlink pointing out of the root
    assert safe_join(root, "gguf/m") == (root / "gguf" / "m").resolve()
    for bad in ("../x", "/etc/passwd", "gguf/../../x", "gguf/link/escaped"):
        with pytest.raises(InvalidPrefix):
            safe_join(root, bad)
