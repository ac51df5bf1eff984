"""A registry that echoes the request's ``Authorization`` in its error: kiln shows the error, never the secret.

kiln puts a registry's error message in its own (``HTTP 403: DENIED: ...``): that is how a user
learns why. A registry (or a proxy in front of one) that quotes the refused request puts
``Basic <base64 user:password>`` or ``Bearer <token>`` in that message. Here a real
``docker-registry`` (Basic auth, or token auth) sits behind the fault proxy, which answers the
authenticated manifest request with 403 and such a message (a Basic credential also decoded);
``build.py values`` runs as a subprocess, and its stdout and stderr are searched for the
password, both base64 forms and every token the token server issued. Row "secrets never
echoed" of docs/RELIABILITY.md.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.oci.test_reliability_credentials import find_leaks, secret_forms
from tests.support import TEST_IMAGES
from tests.support.faultproxy import Fault, FaultProxy
from tests.support.kiln_process import run_kiln
from tests.support.registry import PASSWORD, USER

pytestmark = [pytest.mark.registry, pytest.mark.reliability]

ROOT = Path(__file__).resolve().parents[2]
PINS = '[pins."v0.20.1"]\nrole = "current"\nimage = "docker.io/vllm/vllm-openai:v0.20.1"\n' \
       'vllm = "0.20.1"\ncuda = "cu130"\ndigest = "sha256:' + "0" * 64 + '"\n'


@pytest.fixture(scope="module")
def auth_registries(start_registry):
    """Empty Basic-auth and token-auth registries (testuser / testpass)."""
    return {flavour: start_registry(flavour) for flavour in ("basic", "token")}


def _values(tmp_path: Path, host: str) -> subprocess.CompletedProcess:
    (tmp_path / "pins.toml").write_text(PINS)
    (tmp_path / "home").mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KILN_", "DOCKER_", "REGISTRY_AUTH"))}
    env.update(HOME=str(tmp_path / "home"), DOCKER_CONFIG=str(tmp_path / "docker"), NO_COLOR="1",
               KILN_REGISTRY_USER=USER, KILN_REGISTRY_PASSWORD=PASSWORD, KILN_REGISTRY_RETRIES="1",
               KILN_REGISTRY_BACKOFF="0.05", KILN_CACHE_DIR=str(tmp_path / "cache"))
    argv = ["--pins", str(tmp_path / "pins.toml"), "--images", str(TEST_IMAGES),
            "values", "--image", "e2e-p65", "--pin", "v0.20.1", "--sm", "120",
            "--repository", f"{host}/test/echo", "--insecure-registry", host]
    return subprocess.CompletedProcess(argv, *run_kiln(*argv, env=env, cwd=tmp_path, timeout=120))


@pytest.mark.parametrize("flavour", ["basic", "token"])
def test_reliability_registry_echoing_the_authorization_is_scrubbed(tmp_path, auth_registries, flavour):
    server = auth_registries[flavour]
    proxy = FaultProxy(server.host)
    try:
        proxy.add(Fault("*", r"/manifests/", "status", status=403, times=None,
                        only_with="Authorization", echo="Authorization"))
        result = _values(tmp_path, proxy.host)
        sent = [s.headers["Authorization"] for s in proxy.seen if "Authorization" in s.headers]
    finally:
        proxy.stop()
    assert sent, "the credentials were used at all"
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    (line,) = result.stderr.splitlines()
    print(f"kiln said: {line}")
    scheme = "Basic" if flavour == "basic" else "Bearer"
    # the registry's message is still shown, with the secret cut out of it
    assert line.startswith(f"error: {proxy.host}/test/echo:") and "forbidden (HTTP 403)" in line, line
    assert f"you sent Authorization: {scheme} <redacted>" in line, line
    if flavour == "basic":
        assert f"({USER}:<redacted>)" in line, line
    tokens = [t.encode() for t in server.token_server.issued] if server.token_server else []
    assert len(tokens) == (flavour == "token")
    needles = secret_forms(USER, PASSWORD) + tokens
    echoed = tokens or [needles[1]]  # the Bearer token, or base64 of user:password: sent, and echoed ...
    assert all(any(n.decode() in s for s in sent) for n in echoed)
    assert find_leaks(needles, {"stdout": result.stdout, "stderr": result.stderr}, [tmp_path / "home"]) == []
