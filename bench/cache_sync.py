"""Cache sync throughput and "already cached?" latency, ours vs the naive way, in one run.

Starts moto's S3 server on loopback, uploads a 1 GiB model of 40 files, then syncs it into an
empty cache with hub.cache.sync_to_cache and with a plain sequential `fget_object` loop; then
times confirming that a 200-file model is already cached (ours: the store manifest + local
stat, and the local-only check) against a HEAD per object. Everything it writes is removed.

    /work/main/.venv/bin/python bench/cache_sync.py [--size-mib 1024] [--files 40]
"""
from __future__ import annotations

import argparse
import logging
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_up(url: str, proc: subprocess.Popen) -> None:
    import httpx

    for _ in range(600):
        if proc.poll() is not None:
            raise SystemExit("moto exited early")
        try:
            httpx.get(url, timeout=1)
            return
        except httpx.HTTPError:
            time.sleep(0.1)
    raise SystemExit("moto did not start")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--files", type=int, default=40)
    parser.add_argument("--small-files", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="xgen-bench-"))
    port = free_port()
    os.environ.update({
        "DJANGO_SETTINGS_MODULE": "xgenconsole.settings", "XGEN_DATA_DIR": str(work / "data"),
        "XGEN_MODELS_DIR": str(work / "cache"), "MINIO_ENDPOINT": f"127.0.0.1:{port}",
        "MINIO_ACCESS_KEY": "bench", "MINIO_SECRET_KEY": "bench-secret", "MINIO_BUCKET": "bench-models",
        "XGEN_LOG_LEVEL": "ERROR",
    })
    moto = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_up(f"http://127.0.0.1:{port}/moto-api/", moto)
        import django

        django.setup()
        logging.getLogger("xgen").setLevel(logging.ERROR)
        from hub.cache import is_cached, read_local_manifest, sync_to_cache
        from hub.store import get_store

        store = get_store()
        client = store.client
        settings_workers = int(os.environ.get("XGEN_CACHE_SYNC_WORKERS", "8"))

        # ---- 1 GiB, 40 files
        src = work / "src-big"
        src.mkdir()
        per_file = args.size_mib * 2**20 // args.files
        block = os.urandom(per_file)
        for i in range(args.files):
            # distinct contents per file without generating 1 GiB of randomness
            (src / f"model-{i:05d}.safetensors").write_bytes(i.to_bytes(8, "little") + block[8:])
        total = per_file * args.files
        t = time.perf_counter()
        store.upload_model("huggingface/bench-big", src)
        up_s = time.perf_counter() - t
        shutil.rmtree(src)
        print(f"uploaded {total / 2**20:,.0f} MiB in {args.files} files to moto in {up_s:.1f} s")

        def naive() -> float:
            naive_dir = work / "naive"
            os.sync()  # the last run's dirty pages are written back before this one, not during it
            t0 = time.perf_counter()
            for obj in client.list_objects("bench-models", prefix="huggingface/bench-big/", recursive=True):
                rel = obj.object_name[len("huggingface/bench-big/"):]
                client.fget_object("bench-models", obj.object_name, str(naive_dir / rel))
            elapsed = time.perf_counter() - t0
            shutil.rmtree(naive_dir)
            return elapsed

        def ours_sync(verify: bool = False) -> float:
            shutil.rmtree(work / "cache", ignore_errors=True)
            os.sync()
            t0 = time.perf_counter()
            sync_to_cache("huggingface/bench-big", node_name="bench", store=store, verify=verify)
            return time.perf_counter() - t0

        # Alternate the two so machine noise (2 shared cores) hits both alike; report medians.
        naive_runs, ours_runs, hashed_runs = [], [], []
        for _ in range(args.rounds):
            naive_runs.append(naive())
            ours_runs.append(ours_sync())
            hashed_runs.append(ours_sync(verify=True))
        naive_s, ours_s = statistics.median(naive_runs), statistics.median(ours_runs)
        hashed_s = statistics.median(hashed_runs)
        mib = total / 2**20

        def runs(xs: list[float]) -> str:
            return ", ".join(f"{x:.2f}" for x in xs)

        print(f"sync 1 GiB into an empty cache, median of {args.rounds} alternating runs:")
        print(f"  naive sequential fget_object loop      {mib / naive_s:6,.0f} MiB/s  [{runs(naive_runs)} s]")
        print(f"  ours, {settings_workers} workers, size+ETag checked   {mib / ours_s:6,.0f} MiB/s  [{runs(ours_runs)} s]"
              f"  ratio {naive_s / ours_s:.2f}x")
        print(f"  ours, verify=True (sha256 every byte)  {mib / hashed_s:6,.0f} MiB/s  [{runs(hashed_runs)} s]"
              f"  ratio {naive_s / hashed_s:.2f}x")
        t = time.perf_counter()
        sync_to_cache("huggingface/bench-big", node_name="bench", store=store)
        print(f"second sync of the 1 GiB model (nothing to fetch): {1000 * (time.perf_counter() - t):.1f} ms")
        shutil.rmtree(work / "cache", ignore_errors=True)
        store.delete_model("huggingface/bench-big")

        # ---- is a 200-file model already cached?
        src = work / "src-small"
        src.mkdir()
        for i in range(args.small_files):
            (src / f"part-{i:04d}.bin").write_bytes(os.urandom(4096))
        store.upload_model("huggingface/bench-small", src)
        sync_to_cache("huggingface/bench-small", node_name="bench", store=store)
        local = work / "cache" / "huggingface" / "bench-small"

        def best(fn, n=5) -> float:
            times = []
            for _ in range(n):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            return min(times)

        def head_each() -> None:
            for obj in client.list_objects("bench-models", prefix="huggingface/bench-small/", recursive=True):
                st = client.stat_object("bench-models", obj.object_name)
                rel = obj.object_name[len("huggingface/bench-small/"):]
                p = local / rel
                assert rel.startswith(".xgen") or (p.exists() and p.stat().st_size == st.size)

        def ours() -> None:
            assert is_cached("huggingface/bench-small", store=store)

        def local_only() -> None:
            manifest = read_local_manifest(local)
            assert manifest and all((local / f["path"]).stat().st_size == f["size"] for f in manifest["files"])

        heads = best(head_each, 3)
        ours_t = best(ours)
        local_t = best(local_only)
        print(f"confirm a {args.small_files}-file model is cached: a HEAD per object {1000 * heads:.0f} ms; "
              f"ours (store manifest GET + local stat) {1000 * ours_t:.1f} ms ({heads / ours_t:.0f}x faster); "
              f"local manifest only {1000 * local_t:.1f} ms")
    finally:
        moto.terminate()
        try:
            moto.wait(10)
        except subprocess.TimeoutExpired:
            moto.kill()
            moto.wait()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
