"""Fixtures every test module may use: users and keys, the tiny model, a real llama.cpp server,
a real S3 endpoint, a real console process, and a check that nothing is left running."""
from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.procs import PYTHON, SESSION_CHILDREN, free_port, leftover_children, stop_process, wait_http

REPO = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------- no leftovers
@pytest.fixture(autouse=True, scope="module")
def _no_leftover_children() -> Iterator[None]:
    yield
    import time

    deadline = time.monotonic() + 5
    left = leftover_children()
    while left and time.monotonic() < deadline:  # give just-stopped processes a moment to be reaped
        time.sleep(0.1)
        left = leftover_children()
    assert not left, "child processes left running or defunct after this module:\n" + "\n".join(left)


# ---------------------------------------------------------------- users, keys
@dataclass
class Account:
    user: object
    password: str
    key: str


def _account(username: str, role: str) -> Account:
    from accounts.services import create_api_key, create_user

    password = f"{username}-pass-123"
    user = create_user(username=username, role=role, password=password)
    _, key = create_api_key(user=user, name=f"{username}-key")
    return Account(user=user, password=password, key=key)


@pytest.fixture
def admin(db) -> Account:
    return _account("alice-admin", "admin")


@pytest.fixture
def operator(db) -> Account:
    return _account("olga-operator", "operator")


@pytest.fixture
def viewer(db) -> Account:
    return _account("victor-viewer", "viewer")


def bearer(key: str) -> dict[str, str]:
    return {"HTTP_AUTHORIZATION": f"Bearer {key}"}


# ---------------------------------------------------------------- tiny model
@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory) -> Path:
    """The tiny llama GGUF (random weights, ChatML, mean pooling); ~600 KB."""
    from hub.demo import write_tiny_llama_gguf

    return write_tiny_llama_gguf(tmp_path_factory.mktemp("models") / "tiny-llama.gguf", seed=0)


@pytest.fixture(scope="session")
def tiny_reranker(tmp_path_factory) -> Path:
    """A tiny Qwen3-layout reranker GGUF (random weights, rank pooling, a classification head); ~600 KB."""
    from hub.demo import write_tiny_reranker_gguf

    return write_tiny_reranker_gguf(tmp_path_factory.mktemp("rerank-models") / "tiny-reranker.gguf", seed=0)


# ---------------------------------------------------------------- llama.cpp servers
# The two engines for GGUF models; tests that exercise an engine end to end run on both.
ENGINES = ("llama-cpp-python", "llama-server")


def llama_server_binary() -> str:
    """The llama-server the backend probe finds (XGEN_LLAMA_SERVER_BIN, PATH, the cached build);
    fails the test, saying how to build one, when there is none."""
    from hardware.backends import probe_llama_server

    row = probe_llama_server()
    if not row["available"]:
        pytest.fail(f"{row['reason']}; build it with `bash deploy/build_llama_cpp.sh VERSION` "
                    "(deploy/bootstrap.sh does)")
    return row["path"]


def engine_command(engine: str, *, model: Path, port: int, alias: str, embedding: bool = False,
                   n_ctx: int = 512, rerank: bool = False, context_shift: bool = False) -> tuple[list[str], str]:
    """argv that starts `engine` by hand on `model`, and the path that answers 200 once it is up
    (`rerank`, `context_shift`: llama-server only; `rerank` on a reranker GGUF; `context_shift`
    lets one answer run past the context, which llama-server caps at the model's 2,048)."""
    if engine == "llama-server":
        cmd = [llama_server_binary(), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
               "--alias", alias, "--ctx-size", str(n_ctx), "--parallel", "1"]
        if context_shift:
            cmd.append("--context-shift")
        if rerank:
            return cmd + ["--reranking"], "/health"
        return cmd + (["--embeddings", "--pooling", "mean"] if embedding else []), "/health"
    assert not rerank and not context_shift, "llama-cpp-python's server has no rerank route, no context shift"
    cmd = [PYTHON, "-m", "llama_cpp.server", "--model", str(model), "--host", "127.0.0.1",
           "--port", str(port), "--model_alias", alias, "--n_ctx", str(n_ctx), "--verbose", "false"]
    return cmd + (["--embedding", "true"] if embedding else []), "/v1/models"


@dataclass
class LlamaServer:
    proc: subprocess.Popen
    port: int
    alias: str
    engine: str = "llama-cpp-python"

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture
def llama_server_factory(tiny_gguf: Path, tmp_path: Path) -> Iterator[Callable[..., LlamaServer]]:
    """Start real llama.cpp servers (llama-cpp-python's by default) on the tiny model; all stopped after the test."""
    started: list[LlamaServer] = []

    def start(alias: str = "tiny", *, embedding: bool = False, model: Path | None = None,
              engine: str = "llama-cpp-python") -> LlamaServer:
        port = free_port()
        cmd, health = engine_command(engine, model=model or tiny_gguf, port=port, alias=alias, embedding=embedding)
        log = open(tmp_path / f"llama-{alias}-{port}.log", "wb")  # noqa: SIM115
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        server = LlamaServer(proc=proc, port=port, alias=alias, engine=engine)
        started.append(server)
        wait_http(f"{server.base_url}{health}", timeout=60, proc=proc)
        return server

    yield start
    for server in started:
        stop_process(server.proc)


@pytest.fixture
def llama_server(llama_server_factory) -> LlamaServer:
    return llama_server_factory("tiny")


# ---------------------------------------------------------------- S3 on loopback
@dataclass
class S3Endpoint:
    host: str
    port: int
    access_key: str = "testing-access"
    secret_key: str = "testing-secret-key"

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.endpoint}"

    def client(self):
        from minio import Minio

        return Minio(self.endpoint, access_key=self.access_key, secret_key=self.secret_key, secure=False)

    def reset(self) -> None:
        httpx.post(f"{self.url}/moto-api/reset", timeout=10).raise_for_status()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Endpoint]:
    """moto's S3 server in its own process on a free loopback port (a real S3 endpoint)."""
    port = free_port()
    log = open(Path(tempfile.gettempdir()) / f"moto-{port}.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [PYTHON, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        env={**os.environ, "AWS_ACCESS_KEY_ID": "testing-access", "AWS_SECRET_ACCESS_KEY": "testing-secret-key"},
    )
    log.close()
    SESSION_CHILDREN.add(proc.pid)
    wait_http(f"http://127.0.0.1:{port}/moto-api/", timeout=60, proc=proc)
    yield S3Endpoint(host="127.0.0.1", port=port)
    stop_process(proc)
    SESSION_CHILDREN.discard(proc.pid)


@pytest.fixture
def s3(s3_server: S3Endpoint) -> S3Endpoint:
    """The S3 endpoint, emptied before the test."""
    s3_server.reset()
    return s3_server


# ---------------------------------------------------------------- a real console process
@dataclass
class Console:
    proc: subprocess.Popen
    url: str
    data_dir: Path
    env: dict
    admin_user: str = "admin"
    admin_password: str = "admin-pass-123"

    def manage(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run([PYTHON, str(REPO / "manage.py"), *args], env=self.env, cwd=REPO,
                              capture_output=True, text=True, check=check, timeout=120)

    @property
    def log(self) -> str:
        return (self.data_dir / "serve.log").read_text(errors="replace")


@dataclass
class KeyedConsole:
    """A running console and an API key to call it with."""

    console: Console
    key: str

    @property
    def url(self) -> str:
        return self.console.url

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}


def _migrate_and_admin(env: dict) -> None:
    for cmd in (["migrate", "-v0"], ["ensureadmin"]):
        subprocess.run([PYTHON, str(REPO / "manage.py"), *cmd], env=env, cwd=REPO, check=True,
                       capture_output=True, timeout=120)


_TEMPLATES: dict[tuple[str, str], Path] = {}


def _migrated_database(env: dict) -> Path | None:
    """A SQLite database migrated by this tree and holding the admin of `env`, made once a run and
    copied into each fresh console's data dir: `migrate` and `ensureadmin` took 5.4 s a console on
    a quiet machine, and a full run starts 55 consoles. None where the console's database is not
    the data dir's SQLite (DATABASE_URL set): that one is migrated as before. Each console still
    makes its own secret key at its start."""
    if env.get("DATABASE_URL"):
        return None
    who = (env.get("XGEN_ADMIN_USER", "admin"), env.get("XGEN_ADMIN_PASSWORD", ""))
    if who not in _TEMPLATES:
        folder = Path(tempfile.mkdtemp(prefix="xgen-migrated-"))
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        _migrate_and_admin({**env, "XGEN_DATA_DIR": str(folder)})
        _TEMPLATES[who] = folder / "xgen.sqlite3"
    return _TEMPLATES[who]


def start_console(data_dir: Path, *, extra_env: dict | None = None, server: str | None = None) -> Console:
    """Migrate a fresh data dir, create an admin (a copy of _migrated_database's where it can), and
    run `manage.py serve` on a free port, on `server` (daphne or uvicorn), else on serve's own
    default as in production (uvicorn)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "xgenconsole.settings",
        "XGEN_DATA_DIR": str(data_dir),
        "XGEN_NODE_NAME": "test-node",
        "XGEN_ADMIN_PASSWORD": "admin-pass-123",
        "XGEN_DEMO_MODEL": "false",
        "XGEN_HEARTBEAT_INTERVAL": "1",
        "XGEN_IMPORT_DIRS": tempfile.gettempdir(),  # uploads from tmp paths (tiny_gguf), as in settings_test
        "PYTHONUNBUFFERED": "1",
        **(extra_env or {}),
    }
    database = data_dir / "xgen.sqlite3"
    template = None if database.exists() else _migrated_database(env)
    if template is not None:
        shutil.copyfile(template, database)
    else:
        _migrate_and_admin(env)
    log = open(data_dir / "serve.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [PYTHON, str(REPO / "manage.py"), "serve", "--host", "127.0.0.1", "--port", str(port),
         *(["--server", server] if server else [])],
        env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
    )
    log.close()
    console = Console(proc=proc, url=f"http://127.0.0.1:{port}", data_dir=data_dir, env=env)
    try:
        wait_http(f"{console.url}/healthz", timeout=60, proc=proc)
    except Exception:
        stop_process(proc)
        raise RuntimeError("console did not start:\n" + console.log) from None
    return console


@pytest.fixture(scope="module")
def console(tmp_path_factory) -> Iterator[Console]:
    """A real all-in-one console (`manage.py serve`) with its own data dir, for the module."""
    c = start_console(tmp_path_factory.mktemp("console"))
    yield c
    code = stop_process(c.proc, timeout=30)
    assert code == 0, f"console exited with {code}:\n{c.log[-3000:]}"


# `pytest -m "not slow and not browser and not cluster"` is the quick run (README, Tests): these
# are slow. A test is, when it starts processes that take seconds each (a real console, a node
# agent with its engines, llama.cpp servers, the released trees of the migration tests)...
SLOW_FIXTURES = frozenset({"console", "proxy_console", "proxy_console_daphne", "backends", "agent", "engine",
                           "llama_server", "llama_server_factory", "consoles", "release_tree", "billing",
                           "tricked"})
# ...or when it does so inside the test or a fixture of its file, or took 3 s or more in
# `pytest --durations=0` (2 cores, load 7-10; parameters summed; a first test's database setup not counted).
SLOW_PATHS = (
    "tests/faults/",
    "tests/proxy/test_limits_and_usage.py", "tests/proxy/test_queue.py", "tests/proxy/test_soak.py",
    "tests/security/test_secrets.py", "tests/security/test_fuzz_api.py",
    "tests/serving/test_agent_restart.py", "tests/serving/test_demo_chat.py", "tests/serving/test_on_demand.py",
    "tests/xgenconsole/test_body_limits.py", "tests/xgenconsole/test_head_limits.py",
    "tests/xgenconsole/test_serve.py", "tests/xgenconsole/test_deploy_check.py",
    "tests/deploy/test_images.py::test_llama_server_links_only_what_the_cpu_image_installs",
    "tests/deploy/test_images.py::test_the_wheel_the_build_makes_installs_in_a_clean_venv",
    "tests/accounts/test_admin_pages.py::test_admin_creates_a_key_shown_once",
    "tests/accounts/test_key_cache.py::test_a_key_in_use_is_kept_fresh_between_its_requests",
    "tests/hardware/test_detectors.py::test_the_torch_device_reader_on_the_real_torch",
    "tests/hub/test_api.py::test_the_index_of_a_thousand_models_refreshes_and_pages",
    "tests/hub/test_cache.py::test_a_sync_in_another_process_and_one_here_transfer_once",
    "tests/hub/test_ggufmeta.py::test_the_demo_model_reads_as_the_library_reads_it",  # 4.9 s: GGUFReader's own read
    "tests/serving/test_adapters.py::test_llama_cpp_python_answers_concurrent_chats_each_in_full",  # a real engine
    "tests/hub/test_cache.py::test_a_sync_killed_half_way_leaves_nothing_that_passes_as_complete",
    "tests/hub/test_cache.py::test_a_verified_copy_loads_while_the_store_is_down",
    "tests/hub/test_cache.py::test_big_files_go_up_in_parts_and_come_back_verified",
    "tests/hub/test_download_replace.py::test_a_cancelled_replacing_download_leaves_the_old_model",
    "tests/hub/test_downloads.py::test_a_kill_9_mid_download_leaves_a_child_the_restarted_agent_stops",
    "tests/hub/test_downloads.py::test_the_store_going_away_mid_upload_fails_and_leaves_no_model",
    "tests/hub/test_replace.py::test_a_switch_cut_short_by_the_store_is_finished_once_it_is_back",
    "tests/hub/test_store.py::test_listing_pages_through_many_models",
    "tests/hub/test_store_writes.py::test_an_upload_of_a_huge_folder_is_refused_without_walking_it",
    "tests/hub/test_upload_jobs.py::test_a_replace_cut_off_by_the_store_is_never_listed_complete",
    "tests/proxy/test_http1_conformance.py::test_broken_answers_are_clean_errors_and_whole_ones_read_as_h11_reads_them",
    "tests/security/test_auth_matrix.py::test_pages_by_role",
    "tests/security/test_dashboard_fuzz.py::test_any_range_renders_the_dashboard",
    "tests/security/test_extra_args_properties.py::test_extra_args_never_reach_argv_unchecked",
    "tests/security/test_validators_properties.py::test_a_valid_prefix_never_leaves_the_root",
    "tests/serving/test_launch.py::test_agent_shutdown_while_the_database_fails_still_kills_its_backends",
    "tests/xgenconsole/test_docs_settings.py::test_the_reader_finds_what_settings_reads",
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if SLOW_FIXTURES.intersection(getattr(item, "fixturenames", ())) or item.nodeid.startswith(SLOW_PATHS):
            item.add_marker(pytest.mark.slow)
    # Sync Playwright cannot share a process with pytest-asyncio's loops: browser tests run
    # in their own invocation (`pytest -m browser`, see the README); elsewhere they are
    # deselected, not skipped, so no run counts them as passed.
    if "browser" in (config.getoption("-m") or ""):
        return
    keep = [item for item in items if "browser" not in item.keywords]
    dropped = [item for item in items if "browser" in item.keywords]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep


EXIT_WATCHDOG_S = 120


def pytest_unconfigure(config):
    """A test run must end: a thread that keeps the interpreter from exiting (CI once waited hours
    on an event loop that could not finish cancelling its tasks, joined at exit) is reported with
    every thread's stack and the run fails, EXIT_WATCHDOG_S after pytest has finished."""
    import faulthandler
    import sys
    import threading

    def watchdog():
        import time

        time.sleep(EXIT_WATCHDOG_S)
        print(f"\n*** the test process did not exit {EXIT_WATCHDOG_S} s after the run; threads:", file=sys.stderr)
        faulthandler.dump_traceback(all_threads=True)
        os._exit(3)

    threading.Thread(target=watchdog, name="exit-watchdog", daemon=True).start()
