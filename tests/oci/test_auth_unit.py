"""Challenges, scopes, credential lookup (no registry needed)."""

import base64
import json
import os
import stat

import pytest

from kiln.errors import KilnError
from kiln.oci.auth import normalise_scopes, parse_challenges
from kiln.oci.credentials import Credentials, find_credentials
from kiln.oci.endpoints import RegistryConfig, parse_mirror

pytestmark = pytest.mark.isolated


def test_parse_bearer_challenge_with_error_and_two_scopes():
    header = ('Bearer realm="https://auth.docker.io/token",service="registry.docker.io",'
              'scope="repository:dst:push,pull repository:src:pull",error="insufficient_scope"')
    (challenge,) = parse_challenges(header)
    assert challenge.scheme == "bearer"
    assert challenge.realm == "https://auth.docker.io/token"
    assert challenge.service == "registry.docker.io"
    assert challenge.scopes == ["repository:dst:push,pull", "repository:src:pull"]
    assert challenge.error == "insufficient_scope"


def test_parse_several_challenges():
    challenges = parse_challenges('Basic realm="basic-realm", Bearer realm="http://t/token",service=s')
    assert [c.scheme for c in challenges] == ["basic", "bearer"]
    assert challenges[1].service == "s"


def test_normalise_scopes_merges_actions():
    assert normalise_scopes(["repository:a:push,pull", "repository:a:pull", "repository:b:pull"]) == {
        "repository:a:pull,push", "repository:b:pull"}


def _write_config(monkeypatch, tmp_path, config: dict):
    directory = tmp_path / "dockercfg"
    directory.mkdir(exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    monkeypatch.setenv("DOCKER_CONFIG", str(directory))


def test_auths_base64_and_docker_hub_key(monkeypatch, tmp_path):
    encoded = base64.b64encode(b"hubuser:s3cret:with:colons").decode()
    _write_config(monkeypatch, tmp_path, {"auths": {
        "https://index.docker.io/v1/": {"auth": encoded},
        "https://ghcr.io": {"username": "gh", "password": "pw"},
    }})
    hub = find_credentials("docker.io")
    assert (hub.username, hub.password) == ("hubuser", "s3cret:with:colons")
    assert "s3cret" not in repr(hub) and "s3cret" not in str(hub)
    assert find_credentials("ghcr.io").username == "gh"
    assert find_credentials("quay.io") is None


def test_env_vars_win(monkeypatch, tmp_path):
    _write_config(monkeypatch, tmp_path, {"auths": {"h:1": {"username": "file", "password": "x"}}})
    monkeypatch.setenv("KILN_REGISTRY_USER", "envuser")
    monkeypatch.setenv("KILN_REGISTRY_PASSWORD", "envpw")
    assert find_credentials("h:1") == Credentials("envuser", "envpw", "KILN_REGISTRY_USER")


def test_registry_auth_file_env(monkeypatch, tmp_path):
    path = tmp_path / "auth.json"
    path.write_text(json.dumps({"auths": {"h:2": {"auth": base64.b64encode(b"u:p").decode()}}}))
    monkeypatch.setenv("REGISTRY_AUTH_FILE", str(path))
    assert find_credentials("h:2").password == "p"


def _helper(tmp_path, monkeypatch, name: str, body: str):
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    script = bindir / f"docker-credential-{name}"
    script.write_text("#!/bin/sh\n" + body)
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")


def test_cred_helper_and_store(monkeypatch, tmp_path):
    _helper(tmp_path, monkeypatch, "fake",
            'read server; echo "{\\"ServerURL\\":\\"$server\\",\\"Username\\":\\"u-$server\\",\\"Secret\\":\\"s\\"}"\n')
    _helper(tmp_path, monkeypatch, "store", 'read server; echo "credentials not found" >&2; exit 1\n')
    _write_config(monkeypatch, tmp_path, {"credHelpers": {"ghcr.io": "fake"}, "credsStore": "store"})
    assert find_credentials("ghcr.io").username == "u-ghcr.io"
    assert find_credentials("quay.io") is None  # the store does not know it: anonymous


def test_missing_helper_is_a_clear_error(monkeypatch, tmp_path):
    _write_config(monkeypatch, tmp_path, {"credHelpers": {"ghcr.io": "nonexistent-helper"}})
    with pytest.raises(KilnError, match="docker-credential-nonexistent-helper"):
        find_credentials("ghcr.io")


def test_mirror_and_insecure_config(tmp_path):
    assert parse_mirror("docker.io=127.0.0.1:5000") == ("docker.io", "127.0.0.1:5000", False)
    assert parse_mirror("docker.io=http://127.0.0.1:5000") == ("docker.io", "127.0.0.1:5000", True)
    with pytest.raises(KilnError, match="REGISTRY=HOST"):
        parse_mirror("docker.io")
    conf = tmp_path / "registries.toml"
    conf.write_text('insecure = ["r.local:443"]\n[mirrors]\n"ghcr.io" = "r.local:443"\n')
    config = RegistryConfig.load(["docker.io=http://127.0.0.1:5000"], path=conf)
    hub = config.endpoint("docker.io")
    assert (hub.host, hub.insecure) == ("127.0.0.1:5000", True)
    assert config.endpoint("ghcr.io").insecure is True
    assert config.endpoint("quay.io").insecure is False  # TLS verified by default
    assert RegistryConfig().endpoint("docker.io").host == "registry-1.docker.io"
    assert config.endpoint("ghcr.io").scheme == "http"
    assert config.endpoint("quay.io").scheme == "https"
    tls = RegistryConfig.load(insecure_options=["https://self.signed:8443"], path=conf).endpoint("self.signed:8443")
    assert (tls.scheme, tls.insecure) == ("https", True)


def test_insufficient_scope_widens_the_scope_set():
    import requests

    from kiln.oci.auth import RegistryAuth

    auth = RegistryAuth("r.example", requests.Session(), credentials=None)
    response = requests.Response()
    response.status_code = 401
    response.headers["Www-Authenticate"] = (
        'Bearer realm="https://auth.example/token",service="svc",'
        'scope="repository:dst:push,pull repository:src:pull",error="insufficient_scope"')
    wanted = auth.retry_scopes(response, {"repository:dst:pull,push"}, sent_auth=True, attempt=1)
    assert wanted == {"repository:dst:pull,push", "repository:src:pull"}
    # the same challenge again, with nothing more to ask for, is a denial
    with pytest.raises(KilnError, match="access denied"):
        auth.retry_scopes(response, wanted, sent_auth=True, attempt=2)
