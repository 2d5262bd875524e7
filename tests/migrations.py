"""Moving the test database between migrations, for the tests of data migrations: fill rows through
an old schema (`migrate_to(BEFORE)` gives its historical models), then migrate forward (`latest()`)."""
from __future__ import annotations

from django.db import connection
from django.db.migrations.executor import MigrationExecutor


def migrate_to(targets):
    """Migrate the test database to `targets` ([(app, migration)]); returns the models of that state."""
    executor = MigrationExecutor(connection)
    executor.loader.build_graph()
    executor.migrate(targets)
    return executor.loader.project_state(targets).apps


def latest():
    """The newest migration of every app (the tree's leaf nodes)."""
    return MigrationExecutor(connection).loader.graph.leaf_nodes()
