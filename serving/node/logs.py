"""Where a backend's log lives: one folder per instance, the current run and the one before
(kept after a crash or a restart). The web side reads them; the supervisor writes them."""
from __future__ import annotations

from pathlib import Path

from django.conf import settings


def instance_log_dir(instance_id: int) -> Path:
    return Path(settings.LOG_DIR) / "instances" / str(instance_id)


def current_log(instance_id: int) -> Path:
    return instance_log_dir(instance_id) / "current.log"


def previous_log(instance_id: int) -> Path:
    return instance_log_dir(instance_id) / "previous.log"
