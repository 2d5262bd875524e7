"""The child process of a Hugging Face download: `python -m hub.hf_download --repo R --dest D ...`.

It runs in its own process because huggingface_hub's tqdm-driven thread pools can hang inside
a long-lived server process. It knows nothing of Django; it prints one JSON object per line:
{"event": "files", "files": [{"path", "size"}], "sha"} first, then {"event": "done"} or
{"event": "error", "message"} (exit code 2). The parent watches the destination folder for byte
progress and kills this process to cancel.
"""
from __future__ import annotations

import argparse
import json
import os
import sys


def emit(event: str, **fields) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def describe_error(exc: Exception, repo_id: str, revision: str | None) -> str:
    """A message a person can act on."""
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if isinstance(exc, GatedRepoError):
        return f"Repository {repo_id} is gated: accept its terms on the Hub and set HF_TOKEN."
    if isinstance(exc, RepositoryNotFoundError):
        return f"Repository not found: {repo_id} (or it is private and HF_TOKEN does not grant access)."
    if isinstance(exc, RevisionNotFoundError):
        return f"Revision not found: {revision} in {repo_id}."
    if isinstance(exc, EntryNotFoundError):
        return f"A file of {repo_id} was not found: {exc}"
    if isinstance(exc, HfHubHTTPError):
        return f"The Hub answered an error for {repo_id}: {str(exc).splitlines()[0]}"
    if isinstance(exc, OSError):
        return f"Could not reach the Hub ({os.environ.get('HF_ENDPOINT', 'huggingface.co')}): {exc}"
    return f"{exc.__class__.__name__}: {exc}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repo", required=True)
    parser.add_argument("--revision", default=None)
    parser.add_argument("--dest", required=True)
    parser.add_argument("--allow", action="append", default=[])
    parser.add_argument("--workers", type=int, default=4)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.pop("HF_HUB_OFFLINE", None)

    from huggingface_hub import HfApi, constants, snapshot_download
    from huggingface_hub.hf_api import RepoFile
    from huggingface_hub.utils import filter_repo_objects

    # The parent measures progress from bytes on disk; 1 MiB writes (default 10 MiB) keep it smooth.
    constants.DOWNLOAD_CHUNK_SIZE = 1024 * 1024
    allow = args.allow or None
    try:
        api = HfApi()
        revision = args.revision or "main"
        tree = [f for f in api.list_repo_tree(args.repo, recursive=True, revision=revision) if isinstance(f, RepoFile)]
        wanted = list(filter_repo_objects(tree, allow_patterns=allow, key=lambda f: f.path))
        if not wanted:
            emit("error", message=f"No file of {args.repo} matches the allow patterns {args.allow}.")
            return 2
        emit("files", files=[{"path": f.path, "size": f.size} for f in wanted])
        snapshot_download(args.repo, revision=args.revision or None, local_dir=args.dest, allow_patterns=allow,
                          max_workers=max(1, args.workers))
    except Exception as exc:  # every failure becomes one readable line for the job
        emit("error", message=describe_error(exc, args.repo, args.revision))
        return 2
    emit("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
