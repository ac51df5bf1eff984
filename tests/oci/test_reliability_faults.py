"""Fault injection: real builds through ``FaultProxy`` in front of a real docker-registry.

Each test breaks one thing on the wire and checks that the build either completes with the
same manifest digest as a clean build, or fails with one ``error:`` line; and in every case
that the destination tag is absent or names a complete image (skopeo copies all of it), no
local output is half-written, and every blob in the cache matches its digest.
The rows of ``docs/RELIABILITY.md`` ("Fault injection") are these tests.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from kiln.oci.endpoints import Endpoint
from kiln.oci.registry import RegistryClient
from tests.support import TEST_IMAGES
from tests.support.faultproxy import Fault, FaultProxy
from tests.support.registry import VLLM_VERSION, read_blob
from tests.support.reliability_checks import (
    CliRun,
    assert_cache_verified,
    assert_one_line_error,
    run_build,
    tag_state,
)

pytestmark = [pytest.mark.registry, pytest.mark.reliability]

IMAGES = TEST_IMAGES
IMAGE, SM = "e2e-p65", 120
TAG = f"cu130-sm{SM}-v{VLLM_VERSION}"
FAST_RETRIES = {"KILN_REGISTRY_RETRIES": "3", "KILN_REGISTRY_BACKOFF": "0.05", "KILN_REGISTRY_BACKOFF_MAX": "0.2"}


@pytest.fixture(autouse=True)
def fast_retries(monkeypatch):
    for name, value in FAST_RETRIES.items():
        monkeypatch.setenv(name, value)


def _pins(root: Path, digest: str) -> Path:
    path = root / "pins.toml"
    path.write_text('[pins."v0.20.1"]\nrole = "current"\nimage = "docker.io/vllm/vllm-openai:v0.20.1"\n'
                    f'vllm = "{VLLM_VERSION}"\ncuda = "cu130"\ndigest = "{digest}"\n')
    return path


def _argv(pins: Path, mirror: str, *extra: str) -> list[str]:
    return ["--pins", str(pins), "--images", str(IMAGES), "build", "--image", IMAGE, "--pin", "v0.20.1",
            "--sm", str(SM), "--mirror", mirror, "--json", *extra]


@pytest.fixture(scope="module")
def clean_digest(registry_plain, tmp_path_factory) -> str:
    """The manifest digest of a build with no fault (straight to the registry)."""
    root = tmp_path_factory.mktemp("clean-build")
    with pytest.MonkeyPatch.context() as env:
        for name in ("REGISTRY_AUTH_FILE", "KILN_REGISTRY_USER", "KILN_REGISTRY_PASSWORD"):
            env.delenv(name, raising=False)
        env.setenv("DOCKER_CONFIG", str(root / "docker-config"))
        env.setenv("KILN_REGISTRIES", str(root / "registries.toml"))
        env.setenv("KILN_CACHE_DIR", str(root / "cache"))
        pins = _pins(root, registry_plain.digest_of(f"vllm/vllm-openai:v{VLLM_VERSION}"))
        return run_build(_argv(pins, registry_plain.mirror)).result["manifest_digest"]


@dataclass
class Rig:
    """A build whose base and push both go through ``proxy`` in front of ``registry``."""

    root: Path
    registry: object  # RegistryServer
    proxy: FaultProxy
    layers: dict[str, str]  # role -> base layer digest
    creds: str | None = None

    @property
    def dest(self) -> str:
        return "test/" + re.sub(r"[^a-z0-9]+", "-", self.root.name.lower()).strip("-")

    @property
    def cache(self) -> Path:
        return self.root / "kiln-cache"

    @property
    def out(self) -> Path:
        return self.root / "out"

    def build(self, *extra: str, push_via: FaultProxy | None = None) -> CliRun:
        target = push_via or self.proxy
        pins = _pins(self.root, self.registry.digest_of(f"vllm/vllm-openai:v{VLLM_VERSION}"))
        return run_build(_argv(pins, self.proxy.mirror, "--oci", str(self.out), "--push",
                             "--repository", f"{target.host}/{self.dest}", "--insecure-registry", target.host,
                             *extra))

    def tag(self, registry=None) -> str:
        return tag_state((registry or self.registry).host, self.dest, TAG, self.creds)

    def assert_complete(self, run: CliRun, clean_digest: str) -> dict:
        result = run.result
        assert result["manifest_digest"] == clean_digest
        assert self.tag() == "complete"
        assert (self.out / "index.json").is_file()
        assert_cache_verified(self.cache)
        return result

    def assert_failed_cleanly(self, run: CliRun, *expected: str) -> str:
        line = assert_one_line_error(run, *expected)
        assert self.tag() == "absent"
        assert not self.out.exists()
        assert [p.name for p in self.root.iterdir() if p.name.startswith(".out")] == []
        assert_cache_verified(self.cache)
        return line

    def vllm_blob(self) -> str:
        return f"/blobs/{self.layers['vllm']}"


@pytest.fixture
def proxy(registry_plain):
    proxy = FaultProxy(registry_plain.host)
    yield proxy
    proxy.stop()


@pytest.fixture
def rig(tmp_path, registry_plain, proxy, base_layout) -> Rig:
    return Rig(tmp_path, registry_plain, proxy, base_layout.layers)


# -- pull side -----------------------------------------------------------------------------------


def test_reliability_5xx_on_resolve_and_blob_downloads_are_retried(rig, clean_digest):
    rig.proxy.add(Fault("HEAD", r"/manifests/v0\.20\.1$", "status", status=503),
                  Fault("GET", rig.vllm_blob(), "status", status=500),
                  Fault("GET", f"/blobs/{rig.layers['app']}", "status", status=502))
    rig.assert_complete(rig.build(), clean_digest)
    assert all(f.fired == 1 for f in rig.proxy.faults)
    # each failed request was sent again, and answered
    assert [s.status for s in rig.proxy.requests("GET", rig.vllm_blob())] == [500, 200]


def test_reliability_429_retry_after_is_honoured(rig, clean_digest):
    rig.proxy.add(Fault("GET", rig.vllm_blob(), "status", status=429, headers={"Retry-After": "1"}))
    rig.assert_complete(rig.build(), clean_digest)
    first, second = rig.proxy.requests("GET", rig.vllm_blob())
    assert first.status == 429 and second.status == 200
    assert second.at - first.at >= 1.0  # waited as asked, not the 0.05 s backoff


def test_reliability_429_retry_after_is_capped(rig, clean_digest, monkeypatch):
    monkeypatch.setenv("KILN_REGISTRY_RETRY_AFTER_MAX", "0.5")
    rig.proxy.add(Fault("GET", rig.vllm_blob(), "status", status=429, headers={"Retry-After": "3600"}))
    rig.assert_complete(rig.build(), clean_digest)
    first, second = rig.proxy.requests("GET", rig.vllm_blob())
    assert 0.5 <= second.at - first.at < 60


def _resumed_from(rig: Rig) -> int:
    first, second = rig.proxy.requests("GET", rig.vllm_blob())
    assert first.fault in ("reset", "truncate") and "Range" not in first.headers
    match = re.fullmatch(r"bytes=(\d+)-", second.headers.get("Range", ""))
    assert match, second.headers
    return int(match.group(1))


def test_reliability_connection_reset_mid_download_resumes_with_range(rig, clean_digest):
    rig.proxy.add(Fault("GET", rig.vllm_blob(), "reset", after=700_000))
    rig.assert_complete(rig.build(), clean_digest)
    offset = _resumed_from(rig)
    assert 0 < offset <= 700_000  # continued near where the stream broke, not from byte 0


def test_reliability_truncated_body_resumes_with_range(rig, clean_digest):
    rig.proxy.add(Fault("GET", rig.vllm_blob(), "truncate", after=200_000))
    rig.assert_complete(rig.build(), clean_digest)
    assert _resumed_from(rig) == 200_000


def test_reliability_reset_when_registry_ignores_range_restarts_the_blob(rig, clean_digest):
    rig.proxy.strip_range = True  # the registry answers 200 + the whole blob to a Range request
    rig.proxy.add(Fault("GET", rig.vllm_blob(), "reset", after=300_000))
    rig.assert_complete(rig.build(), clean_digest)
    assert [s.status for s in rig.proxy.requests("GET", rig.vllm_blob())] == [200, 200]


def test_reliability_download_that_keeps_breaking_fails_cleanly(rig):
    rig.proxy.add(Fault("GET", rig.vllm_blob(), "reset", after=100_000, times=None))
    line = rig.assert_failed_cleanly(rig.build(), rig.layers["vllm"], "giving up")
    assert "connection reset" in line
    assert len(rig.proxy.requests("GET", rig.vllm_blob())) == 4  # 1 + KILN_REGISTRY_RETRIES resumes
    assert not (rig.cache / "blobs/sha256" / rig.layers["vllm"].split(":")[1]).exists()


def test_reliability_corrupted_blob_is_refused_and_never_cached(rig, clean_digest):
    rig.proxy.add(Fault("GET", rig.vllm_blob(), "corrupt", after=150_000))
    rig.assert_failed_cleanly(rig.build(), rig.layers["vllm"], "digest mismatch")
    assert not (rig.cache / "blobs/sha256" / rig.layers["vllm"].split(":")[1]).exists()
    # the fault was transient: the same command now completes, with the clean digest
    rig.assert_complete(rig.build(), clean_digest)


def test_reliability_corrupted_manifest_is_refused(rig):
    rig.proxy.add(Fault("GET", r"/manifests/sha256:", "corrupt", after=40))
    rig.assert_failed_cleanly(rig.build(), "manifest digest mismatch")  # and nothing corrupt cached


# -- push side -----------------------------------------------------------------------------------


def test_reliability_5xx_on_upload_and_manifest_put_are_retried(rig, clean_digest):
    rig.proxy.add(Fault("POST", r"/blobs/uploads/$", "status", status=503),
                  Fault("PUT", r"/blobs/uploads/", "status", status=502),
                  Fault("PUT", r"/manifests/", "status", status=500))
    rig.assert_complete(rig.build(), clean_digest)
    assert all(f.fired == 1 for f in rig.proxy.faults)
    # the upload whose PUT failed was started over in a fresh session (a new POST)
    posts = [s for s in rig.proxy.requests("POST", r"/blobs/uploads/$") if "mount=" not in s.query]
    puts = rig.proxy.requests("PUT", r"/blobs/uploads/")
    assert puts[0].status == 502 and any(p.at > puts[0].at for p in posts)


def test_reliability_reset_mid_upload_restarts_the_session(rig, clean_digest, start_registry):
    other = start_registry("plain")
    push_proxy = FaultProxy(other.host)
    try:
        push_proxy.add(Fault("PUT", r"/blobs/uploads/", "reset_upload", after=512 * 1024))
        run = rig.build(push_via=push_proxy)
        assert run.result["manifest_digest"] == clean_digest, run.err
        assert push_proxy.faults[0].fired == 1
        assert rig.tag(other) == "complete"
        reset = next(s for s in push_proxy.requests("PUT", r"/blobs/uploads/") if s.fault)
        assert any(s.at > reset.at for s in push_proxy.requests("POST", r"/blobs/uploads/$"))
        assert_cache_verified(rig.cache)
    finally:
        push_proxy.stop()


def test_reliability_upload_that_keeps_failing_leaves_no_tag(rig):
    rig.proxy.add(Fault("PUT", r"/blobs/uploads/", "reset_upload", after=0, times=None))
    line = rig.assert_failed_cleanly(rig.build(), "upload", "gave up after 4 upload sessions")
    assert line.startswith(f"error: {rig.proxy.host}: connection reset for PUT") and "docker.io" not in line
    assert rig.proxy.requests("PUT", r"/manifests/") == []  # no manifest was ever sent


def test_reliability_manifest_put_that_keeps_failing_leaves_no_tag(rig, clean_digest):
    rig.proxy.add(Fault("PUT", r"/manifests/", "status", status=503, times=None))
    line = rig.assert_failed_cleanly(rig.build(), "HTTP 503", f"{rig.dest}@{clean_digest}")
    # named by the --repository host, although the base came from the same host as docker.io's mirror;
    # the first manifest PUT is the image by digest (its attestations, then the tag, follow it)
    assert line.startswith(f"error: {rig.proxy.host}/{rig.dest}@{clean_digest} (manifest PUT): HTTP 503") \
        and "docker.io" not in line
    assert len(rig.proxy.requests("PUT", r"/manifests/")) == 4  # bounded: 1 + 3 retries


def test_reliability_chunked_upload_reset_restarts_from_byte_zero(registry_plain, proxy):
    """Blobs above 512 MiB go up in PATCH chunks; a chunk cut off mid-way restarts the blob."""
    data = bytes(range(256)) * 4096  # 1 MiB, 4 chunks of 256 KiB
    digest = "sha256:" + __import__("hashlib").sha256(data).hexdigest()
    proxy.add(Fault("PATCH", r"/blobs/uploads/", "reset_upload", nth=3, after=1000))
    client = RegistryClient(Endpoint(proxy.host, proxy.host, insecure=True))
    client.upload_blob("test/chunked", digest, data, chunk_size=256 * 1024)
    assert read_blob(client, "test/chunked", digest) == data
    patches = proxy.requests("PATCH", r"/blobs/uploads/")
    assert len(patches) == 2 + 1 + 4  # two good chunks, the cut one, then all four again
    assert [p.headers["Content-Range"] for p in patches[3:]] == [
        "0-262143", "262144-524287", "524288-786431", "786432-1048575"]
    assert client.stats.upload_restarts == 1


# -- bearer token expiry (token-auth registry) -----------------------------------------------


@pytest.fixture
def token_rig(tmp_path, registry_token, base_layout, monkeypatch):
    monkeypatch.setenv("KILN_REGISTRY_USER", registry_token.username)
    monkeypatch.setenv("KILN_REGISTRY_PASSWORD", registry_token.password)
    proxy = FaultProxy(registry_token.host)
    yield Rig(tmp_path, registry_token, proxy, base_layout.layers,
              creds=f"{registry_token.username}:{registry_token.password}")
    proxy.stop()


def test_reliability_token_expired_mid_build_is_renewed(token_rig, clean_digest, registry_token):
    rig = token_rig
    rig.proxy.add(Fault("GET", rig.vllm_blob(), "expire_token"),
                  # the push's first POST, with the token it got: the two before it are the push
                  # check's (the registry's own 401 challenge, then its upload, opened and cancelled)
                  Fault("POST", r"/blobs/uploads/", "expire_token", nth=3),
                  Fault("PUT", r"/manifests/", "expire_token"))
    tokens_before = len(registry_token.token_server.requests_seen)
    rig.assert_complete(rig.build(), clean_digest)
    assert all(f.fired == 1 for f in rig.proxy.faults)
    for method, path in (("GET", rig.vllm_blob()), ("PUT", r"/manifests/")):
        refused, retried = rig.proxy.requests(method, path)[:2]
        assert refused.status == 401 and retried.status in (200, 201)
        # the retry carried a new token, fetched after the 401
        assert retried.headers["Authorization"] != refused.headers["Authorization"]
    assert len(registry_token.token_server.requests_seen) - tokens_before >= 4


def test_reliability_token_refused_again_fails_once(token_rig):
    rig = token_rig
    rig.proxy.add(Fault("PUT", r"/manifests/", "expire_token", times=None))
    rig.assert_failed_cleanly(rig.build(), "access denied")
    assert len(rig.proxy.requests("PUT", r"/manifests/")) == 2  # one renewal, no loop
