"""Credentials: where kiln takes them from, and that they never end up anywhere kiln writes.

Each build runs ``build.py`` as a subprocess (everything it writes to stdout/stderr is caught,
tracebacks included) with HOME, its caches and outputs under the test's directory, and a known
secret configured through one source at a time: ``KILN_REGISTRY_*``, ``auths``, ``credHelpers``,
``credsStore``. Afterwards stdout, stderr, HOME (kiln's cache), the OCI layout, the
docker-archive and the pushed image's registry storage are searched -- gzip layers and tar
members decompressed -- for the secret, its base64 forms and every bearer token issued.
TLS: a registry with a self-signed certificate is refused unless trusted or marked insecure.
The rows of ``docs/RELIABILITY.md`` ("Credentials") are these tests.
"""

from __future__ import annotations

import base64
import gzip
import io
import json
import os
import subprocess
import tarfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

from kiln.errors import KilnError
from kiln.oci.auth import RegistryAuth
from kiln.oci.credentials import Credentials
from kiln.oci.endpoints import Endpoint
from kiln.oci.registry import RegistryClient, registry_session
from tests.support import TEST_IMAGES
from tests.support.faultproxy import Fault, FaultProxy
from tests.support.kiln_process import run_kiln
from tests.support.registry import USER, VLLM_VERSION, RegistryServer, dies_with_us, free_port, run
from tests.support.reliability_checks import assert_cache_verified, tag_state

pytestmark = [pytest.mark.registry, pytest.mark.reliability]

CANARY = "s3cr3t-KILN-canary"
ROOT = Path(__file__).resolve().parents[2]
IMAGES = TEST_IMAGES
TAG = f"cu130-sm120-v{VLLM_VERSION}"
SOURCES = ("env", "auths", "credHelpers", "credsStore")
HELPER = "kilntest"


def secret_forms(user: str, secret: str) -> list[bytes]:
    return [secret.encode(), base64.b64encode(f"{user}:{secret}".encode()), base64.b64encode(secret.encode())]


# -- finding a secret in what kiln wrote -----------------------------------------------------------


def _contents(data: bytes, name: str, depth: int = 0):
    """``data`` and, recursively, what it holds: a gzip stream's bytes, a tar's members."""
    yield name, data
    if depth > 3:
        return
    if data[:2] == b"\x1f\x8b":
        try:
            yield from _contents(gzip.decompress(data), f"{name} (gunzipped)", depth + 1)
        except (OSError, EOFError):
            pass
    elif len(data) > 512 and data[257:262] == b"ustar":
        # The shared registry also stores other tests' deliberately broken layers (truncated
        # members, absurd sizes): read what is readable, the raw bytes are scanned anyway.
        try:
            with tarfile.open(fileobj=io.BytesIO(data)) as tar:
                for member in tar:
                    if member.isfile() and member.size <= len(data):
                        yield from _contents(tar.extractfile(member).read(), f"{name}!{member.name}", depth + 1)
        except (tarfile.TarError, EOFError, OSError):
            return


def find_leaks(needles: list[bytes], texts: dict[str, str], roots: list[Path]) -> list[str]:
    found = []
    haystacks = [(name, text.encode()) for name, text in texts.items()]
    for root in roots:
        files = [root] if root.is_file() else [p for p in root.rglob("*") if p.is_file() and not p.is_symlink()]
        haystacks += [(str(path), path.read_bytes()) for path in files]
    for name, data in haystacks:
        for inner, content in _contents(data, name):
            found += [f"{needle[:12]!r}... in {inner}" for needle in needles if needle in content]
    return found


# -- a build in a subprocess, credentials from one source ------------------------------------------


@dataclass
class Sandbox:
    root: Path

    @property
    def home(self) -> Path:
        return self.root / "home"

    @property
    def secrets(self) -> Path:  # the credential sources live here: never searched
        return self.root / "secrets"

    @property
    def out(self) -> Path:
        return self.root / "out"

    def configure(self, source: str, host: str, user: str, secret: str) -> dict[str, str]:
        """Environment for a build whose credentials for ``host`` come from ``source`` only."""
        self.home.mkdir(parents=True, exist_ok=True)
        docker = self.secrets / "docker"
        bin_dir = self.secrets / "bin"
        docker.mkdir(parents=True, exist_ok=True)
        bin_dir.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("KILN_", "DOCKER_", "REGISTRY_AUTH", "XDG_"))}
        env.update(HOME=str(self.home), DOCKER_CONFIG=str(docker), PATH=f"{bin_dir}:{env['PATH']}",
                   KILN_REGISTRY_BACKOFF="0.05", KILN_REGISTRY_RETRIES="1", NO_COLOR="1")
        config: dict = {}
        if source == "env":
            env.update(KILN_REGISTRY_USER=user, KILN_REGISTRY_PASSWORD=secret)
        elif source == "auths":
            config = {"auths": {host: {"auth": base64.b64encode(f"{user}:{secret}".encode()).decode()}}}
        elif source in ("credHelpers", "credsStore"):
            config = {"credHelpers": {host: HELPER}} if source == "credHelpers" else {"credsStore": HELPER}
            self.write_helper(host, user, secret)
        else:
            raise ValueError(source)
        (docker / "config.json").write_text(json.dumps(config))
        return env

    def write_helper(self, host: str, user: str, secret: str, *, broken: str | None = None) -> None:
        """``docker-credential-kilntest``: answers ``get`` for ``host``; logs each call."""
        script = self.secrets / "bin" / f"docker-credential-{HELPER}"
        log = self.secrets / "helper.log"
        answer = json.dumps({"ServerURL": host, "Username": user, "Secret": secret})
        if broken == "exit":  # fails, and prints the secret on stderr as some helpers do
            body = f'echo "helper failed for {secret}" >&2; exit 1'
        elif broken == "garbage":
            body = f"echo 'not json {secret}'"
        else:
            body = (f'if [ "$server" = "{host}" ]; then echo \'{answer}\'; '
                    'else echo "credentials not found in native keychain"; exit 1; fi')
        script.write_text(f'#!/bin/sh\nread -r server\necho "$1 $server" >> "{log}"\n{body}\n')
        script.chmod(0o755)

    def helper_calls(self) -> list[str]:
        log = self.secrets / "helper.log"
        return log.read_text().splitlines() if log.exists() else []

    def build(self, env: dict, pins: Path, mirror: str, *extra: str) -> subprocess.CompletedProcess:
        argv = ["--pins", str(pins), "--images", str(IMAGES),
                "build", "--image", "e2e-p65", "--pin", "v0.20.1", "--sm", "120", "--mirror", mirror,
                "--oci", str(self.out / "layout"), "--docker-archive", str(self.out / "image.tar"), *extra]
        return subprocess.CompletedProcess(argv, *run_kiln(*argv, env=env, cwd=self.root, timeout=300))

    def assert_no_output(self) -> None:
        """Neither the layout nor the archive, nor a staged piece of them (outputs share ``out/``)."""
        assert not self.out.exists() or list(self.out.iterdir()) == []

    def leaks(self, result: subprocess.CompletedProcess, needles: list[bytes], *more: Path) -> list[str]:
        return find_leaks(needles, {"stdout": result.stdout, "stderr": result.stderr},
                          [p for p in (self.home, self.out, *more) if p.exists()])


def _pins(root: Path, registry: RegistryServer) -> Path:
    path = root / "pins.toml"
    digest = registry.digest_of(f"vllm/vllm-openai:v{VLLM_VERSION}")
    path.write_text('[pins."v0.20.1"]\nrole = "current"\nimage = "docker.io/vllm/vllm-openai:v0.20.1"\n'
                    f'vllm = "{VLLM_VERSION}"\ncuda = "cu130"\ndigest = "{digest}"\n')
    return path


def _push_args(host: str, repository: str) -> tuple[str, ...]:
    return ("--push", "--repository", f"{host}/{repository}", "--insecure-registry", host, "--json")


def _error_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("error: "), result.stderr
    print(f"kiln said: {lines[-1]}")
    return lines[-1]


@pytest.fixture(scope="module")
def canary_registries(start_registry, base_layout) -> dict[str, RegistryServer]:
    """Basic-auth and token registries whose testuser password is the canary, holding the base."""
    servers = {}
    for flavour in ("basic", "token"):
        server = start_registry(flavour, password=CANARY)
        server.push(base_layout.oci("base"), f"vllm/vllm-openai:v{VLLM_VERSION}")
        servers[flavour] = server
    return servers


def _needles(server: RegistryServer) -> list[bytes]:
    tokens = [t.encode() for t in server.token_server.issued] if server.token_server else []
    return secret_forms(USER, CANARY) + tokens


# -- builds that succeed ------------------------------------------------------------------------


@pytest.mark.parametrize("flavour", ["basic", "token"])
@pytest.mark.parametrize("source", SOURCES)
def test_reliability_credentials_used_and_never_written(tmp_path, canary_registries, flavour, source):
    server = canary_registries[flavour]
    box = Sandbox(tmp_path)
    env = box.configure(source, server.host, USER, CANARY)
    repository = f"test/creds-{flavour}-{source.lower()}"
    result = box.build(env, _pins(tmp_path, server), server.mirror, *_push_args(server.host, repository))
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert tag_state(server.host, repository, TAG, f"{USER}:{CANARY}") == "complete"
    assert server.digest_of(f"{repository}:{TAG}") == summary["manifest_digest"]
    if source in ("credHelpers", "credsStore"):
        assert f"get {server.host}" in box.helper_calls()  # the helper, not some other source, answered
    pushed = server.root / "data"  # the registry's storage of the image kiln pushed
    leaks = box.leaks(result, _needles(server), pushed)
    assert leaks == []
    assert_cache_verified(box.home / ".cache" / "kiln")


# -- builds that fail -----------------------------------------------------------------------------


@pytest.mark.parametrize("flavour", ["basic", "token"])
@pytest.mark.parametrize("source", SOURCES)
def test_reliability_wrong_password_fails_without_echoing_it(tmp_path, registry_basic, registry_token,
                                                             flavour, source):
    server = registry_basic if flavour == "basic" else registry_token  # they expect testpass
    box = Sandbox(tmp_path)
    env = box.configure(source, server.host, USER, CANARY)
    result = box.build(env, _pins(tmp_path, server), server.mirror, *_push_args(server.host, "test/wrong"))
    line = _error_line(result)
    assert ("credentials rejected" if flavour == "basic" else "refused") in line
    assert f"user '{USER}'" in line  # who was tried, and from where ...
    assert box.leaks(result, _needles(server)) == []  # ... never with what
    box.assert_no_output()


@pytest.mark.parametrize("flavour", ["basic", "token"])
def test_reliability_401_on_push_fails_without_echoing_credentials(tmp_path, canary_registries, flavour):
    server = canary_registries[flavour]
    proxy = FaultProxy(server.host)
    try:
        if flavour == "token":
            # from the 2nd POST on: the 1st (the push check's) gets the registry's own challenge, whose
            # realm the proxy's refusals then name
            proxy.add(Fault("POST", r"/blobs/uploads/", "expire_token", nth=2, times=None))
        else:
            proxy.add(Fault("POST", r"/blobs/uploads/", "status", status=401, times=None,
                            headers={"Www-Authenticate": 'Basic realm="basic-realm"'}))
        box = Sandbox(tmp_path)
        env = box.configure("auths", proxy.host, USER, CANARY)
        result = box.build(env, _pins(tmp_path, server), proxy.mirror, *_push_args(proxy.host, "test/denied"))
        line = _error_line(result)
        assert "access denied" in line or "credentials rejected" in line
        sent = [s.headers.get("Authorization", "") for s in proxy.seen]
        assert any(sent), "the credentials were used at all"
        assert box.leaks(result, _needles(server)) == []
        assert tag_state(server.host, "test/denied", TAG, f"{USER}:{CANARY}") == "absent"
    finally:
        proxy.stop()


def test_reliability_unreachable_registry_fails_without_echoing_credentials(tmp_path, canary_registries):
    server = canary_registries["basic"]
    nowhere = f"127.0.0.1:{free_port()}"
    box = Sandbox(tmp_path)
    env = box.configure("auths", nowhere, USER, CANARY)
    config = json.loads((box.secrets / "docker/config.json").read_text())
    config["auths"][server.host] = config["auths"][nowhere]  # the pull side authenticates too
    (box.secrets / "docker/config.json").write_text(json.dumps(config))
    result = box.build(env, _pins(tmp_path, server), server.mirror, *_push_args(nowhere, "test/nowhere"))
    assert "unreachable" in _error_line(result)
    assert box.leaks(result, _needles(server)) == []
    box.assert_no_output()


@pytest.mark.parametrize("broken", ["exit", "garbage"])
def test_reliability_failing_credential_helper_output_is_not_echoed(tmp_path, canary_registries, broken):
    server = canary_registries["basic"]
    box = Sandbox(tmp_path)
    env = box.configure("credHelpers", server.host, USER, CANARY)
    box.write_helper(server.host, USER, CANARY, broken=broken)
    result = box.build(env, _pins(tmp_path, server), server.mirror, *_push_args(server.host, "test/helper"))
    line = _error_line(result)
    assert f"docker-credential-{HELPER}" in line
    assert box.leaks(result, _needles(server)) == []


def test_reliability_netrc_is_not_a_credential_source(tmp_path, registry_plain):
    """requests would add ~/.netrc logins to every request; kiln's sources are the three above."""
    proxy = FaultProxy(registry_plain.host)
    try:
        box = Sandbox(tmp_path)
        env = box.configure("auths", "elsewhere.example", USER, "unused")
        (box.home / ".netrc").write_text(f"machine 127.0.0.1 login netrcuser password {CANARY}\n")
        (box.home / ".netrc").chmod(0o600)
        result = box.build(env, _pins(tmp_path, registry_plain), proxy.mirror,
                           *_push_args(proxy.host, "test/netrc"))
        assert result.returncode == 0, result.stderr
        assert [s.headers["Authorization"] for s in proxy.seen if "Authorization" in s.headers] == []
        needles = secret_forms("netrcuser", CANARY)
        assert box.leaks(result, needles, registry_plain.root / "data") == [f"{CANARY.encode()[:12]!r}... in {box.home / '.netrc'}"]
    finally:
        proxy.stop()


def test_reliability_credentials_absent_from_reprs_and_exceptions(registry_basic):
    """In-process: the objects holding credentials and the errors about them."""
    creds = Credentials(USER, CANARY, "test")
    assert CANARY not in repr(creds) and CANARY not in str(creds)
    host = registry_basic.host
    session = registry_session()
    auth = RegistryAuth(host, session, verify=False, credentials=creds)
    client = RegistryClient(Endpoint(host, host, insecure=True), session=session, auth=auth)
    with pytest.raises(KilnError) as caught:
        client.resolve("vllm/vllm-openai", f"v{VLLM_VERSION}")
    assert "credentials rejected" in str(caught.value)
    rendered = [repr(caught.value), str(caught.value), "".join(traceback.format_exception(caught.value)),
                repr(auth.credentials), str(auth.credentials), repr(client.stats)]
    for form in secret_forms(USER, CANARY):
        assert not any(form.decode() in text for text in rendered), form


def test_reliability_credentials_never_sent_to_a_plain_http_token_realm():
    """A TLS registry whose challenge names an http:// realm does not get the login in clear."""
    auth = RegistryAuth("registry.example:443", registry_session(), verify=True,
                        credentials=Credentials(USER, CANARY, "test"))
    challenge = requests.Response()
    challenge.status_code = 401
    challenge.headers["Www-Authenticate"] = 'Bearer realm="http://127.0.0.1:9/token",service="s"'
    scopes = auth.retry_scopes(challenge, {"repository:a/b:pull"}, sent_auth=False, attempt=0)
    with pytest.raises(KilnError, match=r"token service http://127.0.0.1:9/token is not HTTPS; refusing") as caught:
        auth.headers(scopes)
    assert auth.token_requests == 0 and CANARY not in str(caught.value)


# -- TLS ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tls_registry(tmp_path_factory, base_layout):
    """docker-registry over HTTPS with a self-signed certificate for 127.0.0.1, holding the base."""
    root = tmp_path_factory.mktemp("registry-tls")
    run("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", root / "key.pem",
        "-out", root / "cert.pem", "-days", "2", "-subj", "/CN=127.0.0.1",
        "-addext", "subjectAltName=IP:127.0.0.1", "-addext", "basicConstraints=critical,CA:TRUE")
    port = free_port()
    (root / "data").mkdir()
    (root / "config.yml").write_text(
        f"version: 0.1\nstorage:\n  filesystem:\n    rootdirectory: {root}/data\n"
        f"http:\n  addr: 127.0.0.1:{port}\n  tls:\n    certificate: {root}/cert.pem\n    key: {root}/key.pem\n")
    with open(root / "log.txt", "wb") as log:
        process = subprocess.Popen(["docker-registry", "serve", str(root / "config.yml")],
                                   stdout=log, stderr=subprocess.STDOUT, preexec_fn=dies_with_us())
    server = RegistryServer("tls", f"127.0.0.1:{port}", root, process.pid)
    try:
        for _ in range(150):
            try:
                requests.get(f"https://{server.host}/v2/", verify=str(root / "cert.pem"), timeout=1)
                break
            except requests.RequestException:
                time.sleep(0.1)
        server.push(base_layout.oci("base"), f"vllm/vllm-openai:v{VLLM_VERSION}")
        yield server
    finally:
        server.stop()


def _tls_build(tmp_path, server, *extra: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    box = Sandbox(tmp_path)
    env = box.configure("auths", "elsewhere.example", USER, "unused")
    env.update(env_extra or {})
    return box.build(env, _pins(tmp_path, server), f"docker.io={server.host}", "--json", *extra)


def test_reliability_tls_self_signed_is_refused_by_default(tmp_path, tls_registry):
    result = _tls_build(tmp_path, tls_registry)
    line = _error_line(result)
    assert f"{tls_registry.host}: TLS certificate not trusted" in line and "self-signed" in line, line
    assert "--insecure-registry https://" in line
    Sandbox(tmp_path).assert_no_output()


def test_reliability_tls_self_signed_accepted_when_marked_insecure(tmp_path, tls_registry):
    result = _tls_build(tmp_path, tls_registry, "--insecure-registry", f"https://{tls_registry.host}")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["base_digest"] == tls_registry.digest_of(f"vllm/vllm-openai:v{VLLM_VERSION}")


def test_reliability_tls_private_ca_verified_through_ca_bundle(tmp_path, tls_registry):
    result = _tls_build(tmp_path, tls_registry, env_extra={"REQUESTS_CA_BUNDLE": str(tls_registry.root / "cert.pem")})
    assert result.returncode == 0, result.stderr
