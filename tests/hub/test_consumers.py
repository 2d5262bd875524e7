"""The Downloads page's websocket: job rows arrive as out-of-band fragments, anonymous refused."""
import pytest
from asgiref.sync import sync_to_async
from channels.testing import WebsocketCommunicator
from django.contrib.auth.models import AnonymousUser

from hub import services
from hub.consumers import DownloadsConsumer
from hub.events import publish_job

pytestmark = pytest.mark.django_db(transaction=True)


async def test_job_rows_reach_viewers(viewer):
    comm = WebsocketCommunicator(DownloadsConsumer.as_asgi(), "/ws/downloads/")
    comm.scope["user"] = viewer.user
    connected, _ = await comm.connect()
    assert connected
    job = await sync_to_async(services.create_download_job)(repo_id="acme/ws", format="gguf")
    job = await sync_to_async(services.update_job)(job.pk, bytes_done=50, bytes_total=200)
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
    job = await sync_to_async(services.create_upload_job)(local_path=str(big), format="gguf", name="ws-up")
    claimed = await sync_to_async(services.claim_next_upload)(node_name=job.node)
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
