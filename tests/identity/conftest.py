"""Real identity providers for the SSO tests: the npm package oidc-provider (node) and Debian's slapd,
each started by the tests on a port of its own. Both are installed by `deploy/bootstrap.sh test`;
a test here fails (never skips) when they are missing."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urljoin, urlsplit

import httpx
import pytest

from tests.procs import free_port, stop_process, wait_http

HERE = Path(__file__).resolve().parent
OIDC_PROVIDER_VERSION = "9.13.3"  # MIT; pinned like axe-core (tests/browser/axe.py)
OIDC_PROVIDER_DIR = Path(os.environ.get("XGEN_OIDC_PROVIDER_DIR", Path.home() / ".cache" / "xgen" / "oidc-provider"))
CLIENT_ID, CLIENT_SECRET = "xgen-console", "console-secret-for-tests"
CALLBACK = "http://testserver/accounts/oidc/callback/"  # Django's test client host


def oidc_provider_package() -> Path:
    """The oidc-provider package dir, installed with npm on first use (deploy/bootstrap.sh test does it too)."""
    package = OIDC_PROVIDER_DIR / "node_modules" / "oidc-provider"
    if shutil.which("node") is None:
        pytest.fail("node is missing: apt-get install nodejs npm (deploy/bootstrap.sh test does)")
    if not (package / "package.json").is_file():
        npm = shutil.which("npm")
        if npm is None:
            pytest.fail(f"oidc-provider is not in {OIDC_PROVIDER_DIR} and npm is missing (deploy/bootstrap.sh test installs both)")
        OIDC_PROVIDER_DIR.mkdir(parents=True, exist_ok=True)
        done = subprocess.run([npm, "install", "--prefix", str(OIDC_PROVIDER_DIR), "--no-audit", "--no-fund",
                               "--no-save", f"oidc-provider@{OIDC_PROVIDER_VERSION}"],
                              capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            pytest.fail(f"could not install oidc-provider@{OIDC_PROVIDER_VERSION}: {done.stderr[-2000:]}")
    return package


def signing_key(kid: str) -> dict:
    from joserfc.jwk import RSAKey

    key = RSAKey.generate_key(2048, parameters={"kid": kid, "use": "sig", "alg": "RS256"}, private=True)
    return key.as_dict(private=True)


@dataclass
class OidcProvider:
    port: int
    workdir: Path
    keys: list[dict]
    accounts: dict = field(default_factory=dict)
    proc: subprocess.Popen | None = None
    callback: str = CALLBACK  # the console's callback URL the client is registered with

    @property
    def issuer(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        package_root = oidc_provider_package().parent.parent
        script = package_root / "xgen_test_oidc_provider.mjs"  # beside node_modules, so its imports resolve
        shutil.copyfile(HERE / "oidc_provider.mjs", script)
        config = self.workdir / "provider.json"
        config.write_text(json.dumps({
            "issuer": self.issuer, "port": self.port, "keys": self.keys, "accounts": self.accounts,
            "clients": [{"client_id": CLIENT_ID, "client_secret": CLIENT_SECRET, "redirect_uris": [self.callback],
                         "grant_types": ["authorization_code", "refresh_token"], "response_types": ["code"],
                         "token_endpoint_auth_method": "client_secret_basic"}],
        }))
        log = open(self.workdir / "provider.log", "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(["node", str(script), str(config)], stdout=log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "NODE_ENV": "test"})
        log.close()
        try:
            wait_http(f"{self.issuer}/.well-known/openid-configuration", timeout=30, proc=self.proc)
        except Exception:
            self.stop()
            raise RuntimeError("oidc-provider did not start:\n" + self.log) from None

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, timeout=10)
            self.proc = None

    @property
    def log(self) -> str:
        return (self.workdir / "provider.log").read_text(errors="replace")

    def set_account(self, name: str, **values) -> None:
        self.accounts[name] = values
        httpx.post(f"{self.issuer}/test/accounts", json={name: values}, timeout=10).raise_for_status()

    def next_id_token(self, **values) -> None:
        httpx.post(f"{self.issuer}/test/next-id-token", json=values, timeout=10).raise_for_status()

    def authorize(self, start_url: str, login: str) -> str:
        """Through the provider's own login and consent pages as `login`; the URL it sends the
        browser back to (the console's callback, with code and state)."""
        url = start_url
        with httpx.Client(timeout=15) as http:
            for _ in range(20):
                resp = http.get(url)
                while resp.status_code == 200:  # a page with a form: login, then consent
                    action = re.search(r'<form[^>]*action="([^"]+)"', resp.text)
                    assert action, f"no form on {url}:\n{resp.text[:2000]}"
                    data = {}
                    for tag in re.findall(r"<input[^>]*>", resp.text):  # hidden fields (prompt) included
                        name, value = re.search(r'name="([^"]*)"', tag), re.search(r'value="([^"]*)"', tag)
                        if name:
                            data[name[1]] = value[1] if value else ""
                    if "login" in data:
                        data.update(login=login, password="any")  # dev interactions take any password
                    resp = http.post(urljoin(url, action[1]), data=data)
                assert resp.is_redirect, f"{resp.status_code} from the provider at {url}:\n{resp.text[:2000]}"
                url = urljoin(url, resp.headers["location"])
                if url.startswith(self.callback):
                    return url
        raise AssertionError("the provider never sent the browser back")


@pytest.fixture(scope="module")
def oidc_provider(tmp_path_factory) -> Iterator[OidcProvider]:
    provider = OidcProvider(port=free_port(), workdir=tmp_path_factory.mktemp("oidc"), keys=[signing_key("key-1")])
    provider.start()
    yield provider
    provider.stop()


def local_path(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.path}?{parts.query}"


# ---------------------------------------------------------------- slapd
SLAPD = shutil.which("slapd") or "/usr/sbin/slapd"
LDAP_BASE = "dc=example,dc=test"
LDAP_ADMIN_DN, LDAP_ADMIN_PASSWORD = f"cn=admin,{LDAP_BASE}", "ldap-admin-secret"


@dataclass
class Slapd:
    port: int
    workdir: Path
    proc: subprocess.Popen
    tls_port: int | None = None  # ldaps://, when started with tls=True (its CA: workdir/cert.pem)

    @property
    def url(self) -> str:
        return f"ldap://127.0.0.1:{self.port}"

    def modify(self, ldif: str) -> None:
        done = subprocess.run(["ldapmodify", "-x", "-H", self.url, "-D", LDAP_ADMIN_DN, "-w", LDAP_ADMIN_PASSWORD],
                              input=ldif, capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, done.stderr


SLAPD_CONF = """\
include /etc/ldap/schema/core.schema
include /etc/ldap/schema/cosine.schema
include /etc/ldap/schema/inetorgperson.schema
include /etc/ldap/schema/nis.schema
pidfile {work}/slapd.pid
modulepath /usr/lib/ldap
moduleload back_mdb
database mdb
suffix "{base}"
rootdn "{admin}"
rootpw {password}
directory {work}/data
maxsize 104857600
access to attrs=userPassword by self =xw by anonymous auth by * none
access to * by * read
"""


def ldif_entries(users: dict[str, str], groups: dict[str, list[str]]) -> str:
    out = [f"dn: {LDAP_BASE}\nobjectClass: dcObject\nobjectClass: organization\no: Example\ndc: example\n",
           f"dn: ou=people,{LDAP_BASE}\nobjectClass: organizationalUnit\nou: people\n",
           f"dn: ou=groups,{LDAP_BASE}\nobjectClass: organizationalUnit\nou: groups\n"]
    for uid, password in users.items():
        out.append(f"dn: uid={uid},ou=people,{LDAP_BASE}\nobjectClass: inetOrgPerson\nuid: {uid}\ncn: {uid}\n"
                   f"sn: {uid.title()}\nmail: {uid}@example.test\nuserPassword: {password}\n")
    for cn, members in groups.items():
        lines = "".join(f"member: uid={m},ou=people,{LDAP_BASE}\n" for m in members)
        out.append(f"dn: cn={cn},ou=groups,{LDAP_BASE}\nobjectClass: groupOfNames\ncn: {cn}\n{lines}")
    return "\n".join(out)


def tls_files(workdir: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (it is its own CA) and its key."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    from cryptography.x509.oid import NameOID

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = workdir / "cert.pem", workdir / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL,
                                           serialization.NoEncryption()))
    return cert_path, key_path


def start_slapd(workdir: Path, ldif: str, *, tls: bool = False) -> Slapd:
    if not Path(SLAPD).is_file() or shutil.which("ldapmodify") is None:
        pytest.fail("slapd and ldap-utils are missing: apt-get install slapd ldap-utils (deploy/bootstrap.sh test does)")
    (workdir / "data").mkdir(parents=True, exist_ok=True)
    conf = workdir / "slapd.conf"
    text = SLAPD_CONF.format(work=workdir, base=LDAP_BASE, admin=LDAP_ADMIN_DN, password=LDAP_ADMIN_PASSWORD)
    urls = []
    tls_port = None
    if tls:  # StartTLS on the ldap:// port, and an ldaps:// port
        cert, key = tls_files(workdir)
        text = f"TLSCertificateFile {cert}\nTLSCertificateKeyFile {key}\nTLSCACertificateFile {cert}\n" + text
        tls_port = free_port()
        urls.append(f"ldaps://127.0.0.1:{tls_port}/")
    conf.write_text(text)
    (workdir / "init.ldif").write_text(ldif)
    done = subprocess.run(["slapadd", "-f", str(conf), "-l", str(workdir / "init.ldif")], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, f"slapadd: {done.stderr}"
    port = free_port()
    log = open(workdir / "slapd.log", "ab")  # noqa: SIM115
    # -d 0: in the foreground (a child the test stops), logging nothing but errors.
    proc = subprocess.Popen([SLAPD, "-d", "0", "-h", " ".join([f"ldap://127.0.0.1:{port}/", *urls]), "-f", str(conf)],
                            stdout=log, stderr=subprocess.STDOUT)
    log.close()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        probe = subprocess.run(["ldapsearch", "-x", "-H", f"ldap://127.0.0.1:{port}", "-b", LDAP_BASE, "-s", "base"],
                               capture_output=True, timeout=10)
        if probe.returncode == 0:
            return Slapd(port=port, workdir=workdir, proc=proc, tls_port=tls_port)
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    stop_process(proc, timeout=10)
    raise RuntimeError("slapd did not start:\n" + (workdir / "slapd.log").read_text(errors="replace"))
