"""Run one claimed download job in its own process, as a node agent does (tests kill it with SIGKILL).

Usage: python -m tests.hub.download_child JOB_ID STORE_DIR
"""
import asyncio
import os
import sys

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "xgenconsole.settings")

import django  # noqa: E402

django.setup()

from hub.downloads import run_download_job  # noqa: E402
from hub.store import FilesystemModelStore  # noqa: E402


def main() -> None:
    job_id, store_dir = int(sys.argv[1]), sys.argv[2]
    print("started", flush=True)
    job = asyncio.run(run_download_job(job_id, node_name="n1", store=FilesystemModelStore(store_dir)))
    print(f"done {job.status}", flush=True)


if __name__ == "__main__":
    main()
