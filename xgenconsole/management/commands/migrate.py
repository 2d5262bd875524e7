"""`manage.py migrate`, one at a time per PostgreSQL database.

Django's migrate takes no lock: two started together on a fresh database both create the same
tables and one fails ("relation ... already exists": 3 of 3 tries, two at once). Every
web start migrates (the systemd unit's ExecStartPre, the Deployment's init container), so hosts
starting together would. This command holds a PostgreSQL advisory lock around Django's own
migrate: the others wait, then find nothing to apply. SQLite (one host, embedded mode) takes none.
"""
from __future__ import annotations

import sys

from django.core.management.commands.migrate import Command as DjangoMigrate
from django.db import connections

# The advisory lock's key (advisory locks are per database): b"xgenmigr" as a bigint.
MIGRATE_LOCK_KEY = int.from_bytes(b"xgenmigr", "big")


class Command(DjangoMigrate):
    help = DjangoMigrate.help + " Holds a PostgreSQL advisory lock, so several started together run one at a time."

    def handle(self, *args, **options):
        alias = options["database"]
        conn = connections[alias]
        if conn.vendor != "postgresql":
            return super().handle(*args, **options)
        # A connection of its own: migrate may close or reset its connection; the lock must outlive that.
        lock = type(conn)(conn.settings_dict, alias=alias)
        try:
            with lock.cursor() as cur:
                cur.execute("SELECT pg_try_advisory_lock(%s)", [MIGRATE_LOCK_KEY])
                if not cur.fetchone()[0]:
                    sys.stderr.write("migrate: another migrate holds the lock on this database; waiting for it\n")
                    cur.execute("SELECT pg_advisory_lock(%s)", [MIGRATE_LOCK_KEY])
            try:
                return super().handle(*args, **options)
            finally:
                with lock.cursor() as cur:
                    cur.execute("SELECT pg_advisory_unlock(%s)", [MIGRATE_LOCK_KEY])
        finally:
            lock.close()  # ends the session: the lock goes with it even if the unlock failed
