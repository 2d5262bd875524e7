"""manage.py hub_upload PATH --format gguf|huggingface --name NAME [--replace]

Whoever runs this command already has a shell on the host as the console's user, so it is not
limited to XGEN_IMPORT_DIRS (which bounds what the API and the Upload page may read). Every other
rule of `hub.imports.check_import_path` still holds: it refuses the console's own data, store,
models and log dirs and its database (a copy would publish the secret key and the sessions, and
opening the live database drops the server's SQLite locks), and FIFOs, sockets and devices.

It runs the upload itself, in the foreground (no job, no agent), through the same service as an
upload job (`hub.writes.upload_local_model`), holding the model's write lock meanwhile: it
stops when an upload or download writes the same name, and refuses to overwrite a complete model
without --replace.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError

from hub import writes
from hub.imports import HubInputError
from hub.locks import PrefixBusy, prefix_locked, process_holder
from hub.paths import FORMAT_ROOTS, InvalidPrefix, prefix_for
from hub.store import ModelExists, StoreError, get_store


class Command(BaseCommand):
    help = ("Upload a local GGUF file or model folder into the model store (manifest last) and index it. "
            "Any path on this host except the console's own data, store, models and log dirs "
            "(not limited to XGEN_IMPORT_DIRS).")
    # Django's system checks import every URLconf and the whole web API, which this command never
    # serves (1.4 s a start); `manage.py check` and `manage.py serve` still run them.
    requires_system_checks: list[str] = []

    def add_arguments(self, parser) -> None:
        parser.add_argument("path", help="a .gguf file, or a folder (Hugging Face layout or GGUF files)")
        parser.add_argument("--format", required=True, choices=FORMAT_ROOTS)
        parser.add_argument("--name", required=True, help="the model's name in the store: <format>/<name>")
        parser.add_argument("--replace", action="store_true",
                            help="overwrite a complete model of that name (it is not loadable until the new one is in)")

    def handle(self, *args, **opts) -> None:
        store = get_store()
        last = [0.0]

        def progress(done: int, total: int) -> None:
            now = time.monotonic()
            if now - last[0] >= 0.5 or done == total:
                last[0] = now
                pct = 100.0 * done / total if total else 100.0
                sys.stderr.write(f"\r{done / 2**20:,.1f} / {total / 2**20:,.1f} MiB ({pct:5.1f} %)")
                sys.stderr.flush()

        try:
            prefix = prefix_for(opts["format"], opts["name"])
            with prefix_locked(prefix, holder=process_holder("cli")):
                artifact = writes.upload_local_model(
                    local_path=str(Path(opts["path"]).resolve()), format=opts["format"], name=opts["name"],
                    store=store, progress=progress, limit_to_import_dirs=False, replace=opts["replace"])
        except (InvalidPrefix, HubInputError) as exc:
            raise CommandError(str(exc)) from None
        except ModelExists as exc:
            raise CommandError(f"{exc} (--replace overwrites it)") from None
        except PrefixBusy as exc:
            raise CommandError(str(exc)) from None
        except StoreError as exc:
            raise CommandError(f"the store failed: {exc}") from None
        sys.stderr.write("\n")
        self.stdout.write(f"{artifact.prefix}: {artifact.file_count} files, {artifact.size_bytes} bytes "
                          f"in {store.describe()}")
