"""The Downloads page's websocket: job rows arrive as out-of-band fragments, anonymous refused."""
import pytest
from asgiref.sync import sync_to_async
from channels.routing import URLRouter
from channels.testing import WebsocketCommunicator
from django.contrib.auth.models import AnonymousUser

from hub.consumers import DownloadsConsumer
from hub.events import publish_job
from hub.jobs import download as download_jobs
from hub.jobs import upload as upload_jobs
from hub.routing import websocket_urlpatterns

pytestmark = pytest.mark.django_db(transaction=True)


async def test_job_rows_reach_viewers(viewer):
    comm = WebsocketCommunicator(DownloadsConsumer.as_asgi(), "/ws/downloads/")
    comm.scope["user"] = viewer.user
    connected, _ = await comm.connect()
    assert connected
    job = await sync_to_async(download_jobs.create_download_job)(repo_id="acme/ws", format="gguf")
    job = await sync_to_async(download_jobs.update_job)(job.pk, bytes_done=50, bytes_total=200)
    await publish_job(job)
    html = await comm.receive_from(timeout=3)
    assert f'id="job-{job.pk}"' in html and 'hx-swap-oob="true"' in html
    assert 'aria-valuenow="25"' in html and "acme/ws" in html
    await comm.disconnect()


async def test_anonymous_is_refused():
    comm = WebsocketCommunicator(DownloadsConsumer.as_asgi(), "/ws/downloads/")
    comm.scope["user"] = AnonymousUser()
    connected, _ = await comm.connect()
    assert not connected


async def test_upload_progress_reaches_the_upload_page(viewer, hub_dirs, tmp_path):
    from hub.consumers import UploadsConsumer
    from hub.uploads import run_upload_job

    big = tmp_path / "m.gguf"
    big.write_bytes(b"g" * (3 * 2**20))
    comm = WebsocketCommunicator(UploadsConsumer.as_asgi(), "/ws/uploads/")
    comm.scope["user"] = viewer.user
    assert (await comm.connect())[0]
    # The request creates the job (any web process); the node agent runs it and publishes its row.
    job = await sync_to_async(upload_jobs.create_upload_job)(local_path=str(big), format="gguf", name="ws-up")
    claimed = await sync_to_async(upload_jobs.claim_next_upload)(node_name=job.node)
    assert claimed.pk == job.pk
    done = await run_upload_job(job.pk)
    assert done.status == "COMPLETED"
    seen = ""
    for _ in range(20):
        seen += await comm.receive_from(timeout=5)
        if 'data-status="COMPLETED"' in seen:
            break
    assert f'id="upload-{job.pk}"' in seen and 'data-status="COMPLETED"' in seen
    assert 'aria-valuenow="100"' in seen and "gguf/ws-up" in seen
    await comm.disconnect()


async def test_a_cache_jobs_row_reaches_its_nodes_cache_card(viewer, hub_dirs, tmp_path):
    """Issue 24 #4: an Evict's row is live as a download's: the node agent publishes it RUNNING and at its end."""
    from django.utils import timezone

    from hardware.models import Node
    from hub import node_cache
    from hub.cache import cache_dir_for, sync_to_cache
    from hub.store import FilesystemModelStore
    from hub.worker import HubWorker
    from tests.hub.conftest import make_model_dir

    store = FilesystemModelStore(hub_dirs / "store")
    await sync_to_async(store.upload_model)("gguf/live", make_model_dir(tmp_path / "m", {"m.gguf": b"g" * 1000}))
    node = await sync_to_async(Node.objects.create)(name="ws-node", address="127.0.0.1", last_heartbeat=timezone.now())
    await sync_to_async(sync_to_cache)("gguf/live", node_name="ws-node", store=store)
    app = URLRouter(websocket_urlpatterns)
    comm = WebsocketCommunicator(app, "/ws/nodes/ws-node/cache/")
    comm.scope["user"] = viewer.user
    assert (await comm.connect())[0]
    other = WebsocketCommunicator(app, "/ws/nodes/other-node/cache/")
    other.scope["user"] = viewer.user
    assert (await other.connect())[0]

    await sync_to_async(node_cache.request_cache_job)(node=node, prefix="gguf/live", action="evict")
    job = await sync_to_async(node_cache.claim_next_cache_job)(node_name="ws-node")
    await HubWorker._run_cache_job(job)
    seen = ""
    for _ in range(20):
        seen += await comm.receive_from(timeout=5)
        if 'data-status="COMPLETED"' in seen:
            break
    assert f'id="cache-job-{job.number}"' in seen and 'hx-swap-oob="true"' in seen
    assert 'data-status="RUNNING"' in seen and 'data-status="COMPLETED"' in seen and "gguf/live" in seen
    assert f"/nodes/ws-node/cache/jobs/{job.number}/cancel/" in seen  # its Cancel button while it ran
    assert not cache_dir_for("gguf/live").exists()
    assert await other.receive_nothing(timeout=0.5)  # another node's card hears nothing of it
    await comm.disconnect()
    await other.disconnect()
