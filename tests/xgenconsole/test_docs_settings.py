"""The docs' environment variables against the code's (issue 35, the docs).

Documented: every XGEN_*, MINIO_*, DATABASE_URL and REDIS_URL name in README.md, deploy/README.md
and the deploy examples (systemd units, the env file, the Dockerfiles, the Kubernetes manifests). Read: the names the
code reads, found in its source: the literal first argument of xgenconsole.env's readers, of
os.environ.get / os.getenv / os.environ[...], NAME_FILE for each secret (env_secret), and the
`$NAME` / `${NAME...}` expansions in deploy/*.sh. Each documented name must be read, each name the
product reads must be documented (test-only names, read under tests/, only count as read), each
secret's row in the configuration table must say *file*, and no name may have two rows there.
"""
from __future__ import annotations

import ast
import functools
import os
import re
from pathlib import Path

import pytest

from tests.conftest import REPO

NAME = r"(?:XGEN|MINIO)_[A-Z0-9_]*[A-Z0-9]|DATABASE_URL(?:_FILE)?|REDIS_URL(?:_FILE)?"
NAME_RE = re.compile(rf"(?<![A-Za-z0-9_])(?:{NAME})(?![A-Za-z0-9_])")
SHELL_READ_RE = re.compile(rf"\$\{{?({NAME})(?![A-Za-z0-9_])")
ENV_READERS = {"env_str", "env_int", "env_bool", "env_list", "env_dirs", "env_secret"}

DOC_FILES = ["README.md", "deploy/README.md", "deploy/systemd/xgen-web.service", "deploy/systemd/xgen-agent.service",
             "deploy/systemd/xgen.env.example",
             *sorted(str(p.relative_to(REPO)) for p in (REPO / "deploy").glob("Dockerfile*")),
             *sorted(str(p.relative_to(REPO)) for p in (REPO / "deploy" / "kubernetes").rglob("*.yaml"))]
# The settings the manifests and images set are also held against the configuration table itself:
# tests/deploy/test_settings_and_probes.py.
# Read by the product but not for its users: each with the reason it stays out of the docs.
UNDOCUMENTED_OK: dict[str, str] = {}
# Read with env_secret (NAME or the file NAME_FILE names): their rows must say *file*.
SECRETS = {"DATABASE_URL", "REDIS_URL", "XGEN_SECRET_KEY", "MINIO_ACCESS_KEY", "MINIO_SECRET_KEY",
           "XGEN_OIDC_CLIENT_SECRET", "XGEN_LDAP_BIND_PASSWORD"}
SKIP_DIRS = {".venv", ".git", "node_modules", "tests", "bench", "data", "__pycache__"}


def _source_files() -> list[Path]:
    out = []
    for folder, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.startswith(".")]  # never walk the venv
        out += [Path(folder) / f for f in files if f.endswith(".py")]
    return out


def _is_os_environ(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "environ" and isinstance(node.value, ast.Name) \
        and node.value.id == "os"


def python_reads(path: Path) -> tuple[set[str], set[str]]:
    """(names read, names read as secrets) by one Python file."""
    reads: set[str] = set()
    secrets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        name = None
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            func = node.func
            if isinstance(func, ast.Name) and func.id in ENV_READERS:
                name = node.args[0].value
                if func.id == "env_secret":
                    secrets.add(name)
            elif isinstance(func, ast.Attribute) and func.attr == "get" and _is_os_environ(func.value):
                name = node.args[0].value
            elif isinstance(func, ast.Attribute) and func.attr == "getenv" and isinstance(func.value, ast.Name) \
                    and func.value.id == "os":
                name = node.args[0].value
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _is_os_environ(node.value) \
                and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
            name = node.slice.value
        if name and NAME_RE.fullmatch(name):
            reads.add(name)
    return reads, secrets


@functools.cache
def product_reads() -> tuple[frozenset[str], frozenset[str]]:
    reads: set[str] = set()
    secrets: set[str] = set()
    for path in _source_files():
        r, s = python_reads(path)
        reads |= r
        secrets |= s
    reads |= {f"{name}_FILE" for name in secrets}
    for script in (REPO / "deploy").glob("*.sh"):
        reads |= set(SHELL_READ_RE.findall(script.read_text()))
    return frozenset(reads), frozenset(secrets)


@functools.cache
def harness_reads() -> set[str]:
    """Names only tests read (the test harness's own settings)."""
    reads: set[str] = set()
    for path in (REPO / "tests").rglob("*.py"):
        reads |= python_reads(path)[0]
    return reads


def documented() -> dict[str, list[str]]:
    """Name -> the doc files that mention it."""
    found: dict[str, list[str]] = {}
    for rel in DOC_FILES:
        for name in set(NAME_RE.findall((REPO / rel).read_text())):
            found.setdefault(name, []).append(rel)
    return found


def config_table() -> list[tuple[list[str], str]]:
    """The README's configuration table: (names in the first cell, the first cell) per row."""
    text = (REPO / "README.md").read_text()
    section = text.split("\n## Configuration\n", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        if line.startswith("| `"):
            first = line.split("|")[1]
            rows.append((NAME_RE.findall(first), first))
    return rows


def test_the_reader_finds_what_settings_reads():
    # The scan itself: names read in each way it knows, so an empty set cannot pass unnoticed.
    reads, secrets = product_reads()
    assert {"XGEN_DATA_DIR", "XGEN_NODE_STALE_AFTER", "MINIO_SECURE", "XGEN_DEMO_MODEL"} <= reads  # env_*
    assert {"DATABASE_URL", "REDIS_URL", "XGEN_SECRET_KEY", "MINIO_SECRET_KEY"} <= secrets
    assert {"DATABASE_URL_FILE", "XGEN_SECRET_KEY_FILE"} <= reads  # NAME_FILE of a secret
    assert "XGEN_ADMIN_PASSWORD" in reads  # os.environ.get in accounts' ensureadmin
    assert "XGEN_BUILD_JOBS" in reads  # ${XGEN_BUILD_JOBS:-...} in deploy/build_llama_cpp.sh
    assert "XGEN_TEST_PG" in harness_reads() and "XGEN_TEST_PG" not in reads


def test_every_documented_name_is_read():
    reads = product_reads()[0] | harness_reads()
    unread = {name: files for name, files in documented().items() if name not in reads}
    assert not unread, f"documented but read nowhere (a typo, or a setting that is gone): {unread}"


def test_every_name_the_product_reads_is_documented():
    docs = documented()
    reads, secrets = product_reads()
    # A secret's NAME_FILE is documented by its row's *file* (test_each_secret_row_says_it_takes_a_file).
    required = reads - {f"{name}_FILE" for name in secrets}
    missing = sorted(name for name in required if name not in docs and name not in UNDOCUMENTED_OK)
    assert not missing, f"read by the code but in no doc ({', '.join(DOC_FILES[:2])}): {missing}"
    stale = sorted(name for name in UNDOCUMENTED_OK if name not in reads or name in docs)
    assert not stale, f"allowlisted, but no longer read or now documented: {stale}"


def test_the_configuration_table_has_one_row_per_name():
    seen: dict[str, int] = {}
    for names, _ in config_table():
        for name in names:
            seen[name] = seen.get(name, 0) + 1
    twice = {name: n for name, n in seen.items() if n > 1}
    assert not twice, f"names with more than one row in the README's configuration table: {twice}"
    assert len(seen) > 40


@pytest.mark.parametrize("name", sorted(SECRETS))
def test_each_secret_row_says_it_takes_a_file(name):
    assert name in product_reads()[1], f"{name} is not read with env_secret: fix this list"
    rows = [first for names, first in config_table() if name in names]
    assert len(rows) == 1, f"{name}: {len(rows)} rows in the configuration table"
    assert "(*file*)" in rows[0], f"{name} is read with env_secret (NAME_FILE works) but its row lacks (*file*)"


def test_every_secret_is_in_the_list_above():
    assert product_reads()[1] == SECRETS
