"""Bounded work on hostile bases and stalling registries (``kiln.oci.limits``).

Every build goes through a ``FaultProxy`` standing in for Docker Hub, so the tests see which
blobs kiln asked for. Each exceeded limit fails cleanly: exit 2, one ``error:`` line naming
the limit and the option and variable that raise it, no tag, no output, a verified cache.
Small limits (set by option or environment) keep the tests fast; the defaults are checked to
let real-sized work through and to leave untouched what the walk does not need.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support import TEST_IMAGES
from tests.support.faultproxy import Fault, FaultProxy
from tests.support.hostile import OCI_LAYER_ZSTD, Images, entry, tar_layer, zeros_layer
from tests.support.registry import VLLM_VERSION
from tests.support.reliability_checks import (
    CliRun,
    assert_cache_verified,
    assert_one_line_error,
    run_build,
    tag_state,
)

pytestmark = [pytest.mark.registry, pytest.mark.reliability]

TAG = f"cu130-sm120-v{VLLM_VERSION}"
FAST_RETRIES = {"KILN_REGISTRY_RETRIES": "3", "KILN_REGISTRY_BACKOFF": "0.05", "KILN_REGISTRY_BACKOFF_MAX": "0.2"}
MiB, GiB = 1 << 20, 1 << 30


@pytest.fixture(autouse=True)
def fast_retries(monkeypatch):
    for name, value in FAST_RETRIES.items():
        monkeypatch.setenv(name, value)


@pytest.fixture(scope="module")
def images(registry_plain) -> Images:
    return Images(registry_plain)


@pytest.fixture
def proxy(registry_plain):
    proxy = FaultProxy(registry_plain.host)
    yield proxy
    proxy.stop()


class Build:
    def __init__(self, root: Path, registry, proxy: FaultProxy):
        self.root, self.registry, self.proxy = root, registry, proxy
        self.dest = "test/" + re.sub(r"[^a-z0-9]+", "-", root.name.lower()).strip("-")

    def run(self, tag: str, digest: str, *extra: str, oci: bool = True) -> CliRun:
        pins = self.root / "pins.toml"
        pins.write_text(f'[pins."v0.20.1"]\nrole = "current"\nimage = "docker.io/vllm/vllm-openai:{tag}"\n'
                        f'vllm = "{VLLM_VERSION}"\ncuda = "cu130"\ndigest = "{digest}"\n')
        return run_build(["--pins", str(pins), "--images", str(TEST_IMAGES), "build", "--image", "e2e-p65",
                        "--pin", "v0.20.1", "--sm", "120", "--mirror", self.proxy.mirror, "--json",
                        *(["--oci", str(self.root / "out")] if oci else []),
                        "--push", "--repository", f"{self.proxy.host}/{self.dest}",
                        "--insecure-registry", self.proxy.host, *extra])

    def base(self, *extra: str) -> CliRun:
        return self.run(f"v{VLLM_VERSION}", self.registry.digest_of(f"vllm/vllm-openai:v{VLLM_VERSION}"), *extra)

    def failed_cleanly(self, run: CliRun, *expected: str) -> str:
        line = assert_one_line_error(run, *expected)
        assert tag_state(self.registry.host, self.dest, TAG) == "absent"
        assert not (self.root / "out").exists()
        assert [p.name for p in self.root.iterdir() if ".kiln-" in p.name] == []
        assert_cache_verified(self.root / "kiln-cache")
        return line

    def fetched(self, digest: str) -> int:
        return len(self.proxy.requests("GET", f"/blobs/{digest}"))


@pytest.fixture
def build(tmp_path, registry_plain, proxy) -> Build:
    return Build(tmp_path, registry_plain, proxy)


# -- decompressed bytes ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def bomb(images) -> tuple[str, str]:
    """8 GiB of zeros outside vllm/ in a top layer of about 8 MB (the shape seen in the issue)."""
    blob, diff_id = zeros_layer("usr/lib/x86_64-linux-gnu/libbomb.so", 8 * GiB)
    assert len(blob) < 16 * MiB
    return images.with_top_layer("bomb-8g", blob, diff_id)


@pytest.mark.parametrize("how", ["option", "environment"])
def test_bomb_layer_stops_at_the_layer_limit(build, bomb, monkeypatch, how):
    digest, layer = bomb
    if how == "option":
        run = build.run("bomb-8g", digest, "--max-layer-bytes", "64M")
    else:
        monkeypatch.setenv("KILN_MAX_LAYER_BYTES", "64MiB")
        run = build.run("bomb-8g", digest)
    line = build.failed_cleanly(run, f"layer {layer}", "decompresses to more than 64 MiB, kiln's limit for one "
                                "layer (raise it with --max-layer-bytes or KILN_MAX_LAYER_BYTES)")
    assert "Traceback" not in run.err
    assert "64 MiB" in line


def test_a_zstd_bomb_stops_at_the_layer_limit_as_a_gzip_one_does(build, images):
    """8 GiB of zeros in zstd frames (a few KB: zstd's ratio is higher than gzip's) as the top
    layer: stopped at the same limit, with the same message."""
    blob, diff_id = zeros_layer("usr/lib/x86_64-linux-gnu/libbomb.so", 8 * GiB, "zstd")
    assert len(blob) < 1 * MiB
    digest, layer = images.with_top_layer("bomb-8g-zstd", blob, diff_id, media_type=OCI_LAYER_ZSTD)
    run = build.run("bomb-8g-zstd", digest, "--max-layer-bytes", "64M")
    build.failed_cleanly(run, f"layer {layer}", "decompresses to more than 64 MiB, kiln's limit for one "
                         "layer (raise it with --max-layer-bytes or KILN_MAX_LAYER_BYTES)")


def test_bomb_below_the_vllm_layer_is_never_decompressed(build, images, registry_plain):
    """Default limits: a bomb under the layers holding vLLM is never decompressed; the build
    reads only the top two layers. A push (mounted from the base) never even fetches it; an
    ``--oci`` layout needs every blob, so there it is copied, compressed, as it is."""
    blob, diff_id = zeros_layer("opt/bomb.bin", 8 * GiB)
    digest, [layer] = images.with_layers_at("bomb-below", [(1, blob, diff_id)])
    pushed = build.run("bomb-below", digest, oci=False).result
    assert build.fetched(layer) == 0
    assert pushed["bytes_decompressed"] < 256 * MiB
    assert tag_state(registry_plain.host, build.dest, TAG) == "complete"
    laid_out = build.run("bomb-below", digest).result
    assert build.fetched(layer) == 1
    assert laid_out["bytes_decompressed"] == 0  # the source tree was cached by the first build
    assert (build.root / "out/blobs/sha256" / layer.split(":")[1]).stat().st_size == len(blob)


def test_a_large_layer_under_the_default_limit_is_read(build, images):
    """1 GiB outside vllm/ in the top layer: under the defaults it is decompressed (gzip cannot
    skip) and the build completes; the summary counts what was inflated."""
    blob, diff_id = zeros_layer("opt/big.bin", 1 * GiB)
    digest, _ = images.with_top_layer("big-1g", blob, diff_id)
    result = build.run("big-1g", digest).result
    assert result["bytes_decompressed"] > 1 * GiB


def test_layers_read_together_stop_at_the_build_limit(build):
    line = build.failed_cleanly(build.base("--max-build-bytes", "2M"), "kiln's limit for one build",
                                "raise it with --max-build-bytes or KILN_MAX_BUILD_BYTES")
    assert "more than 2 MiB" in line


# -- layer count -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def deep(images) -> tuple[str, int]:
    """The base under 300 small layers (each adds a file outside vllm/)."""
    inserted = []
    for i in range(300):
        blob, raw = tar_layer([entry(f"etc/deep/{i}", data=f"{i}\n".encode())])
        inserted.append((len(images.base.manifest["layers"]), blob, "sha256:" + __import__("hashlib").sha256(raw).hexdigest()))
    digest, _ = images.with_layers_at("deep-300", inserted)
    return digest, len(images.base.manifest["layers"]) + 300


def test_too_many_layers_is_refused_before_any_is_fetched(build, deep):
    digest, count = deep
    run = build.run("deep-300", digest)
    build.failed_cleanly(run, f"{count} layers, over kiln's limit of 256",
                         "raise it with --max-layers or KILN_MAX_LAYERS")
    gets = [s.path for s in build.proxy.requests("GET", r"/blobs/")]
    assert len(gets) == 1  # the config only


def test_max_layers_raises_the_cap(build, deep):
    digest, count = deep
    result = build.run("deep-300", digest, "--max-layers", str(count)).result
    assert result["manifest_digest"]


# -- time ------------------------------------------------------------------------------------


def _vllm_layer(base_layout) -> str:
    return f"/blobs/{base_layout.layers['vllm']}"


def test_deadline_stops_a_stalled_download(build, base_layout):
    build.proxy.add(Fault("GET", _vllm_layer(base_layout), "stall", after=100_000, pause=60, times=None))
    run = build.base("--deadline", "3s")
    build.failed_cleanly(run, "the build ran past its deadline of 3 s",
                         "raise it with --deadline or KILN_BUILD_DEADLINE")


def test_stall_is_reported_while_waiting(build, base_layout, registry_plain):
    build.proxy.add(Fault("GET", _vllm_layer(base_layout), "stall", after=100_000, pause=2))
    run = build.base("--stall-warning", "0.5")
    result = run.result
    assert tag_state(registry_plain.host, build.dest, TAG) == "complete"
    [warning] = [w for w in result["warnings"] if "no bytes for" in w]
    print(f"kiln warned: {warning}")
    assert base_layout.layers["vllm"] in warning and "still waiting for the registry" in warning
    assert "--read-timeout or KILN_REGISTRY_READ_TIMEOUT" in warning
    assert "warning:" in run.err and "no bytes for" in run.err  # shown as it happens, not only in --json


def test_read_timeout_resumes_the_download(build, base_layout, registry_plain, monkeypatch):
    monkeypatch.setenv("KILN_REGISTRY_READ_TIMEOUT", "1")
    build.proxy.add(Fault("GET", _vllm_layer(base_layout), "stall", after=700_000, pause=10))
    run = build.base()
    assert run.result["manifest_digest"]
    first, second = build.proxy.requests("GET", _vllm_layer(base_layout))[:2]
    assert first.fault == "stall" and "Range" not in first.headers
    resumed = re.fullmatch(r"bytes=(\d+)-", second.headers.get("Range", ""))
    assert resumed and 0 < int(resumed.group(1)) <= 700_000  # continued, not started over
    assert tag_state(registry_plain.host, build.dest, TAG) == "complete"


def test_read_timeout_that_keeps_expiring_fails_naming_it(build, base_layout):
    build.proxy.add(Fault("GET", _vllm_layer(base_layout), "stall", after=100_000, pause=10, times=None))
    run = build.base("--read-timeout", "0.5")
    build.failed_cleanly(run, "no answer within the read timeout of 0.5 s",
                         "raise it with --read-timeout or KILN_REGISTRY_READ_TIMEOUT", "giving up")


@pytest.mark.parametrize("option, value, expected", [
    ("--max-layer-bytes", "lots", "expected a size like 32GiB"),
    ("--deadline", "-1", "expected a duration like 2h"),
    ("--max-layers", "0", "expected a whole number of at least 1"),
])
def test_bad_limit_values_are_usage_errors(build, option, value, expected):
    run = build.base(option, value)
    assert_one_line_error(run, option, expected)
    assert build.proxy.requests() == []


def test_bad_limit_in_the_environment_is_one_line(build, monkeypatch):
    monkeypatch.setenv("KILN_BUILD_DEADLINE", "soon")
    run = build.base()
    assert_one_line_error(run, "$KILN_BUILD_DEADLINE='soon'", "expected a duration")
    assert build.proxy.requests() == []
