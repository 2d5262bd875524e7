"""Run one cache sync in its own process (tests kill it half-way). Prints progress lines.

Usage: python -m tests.hub.sync_child PREFIX SLEEP_PER_CHUNK
"""
import os
import sys
import time

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "xgenconsole.settings")

import django  # noqa: E402

django.setup()

from hub.cache import sync_to_cache  # noqa: E402


def main() -> None:
    prefix, delay = sys.argv[1], float(sys.argv[2])

    def progress(done: int, total: int) -> None:
        print(f"progress {done} {total}", flush=True)
        time.sleep(delay)

    path = sync_to_cache(prefix, node_name="child-node", progress=progress)
    print(f"done {path}", flush=True)


if __name__ == "__main__":
    main()
