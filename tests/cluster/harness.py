"""Cluster mode for real: PostgreSQL, Redis and an S3 endpoint on loopback, node agents and web
processes as separate OS processes, each with its own name and data/cache dirs."""
from __future__ import annotations

import atexit
import os
import secrets
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.conftest import REPO
from tests.procs import PYTHON, free_port, stop_process, wait_http

PG_ADMIN_DSN = os.environ.get("XGEN_TEST_PG", "postgres://postgres@127.0.0.1:5432/test")
REDIS_HOST = os.environ.get("XGEN_TEST_REDIS", "127.0.0.1:6379")


def _pg_admin(sql: str) -> None:
    import psycopg

    with psycopg.connect(PG_ADMIN_DSN, autocommit=True) as conn:
        conn.execute(sql)


def services_available() -> str | None:
    """None when PostgreSQL and Redis answer, else why not."""
    try:
        _pg_admin("SELECT 1")
    except Exception as exc:
        return f"PostgreSQL at {PG_ADMIN_DSN}: {exc}"
    import redis

    host, port = REDIS_HOST.split(":")
    try:
        redis.Redis(host=host, port=int(port), socket_timeout=2).ping()
    except Exception as exc:
        return f"Redis at {REDIS_HOST}: {exc}"
    return None


@dataclass
class Proc:
    name: str
    proc: subprocess.Popen
    log_path: Path
    url: str = ""

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@dataclass
class Cluster:
    root: Path
    env: dict
    database: str
    redis_db: int
    agents: dict[str, Proc] = field(default_factory=dict)
    webs: dict[str, Proc] = field(default_factory=dict)
    admin_key: str = ""

    def manage(self, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
        return subprocess.run([PYTHON, str(REPO / "manage.py"), *args], cwd=REPO, env={**self.env, **(env or {})},
                              capture_output=True, text=True, timeout=120, check=True)

    def _spawn(self, name: str, args: list[str], env: dict) -> Proc:
        log_path = self.root / f"{name}.log"
        log = open(log_path, "ab")  # noqa: SIM115
        # PGAPPNAME (libpq): the process's sessions are named in pg_stat_activity (db_activity below).
        proc = subprocess.Popen([PYTHON, str(REPO / "manage.py"), *args], cwd=REPO,
                                env={**self.env, "PGAPPNAME": name, **env}, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        return Proc(name=name, proc=proc, log_path=log_path)

    def node_env(self, node: str) -> dict:
        data = self.root / node
        return {"XGEN_DATA_DIR": str(data), "XGEN_MODELS_DIR": str(data / "cache"), "XGEN_NODE_NAME": node,
                "XGEN_NODE_ADDRESS": "127.0.0.1"}

    def start_agent(self, node: str) -> Proc:
        agent = self._spawn(f"agent-{node}", ["nodeagent", "--name", node], self.node_env(node))
        self.agents[node] = agent
        return agent

    def start_web(self, name: str) -> Proc:
        port = free_port()
        env = {"XGEN_DATA_DIR": str(self.root / name), "XGEN_NODE_NAME": name}
        web = self._spawn(f"web-{name}", ["serve", "--no-agent", "--host", "127.0.0.1", "--port", str(port)], env)
        web.url = f"http://127.0.0.1:{port}"
        wait_http(f"{web.url}/healthz", timeout=60, proc=web.proc)
        self.webs[name] = web
        return web

    def db_activity(self) -> str:
        """Every session on the cluster's database that is not idle: who (PGAPPNAME), its state, what
        it waits on, since when, and which sessions block it (a hung process's evidence)."""
        import psycopg

        sql = ("SELECT pid, application_name, state, wait_event_type, wait_event, "
               "now() - xact_start, pg_blocking_pids(pid), left(query, 300) FROM pg_stat_activity "
               "WHERE datname = %s AND state IS DISTINCT FROM 'idle' AND pid <> pg_backend_pid() ORDER BY pid")
        try:
            with psycopg.connect(PG_ADMIN_DSN, autocommit=True) as conn:
                rows = conn.execute(sql, (self.database,)).fetchall()
        except Exception as exc:
            return f"(pg_stat_activity unreadable: {exc})"
        return "\n".join(" | ".join(str(c) for c in row) for row in rows) or "(no session busy)"

    def evidence(self, proc: Proc, *, lines: int = 12000) -> str:
        """A process that did not do what it should: its stacks (faulthandler on SIGUSR1, written to
        its log), its log's tail and the database sessions that are not idle."""
        code = proc.proc.poll()
        if code is None:
            proc.proc.send_signal(signal.SIGUSR1)  # every thread's stack (faulthandler)
            if proc.name.startswith("agent-"):
                proc.proc.send_signal(signal.SIGUSR2)  # the loop's tasks and what each awaits
            time.sleep(1)
        state = "runs" if code is None else f"exited with {code}"
        return (f"({proc.name} {state})\ndatabase sessions:\n{self.db_activity()}\n"
                f"{proc.name} log:\n{proc.log[-lines:]}")

    def kill_agent(self, node: str) -> None:
        agent = self.agents.pop(node)
        agent.proc.send_signal(signal.SIGKILL)
        agent.proc.wait()

    def api(self, web: str) -> httpx.Client:
        return httpx.Client(base_url=self.webs[web].url, headers={"Authorization": f"Bearer {self.admin_key}"},
                            timeout=60)

    def wait_nodes_online(self, names: set[str], *, web: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        with self.api(web) as client:
            while time.monotonic() < deadline:
                nodes = {n["name"]: n["status"] for n in client.get("/api/hardware/nodes").json()}
                if all(nodes.get(n) == "online" for n in names):
                    return
                time.sleep(0.3)
        raise TimeoutError(f"nodes {names} not online: {nodes}")

    def stop(self) -> dict[str, int]:
        codes = {}
        for p in list(self.agents.values()) + list(self.webs.values()):
            codes[p.name] = stop_process(p.proc, timeout=70)  # past an agent's XGEN_AGENT_STOP_TIMEOUT_S
        self.agents.clear()
        self.webs.clear()
        return codes


_TEMPLATE: list[str] = []


def _migrated_template(cluster: Cluster) -> str:
    """A PostgreSQL database migrated by this tree with the admin user, made once a run: each
    cluster's database is a copy of it (CREATE DATABASE ... TEMPLATE: 0.09 s, where migrate and
    createuser took 5.9 s a cluster on a quiet machine). Dropped when the run ends."""
    if not _TEMPLATE:
        name = f"xgen_cluster_template_{uuid.uuid4().hex[:10]}"
        _pg_admin(f'CREATE DATABASE "{name}"')
        atexit.register(_drop_database, name)
        env = {"DATABASE_URL": f"{PG_ADMIN_DSN.rsplit('/', 1)[0]}/{name}"}
        cluster.manage("migrate", "-v0", env=env)
        cluster.manage("createuser", "--username", "admin", "--role", "admin", "--password", "admin-pass-123", env=env)
        _TEMPLATE.append(name)
    return _TEMPLATE[0]


def _drop_database(name: str) -> None:
    try:
        _pg_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    except Exception:  # noqa: BLE001 - PostgreSQL gone at exit: nothing to drop
        pass


def create_cluster(root: Path, *, s3_endpoint: str, s3_access: str, s3_secret: str, extra_env: dict | None = None) -> Cluster:
    """A fresh PostgreSQL database and Redis db, migrated, with an admin key; no processes yet."""
    database = f"xgen_cluster_{uuid.uuid4().hex[:10]}"
    redis_db = 1 + int(uuid.uuid4().int % 15)
    import redis

    host, port = REDIS_HOST.split(":")
    redis.Redis(host=host, port=int(port), db=redis_db).flushdb()
    base = PG_ADMIN_DSN.rsplit("/", 1)[0]
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "xgenconsole.settings",
        "DATABASE_URL": f"{base}/{database}",
        "REDIS_URL": f"redis://{REDIS_HOST}/{redis_db}",
        "MINIO_ENDPOINT": s3_endpoint,
        "MINIO_ACCESS_KEY": s3_access,
        "MINIO_SECRET_KEY": s3_secret,
        "MINIO_BUCKET": "xgen-cluster",
        "XGEN_SECRET_KEY": secrets.token_urlsafe(50),
        "XGEN_DEMO_MODEL": "false",
        "XGEN_HEARTBEAT_INTERVAL": "1",
        "XGEN_NODE_STALE_AFTER": "3",
        "XGEN_NODE_OFFLINE_AFTER": "5",
        "XGEN_RECONCILE_INTERVAL": "2",
        "XGEN_API_KEY_CACHE": "5",
        "PYTHONUNBUFFERED": "1",
        # An agent's stop that hangs ends with its stacks in its log before stop() would SIGKILL it.
        "XGEN_AGENT_STOP_TIMEOUT_S": "60",
        **(extra_env or {}),
    }
    root.mkdir(parents=True, exist_ok=True)
    cluster = Cluster(root=root, env={**env, "XGEN_DATA_DIR": str(root / "admin")}, database=database, redis_db=redis_db)
    _pg_admin(f'CREATE DATABASE "{database}" TEMPLATE "{_migrated_template(cluster)}"')
    cluster.admin_key = cluster.manage("createapikey", "--username", "admin").stdout.strip()
    return cluster


def destroy_cluster(cluster: Cluster) -> None:
    cluster.stop()
    _pg_admin(f'DROP DATABASE IF EXISTS "{cluster.database}" WITH (FORCE)')


def new_api_keys(cluster: Cluster, count: int, *, username: str = "admin") -> list[str]:
    """`count` fresh raw API keys for `username`, made by one management shell."""
    code = (
        "import uuid; from accounts.models import User; from accounts.services import create_api_key; "
        f"u = User.objects.get(username={username!r}); "
        f"print(' '.join(create_api_key(user=u, name='k-' + uuid.uuid4().hex[:8])[1] for _ in range({count})))"
    )
    return cluster.manage("shell", "-v", "0", "-c", code).stdout.split()


def backend_secret(cluster: Cluster, instance_id: int) -> str:
    """The instance's backend secret, as the database holds it (no API answer shows it)."""
    code = f"from serving.models import ModelInstance as M; print(M.objects.get(pk={instance_id}).backend_key)"
    return cluster.manage("shell", "-v", "0", "-c", code).stdout.strip()


def postgres_restart_command() -> list[str] | None:
    """How to restart the loopback PostgreSQL the tests use (Debian's pg_ctlcluster), or None."""
    import shutil

    versions = sorted(os.listdir("/etc/postgresql")) if os.path.isdir("/etc/postgresql") else []
    if not versions or shutil.which("pg_ctlcluster") is None:
        return None
    return ["pg_ctlcluster", "--skip-systemctl-redirect", versions[0], "main", "restart"]


def restart_postgres() -> float:
    """Restart PostgreSQL (fast shutdown: every connection is cut); seconds it took."""
    command = postgres_restart_command()
    assert command is not None, "no pg_ctlcluster here"
    started = time.monotonic()
    subprocess.run(command, check=True, timeout=120, capture_output=True)
    return time.monotonic() - started


def redis_restart_possible() -> bool:
    import shutil

    return shutil.which("redis-cli") is not None and shutil.which("redis-server") is not None


def restart_redis(timeout: float = 30) -> float:
    """Stop the loopback Redis without saving (every channel, group and message is gone) and
    start it again as the test setup does; seconds it took."""
    import redis

    host, port = REDIS_HOST.split(":")
    started = time.monotonic()
    subprocess.run(["redis-cli", "-h", host, "-p", port, "shutdown", "nosave"], capture_output=True, timeout=30)
    client = redis.Redis(host=host, port=int(port), socket_timeout=1)
    deadline = time.monotonic() + timeout
    while True:  # wait for the port to close before starting the new server
        try:
            client.ping()
        except redis.ConnectionError:
            break
        assert time.monotonic() < deadline, "Redis did not stop"
        time.sleep(0.05)
    subprocess.run(["redis-server", "--daemonize", "yes", "--bind", host, "--port", port, "--save", "",
                    "--appendonly", "no"], check=True, capture_output=True, timeout=30)
    while True:
        try:
            client.ping()
            return time.monotonic() - started
        except redis.ConnectionError:
            assert time.monotonic() < deadline, "Redis did not start again"
            time.sleep(0.05)
