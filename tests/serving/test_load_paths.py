"""A load from a local path follows the rules of uploads (issue 34 #9): under XGEN_IMPORT_DIRS,
symlinks resolved, never the console's own dirs or database, never a FIFO or device, never a file
that is not GGUF, and a folder walked only so far; refused with a 400 naming the reason, in the API,
the Load page and its verdict, and again by the node agent right before it spawns."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from asgiref.sync import sync_to_async

from serving.control.planning import LoadRefused
from tests.conftest import bearer
from tests.serving.conftest import NODE, wait_state

SECRET = b"XGEN-SECRET-do-not-leak-0123456789"


@pytest.fixture
def imports(serving_settings, tmp_path) -> Path:
    root = tmp_path / "imports"
    root.mkdir()
    serving_settings.IMPORT_DIRS = [root.resolve()]
    return root


@pytest.fixture
def secret_in_data_dir(serving_settings, imports) -> Path:
    """A secret in the console's data dir, with an import dir that covers the data dir too (as
    the test settings' temp dir does): the console's own dirs stay refused inside an import dir."""
    path = Path(serving_settings.DATA_DIR) / "secret.gguf"
    path.write_bytes(SECRET)
    serving_settings.IMPORT_DIRS = [imports.resolve(), Path(serving_settings.DATA_DIR).resolve().parent]
    yield path
    path.unlink(missing_ok=True)


def _load(client, key, model_path, **body):
    return client.post("/api/management/load", {"model_path": str(model_path), "model_name": "m", **body},
                       content_type="application/json", **bearer(key))


def _refused(resp, *words: str) -> str:
    assert resp.status_code == 400, resp.content
    error = resp.json()["error"]
    assert error["code"] == "invalid_path" and error["type"] == "invalid_request_error", error
    for word in words:
        assert word in error["message"], error["message"]
    assert SECRET.decode() not in error["message"]
    return error["message"]


@pytest.mark.django_db
def test_a_symlink_to_a_console_file_or_outside_the_import_dirs_is_refused(client, node, operator, imports,
                                                                           secret_in_data_dir, serving_settings):
    (imports / "key.gguf").symlink_to(secret_in_data_dir)
    _refused(_load(client, operator.key, imports / "key.gguf"), "inside the console's data dir")
    (imports / "shadow.gguf").symlink_to("/etc/shadow")
    _refused(_load(client, operator.key, imports / "shadow.gguf"), "not under XGEN_IMPORT_DIRS", "/etc/shadow")
    (imports / "db.gguf").symlink_to(serving_settings.DATABASES["default"]["TEST"]["NAME"])
    _refused(_load(client, operator.key, imports / "db.gguf"), "inside the console's")
    _refused(_load(client, operator.key, serving_settings.DATA_DIR), "data dir")
    (imports / "data").symlink_to(serving_settings.DATA_DIR)
    _refused(_load(client, operator.key, imports / "data"), "data dir")


@pytest.mark.django_db
def test_a_gguf_outside_the_import_dirs_is_refused(client, node, operator, imports, tiny_gguf, serving_settings):
    _refused(_load(client, operator.key, tiny_gguf), "not under XGEN_IMPORT_DIRS")
    serving_settings.IMPORT_DIRS = []
    _refused(_load(client, operator.key, tiny_gguf), "Loads from local paths are off", "XGEN_IMPORT_DIRS")
    serving_settings.IMPORT_DIRS = [tiny_gguf.parent.resolve()]
    resp = _load(client, operator.key, tiny_gguf)  # under an import dir: loads
    assert resp.status_code == 202, resp.content


@pytest.mark.django_db
def test_a_fifo_a_device_and_a_file_that_is_not_gguf_are_refused(client, node, operator, imports):
    os.mkfifo(imports / "pipe.gguf")
    _refused(_load(client, operator.key, imports / "pipe.gguf"), "FIFO")
    (imports / "dev.gguf").symlink_to("/dev/zero")
    _refused(_load(client, operator.key, imports / "dev.gguf"), "not under XGEN_IMPORT_DIRS")
    (imports / "notes.gguf").write_bytes(b"first bytes of some other file")
    _refused(_load(client, operator.key, imports / "notes.gguf"), "not a GGUF model file")
    folder = imports / "folder"
    folder.mkdir()
    (folder / "x.gguf").write_bytes(b"#!/bin/sh")
    _refused(_load(client, operator.key, folder), "not a GGUF model file")


@pytest.mark.django_db
def test_a_huge_folder_is_refused_without_walking_it(client, node, operator, imports, tiny_gguf):
    from hub.imports import LOAD_SCAN_MAX_ENTRIES

    big = imports / "big"
    big.mkdir()
    for i in range(LOAD_SCAN_MAX_ENTRIES + 10):
        (big / f"f{i:05d}.txt").touch()
    shutil.copy(tiny_gguf, big / "zz.gguf")
    _refused(_load(client, operator.key, big), f"more than {LOAD_SCAN_MAX_ENTRIES} files and folders",
             "name the model's own folder or its .gguf file")


@pytest.mark.django_db
def test_a_model_folder_under_an_import_dir_loads_its_gguf(client, node, operator, imports, tiny_gguf):
    from serving.models import ModelInstance

    folder = imports / "model"
    folder.mkdir()
    shutil.copy(tiny_gguf, folder / "tiny.gguf")
    (folder / "README.md").write_text("hello")
    resp = _load(client, operator.key, folder)
    assert resp.status_code == 202, resp.content
    assert ModelInstance.objects.get(pk=resp.json()["id"]).model_path == str(folder)


@pytest.mark.django_db
def test_the_load_page_and_its_verdict_say_why(client, node, operator, imports, secret_in_data_dir):
    (imports / "key.gguf").symlink_to(secret_in_data_dir)
    client.force_login(operator.user)
    verdict = client.get("/instances/new/verdict", {"model_path": str(imports / "key.gguf")}).content.decode()
    assert "inside the console&#x27;s data dir" in verdict and SECRET.decode() not in verdict
    page = client.post("/instances/new/", {"model_path": str(imports / "key.gguf"), "model_name": "m",
                                          "server_type": "llm", "backend": "auto", "policy": "always"})
    assert page.status_code == 400 and "inside the console&#x27;s data dir" in page.content.decode()


@pytest.mark.django_db
def test_planning_refuses_with_load_refused(node, imports, secret_in_data_dir):
    from serving.control.planning import plan_load

    (imports / "key.gguf").symlink_to(secret_in_data_dir)
    with pytest.raises(LoadRefused) as refused:
        plan_load(model_path=str(imports / "key.gguf"))
    assert refused.value.status == 400 and refused.value.code == "invalid_path"


async def test_the_agent_checks_again_before_it_spawns(agent, serving_settings, imports, secret_in_data_dir):
    """A web process on another host checks only the path's text; the node's agent refuses the file
    (and the secret never reaches the instance's error or log)."""
    from serving.control.services import request_load

    (imports / "key.gguf").symlink_to(secret_in_data_dir)
    serving_settings.NODE_NAME = "web-elsewhere"
    inst = await sync_to_async(request_load)(model_path=str(imports / "key.gguf"), model_name="swap", node=NODE)
    serving_settings.NODE_NAME = NODE
    done = await wait_state(inst.pk, {"ERROR", "READY"}, timeout=60)
    assert done.state == "ERROR" and done.pid is None
    assert "inside the console's data dir" in done.last_error and f"node {NODE}" in done.last_error
    assert SECRET.decode() not in done.last_error + "".join(done.log_tail or [])


@pytest.mark.django_db
def test_a_secret_read_from_a_file_is_refused_wherever_it_is(client, node, operator, imports, monkeypatch):
    secret = imports / "db-url.gguf"  # e.g. a Docker secret mounted where models are
    secret.write_bytes(SECRET)
    monkeypatch.setenv("DATABASE_URL_FILE", str(secret))
    _refused(_load(client, operator.key, secret), "secret file (DATABASE_URL_FILE)")
    (imports / "link.gguf").symlink_to(secret)
    _refused(_load(client, operator.key, imports / "link.gguf"), "secret file (DATABASE_URL_FILE)")
