"""Property tests (Hypothesis) for the validators that stand between user input and the disk."""
from __future__ import annotations

import os
from pathlib import Path

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from hub.paths import InvalidPrefix, name_from_repo_id, safe_join, validate_name, validate_prefix

# Path-ish text: heavy on the characters that make traversal, plus anything at all.
path_chars = st.sampled_from(list("./\\~:%\x00\n\t ") + ["..", "gguf", "huggingface", "a", "é", "\u202e"])
path_like = st.one_of(st.lists(path_chars, max_size=12).map("".join), st.text(max_size=60))


@settings(max_examples=1500, deadline=None, suppress_health_check=list(HealthCheck))
@given(raw=path_like)
@example(raw="gguf/../../etc/passwd")
@example(raw="gguf/a/../../../x")
@example(raw="/etc/passwd")
@example(raw="gguf/a\\..\\..\\x")
@example(raw="gguf//a")
@example(raw="gguf/a\x00b")
def test_a_valid_prefix_never_leaves_the_root(raw, tmp_path_factory):
    root = tmp_path_factory.getbasetemp() / "cache-root"
    try:
        prefix = validate_prefix(raw)
    except InvalidPrefix:
        return
    assert prefix.split("/", 1)[0] in ("gguf", "huggingface")
    assert ".." not in prefix.split("/") and "\\" not in prefix and "\x00" not in prefix
    target = safe_join(root, prefix)
    assert os.path.commonpath([target, root.resolve()]) == str(root.resolve())


@settings(max_examples=500, deadline=None)
@given(raw=path_like)
def test_safe_join_refuses_or_stays_inside(raw, tmp_path_factory):
    root = Path(tmp_path_factory.getbasetemp()) / "join-root"
    try:
        target = safe_join(root, raw)
    except InvalidPrefix:
        return
    assert target == root.resolve() or root.resolve() in target.parents


@settings(max_examples=1000, deadline=None)
@given(repo_id=st.text(max_size=120))
def test_any_repo_id_maps_to_one_safe_segment_or_is_refused(repo_id):
    try:
        name = name_from_repo_id(repo_id)
    except InvalidPrefix:
        return
    assert validate_name(name) == name
    assert "/" not in name and name not in (".", "..") and ".." not in name
    assert validate_prefix(f"gguf/{name}") == f"gguf/{name}"
