"""The plain progress lines tell what happened: a push whose blobs were mounted (or already
there) does not count them as pushed bytes, and kernels found in kiln's cache are not reported
as compiled (both were: ``push …: 8 GiB in 0.4s``, ``compiling Triton kernels …: done``)."""

from __future__ import annotations

import json
import re

import pytest

from tests.support import TEST_IMAGES
from tests.support.kiln_process import run_kiln
from tests.support.registry import VLLM_VERSION

pytestmark = pytest.mark.registry

SECONDS = r"\d+\.\d\ds"


def _pins(tmp_path, registry, variant: str = "") -> str:
    name = f"vllm/vllm-openai:v{VLLM_VERSION}{variant}"
    path = tmp_path / f"pins{variant}.toml"
    path.write_text(f'[pins."v0.20.1"]\nrole = "current"\nimage = "docker.io/{name}"\nvllm = "{VLLM_VERSION}"\n'
                    f'cuda = "cu130"\ndigest = "{registry.digest_of(name)}"\n')
    return str(path)


def _build(capsys, pins: str, registry, image: str, *extra: str) -> tuple[dict, list[str]]:
    code, out, err = run_kiln("--pins", pins, "--images", TEST_IMAGES, "build", "--image", image,
                          "--pin", "v0.20.1", "--sm", "120", "--mirror", registry.mirror, "--json",
                          "--progress", "plain", *extra)
    assert code == 0, err
    return json.loads(out), err.splitlines()


def _push_line(lines: list[str], repository: str) -> re.Match:
    [line] = [x for x in lines if x.startswith(f"push {repository} ")]
    match = re.fullmatch(rf"push {re.escape(repository)} \((\d+) blobs? uploaded, (\d+) mounted, (\d+) already there\): "
                         rf"(\d+) bytes \(.+\) in {SECONDS}", line)
    assert match, line
    return match


def test_mounted_blobs_are_not_reported_as_pushed_bytes(tmp_path, capsys, registry_plain, base_layout):
    pins = _pins(tmp_path, registry_plain)
    base = ("rootfs", "filler-cuda", "filler-torch", "vllm", "app")  # the base image's layers
    base_bytes = sum(base_layout.layer_sizes[role] for role in base)
    repositories = [f"test/{tmp_path.name.lower()}-one", f"test/{tmp_path.name.lower()}-two"]
    for repository in repositories:  # the same base, pushed to two repositories of its own registry
        result, lines = _build(capsys, pins, registry_plain, "e2e-p65", "--push", "--repository",
                               f"{registry_plain.host}/{repository}")
        match = _push_line(lines, repository)
        uploaded, mounted, present, sent = (int(g) for g in match.groups())
        assert mounted == result["blobs_mounted"] >= len(base), lines  # the base's layers, from its repository
        assert uploaded >= 1  # kiln's layer and the config are new to the repository
        assert sent < base_bytes, (sent, base_bytes)  # the mounted base is not counted as pushed
        assert sent <= result["bytes_pushed"]
        publish = next(x for x in lines if x.startswith("stage publish: "))
        assert int(publish.split()[2]) == result["bytes_pushed"] < base_bytes


def test_a_kernel_cache_hit_does_not_say_compiling(tmp_path, capsys, registry_plain):
    pins = _pins(tmp_path, registry_plain, "-triton36")
    first, lines = _build(capsys, pins, registry_plain, "e2e-triton")
    [line] = [x for x in lines if x.startswith("Triton kernels for sm_120")]
    assert re.fullmatch(rf"Triton kernels for sm_120 \(Triton 3\.6\.0\): "
                        rf"{first['triton']['compiled']} compiled and checked in {SECONDS}", line), line
    assert first["triton"]["compiled"] > 0
    second, lines = _build(capsys, pins, registry_plain, "e2e-triton")  # the kernels now in kiln's cache
    assert second["triton"]["from_cache"] and second["triton"]["compiled"] == 0
    assert not any("compil" in x and "none compiled" not in x for x in lines), lines
    [line] = [x for x in lines if x.startswith("Triton kernels for sm_120")]
    assert re.fullmatch(rf"Triton kernels for sm_120 \(Triton 3\.6\.0\): from kiln's cache, none compiled "
                        rf"in {SECONDS}", line), line
