"""Kernels compiled on the amd64 host, keyed for an arm64 image's own Triton (issue #35 item 4).

Real data: the toolchain is Triton 3.6.0's wheel for kiln's Python and machine (x86_64) from PyPI;
the arm64 image's side is the real RECORD of ``triton-3.6.0-cp312-cp312-manylinux_2_27_aarch64.
manylinux_2_28_aarch64.whl`` (PyPI, sha256 374f52c1…57f4), checked in as
``tests/support/triton-3.6.0-cp312-aarch64.RECORD``, and kiln fetches that wheel itself (once,
into the shared toolchain directory) through the index, its sha256 checked. What kiln derives is
checked against what Triton's own code computes: ``triton_key()`` over an install with that
wheel's ``libtriton.so`` hash, and ``CUDABackend.hash()`` with the worker's ptxas text.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kiln.errors import KilnError
from kiln.report import Recorder
from kiln.triton import worker as worker_module
from kiln.triton.imagekey import LIBTRITON, platform_key, record_hashes
from kiln.triton.keyfiles import read_key_sources
from kiln.triton.platformwheel import (
    built_on,
    check_same_build,
    host_ptxas,
    platform_wheel,
    ptxas_key_text,
    wheel_arch,
)
from kiln.triton.toolchain import toolchain_for
from tests.support.registry import TOOLCHAIN_CACHE, TRITON_CP312_RECORDS

# releases' wheels from PyPI on a machine whose kiln cache lacks them (tests/conftest.py keeps this true)
pytestmark = pytest.mark.network

AARCH64 = (TRITON_CP312_RECORDS["3.6.0"].parent / "triton-3.6.0-cp312-aarch64.RECORD").read_bytes().decode()
X86_64 = TRITON_CP312_RECORDS["3.6.0"].read_text()
WHEEL = "triton-3.6.0-cp312-cp312-manylinux_2_27_aarch64.manylinux_2_28_aarch64.whl"
WHEEL_SHA256 = "374f52c11a711fd062b4bfbb201fd9ac0a5febd28a96fb41b4a0f51dde3157f4"


@pytest.fixture(scope="module")
def toolchain():
    return toolchain_for("3.6.0", "test-image", TOOLCHAIN_CACHE)


@pytest.fixture(scope="module")
def arm64(toolchain, tmp_path_factory):
    """The aarch64 cp312 wheel's RECORD and ptxas texts, fetched by kiln (shared across runs)."""
    return platform_wheel(toolchain, "3.12", "aarch64", "test-image", TOOLCHAIN_CACHE)


def test_the_aarch64_wheel_is_fetched_and_checked(arm64, toolchain):
    assert (arm64.wheel, arm64.wheel_sha256) == (WHEEL, WHEEL_SHA256)
    assert arm64.record == AARCH64  # the real wheel's RECORD, byte for byte
    assert wheel_arch(toolchain.wheel) == "x86_64" and wheel_arch(arm64.wheel) == "aarch64"
    # one text per ptxas binary; each differs from the host's on the "Built on" line alone
    assert len(arm64.ptxas) == 2
    for host, image in arm64.ptxas.items():
        changed = [(a, b) for a, b in zip(host.splitlines(), image.splitlines(), strict=True) if a != b]
        assert [a.split()[:2] for a, _ in changed] == [["Built", "on"]], changed
    assert "Built on Fri_Feb_21_20:22:20_PST_2025\n" in "".join(arm64.ptxas.values())  # aarch64 ptxas (strings(1))


def test_the_arm64_image_is_keyed_for_its_own_libtriton(toolchain):
    sources = read_key_sources(toolchain.site, toolchain.version)
    keyed = platform_key(AARCH64, AARCH64, toolchain.record, sources, WHEEL)
    assert keyed.problem is None and keyed.libtriton_sha256 == record_hashes(AARCH64)[LIBTRITON]
    assert keyed.libtriton_sha256 not in (record_hashes(X86_64)[LIBTRITON], toolchain.libtriton_sha256)
    # an arm64 image carrying the x86_64 wheel's RECORD is not that platform's wheel (its ptxas)
    wrong = platform_key(X86_64, AARCH64, toolchain.record, sources, WHEEL)
    assert "is not the PyPI wheel " + WHEEL in wrong.problem and "triton/_C/libtriton.so" in wrong.problem
    vendor = AARCH64.replace("triton/language/core.py,sha256=", "triton/language/core.py,sha256=AAAA", 1)
    assert "triton/language/core.py" in platform_key(vendor, AARCH64, toolchain.record, sources, WHEEL).problem
    # a wheel that is another compiler than the host's (one .py differs) is refused too
    assert "is not the compiler kiln compiles with" in platform_key(vendor, vendor, toolchain.record, sources,
                                                                     WHEEL).problem
    assert "has no RECORD" in platform_key(None, AARCH64, toolchain.record, sources, WHEEL).problem


def test_worker_backend_hash_is_the_images(arm64, toolchain):
    """Triton's own ``CUDABackend.hash()`` in the worker gives the image's ptxas text for each
    ptxas the arch picks (sm_90: ptxas; sm_100: ptxas-blackwell), the host's without the job."""
    script = f"""
import importlib.util, json, sys
sys.path.insert(0, {str(toolchain.site)!r})
spec = importlib.util.spec_from_file_location("kiln_worker", {worker_module.__file__!r})
worker = importlib.util.module_from_spec(spec)
spec.loader.exec_module(worker)
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import CUDABackend

own = [CUDABackend(GPUTarget("cuda", sm, 32)).hash() for sm in (90, 100)]
worker._keys.ptxas_for_image(json.loads(sys.argv[1]))
print(json.dumps([own, [CUDABackend(GPUTarget("cuda", sm, 32)).hash() for sm in (90, 100)]]))
"""
    result = subprocess.run([sys.executable, "-c", script, json.dumps(arm64.ptxas)], capture_output=True,
                            text=True, check=True)
    own, keyed = json.loads(result.stdout)
    assert own == [f"{host}-{sm}" for host, sm in zip(arm64.ptxas, (90, 100), strict=True)]
    assert keyed == [f"{image}-{sm}" for image, sm in zip(arm64.ptxas.values(), (90, 100), strict=True)]
    refused = subprocess.run([sys.executable, "-c", script, json.dumps({"another ptxas": "x"})],
                             capture_output=True, text=True)
    assert refused.returncode != 0 and "does not key for the image" in refused.stderr


def test_ptxas_text_rules():
    text = ("ptxas: NVIDIA (R) Ptx optimizing assembler\nCopyright (c) 2005-2025 NVIDIA Corporation\n"
            "Built on Fri_Feb_21_20:21:21_PST_2025\nCuda compilation tools, release 12.8, V12.8.93\n"
            "Build cuda_12.8.r12.8/compiler.35583870_0\n")
    assert ptxas_key_text(text, "Sat_Jan_03_01:02:03_PST_2026").splitlines()[1:3] == [
        "Copyright (c) 2005-2026 NVIDIA Corporation", "Built on Sat_Jan_03_01:02:03_PST_2026"]
    assert built_on(b"\0x\0Fri_Feb_21_20:22:20_PST_2025\0") == "Fri_Feb_21_20:22:20_PST_2025"
    assert built_on(b"Fri_Feb_21_20:22:20_PST_2025 Sat_Feb_22_20:22:20_PST_2025") is None  # two: unknown
    # CUDA 13.3's ptxas (Triton 3.8.0's ptxas-blackwell) prints a 12-hour clock
    assert built_on(b"\0Fri_Apr_24_07:23:04_PM_PDT_2026\0") == "Fri_Apr_24_07:23:04_PM_PDT_2026"
    assert built_on(b"\0Wed_Apr__8_07:23:04_AM_PDT_2026\0") == "Wed_Apr__8_07:23:04_AM_PDT_2026"
    assert built_on(b"\0xFri_Apr_24_07:23:04_PM_PDT_2026\0") is None  # inside another word: not a date
    binary = (b"%s: NVIDIA (R) %s\0Ptx optimizing assembler\0Built on %s\0Copyright (c) 2005-%s NVIDIA Corporation\0"
              b"Cuda compilation tools, release 12.8, V12.8.93\0Build cuda_12.8.r12.8/compiler.35583870_0\0")
    check_same_build("ptxas", text, binary, "w.whl")
    with pytest.raises(KilnError, match="w.whl: its ptxas is another build .*release 12.8"):
        check_same_build("ptxas", text, binary.replace(b"V12.8.93", b"V12.8.94"), "w.whl")


def test_the_build_step_keys_an_arm64_layer_for_its_triton(toolchain, tree_0201, tmp_path, monkeypatch):
    """The build step on an arm64 image carrying the aarch64 wheel's dist-info: keyed for it (its
    libtriton.so and ptxas), the same cubins as the host's, other Triton cache keys; an arm64 image
    whose Triton is not that wheel fails in one line, or is left out when told."""
    from kiln.triton.cachelayer import triton_cache_layer
    from tests.triton.test_imagekey import _found, _preset

    monkeypatch.setenv("KILN_TRITON_TOOLCHAINS", str(toolchain.site.parent))
    recorder = Recorder()
    layers = {platform: triton_cache_layer(_preset(), 90, _found(tree_0201, record), {}, {}, tmp_path,
                                           "images/t.toml: model.kernels", "t", recorder, platform=platform)
              for platform, record in (("linux/arm64", AARCH64), ("linux/amd64", X86_64))}
    arm, amd = layers["linux/arm64"].summary, layers["linux/amd64"].summary
    assert arm["keyed_for_image"] and arm["libtriton_sha256"] == record_hashes(AARCH64)[LIBTRITON]
    assert arm["platform_wheel"]["wheel_sha256"] == WHEEL_SHA256 and "platform" not in amd
    assert amd["libtriton_sha256"] == record_hashes(X86_64)[LIBTRITON] and not recorder.warnings
    files = {p: layers[p].contents.files for p in layers}
    audit = json.loads(files["linux/arm64"]["opt/kiln/triton-kernels.json"])
    assert audit["triton"]["keyed_for_ptxas_version"] == arm["ptxas_keyed"] and len(arm["ptxas_keyed"]) == 2
    cubins = {p: sorted(v for k, v in f.items() if k.endswith(".cubin")) for p, f in files.items()}
    assert cubins["linux/arm64"] and cubins["linux/arm64"] == cubins["linux/amd64"]
    dirs = {p: {k.split("/")[3] for k in f if k.endswith(".cubin")} for p, f in files.items()}
    assert dirs["linux/arm64"] and not dirs["linux/arm64"] & dirs["linux/amd64"]  # every Triton key differs
    with pytest.raises(KilnError) as err:
        triton_cache_layer(_preset(), 90, _found(tree_0201, X86_64), {}, {}, tmp_path, "images/t.toml: model.kernels",
                           "t", recorder, platform="linux/arm64")
    assert len(str(err.value).splitlines()) == 1 and f"is not the PyPI wheel {WHEEL}" in str(err.value)
    assert "--without-unusable-kernels" in str(err.value)
    assert triton_cache_layer(_preset(), 90, _found(tree_0201, X86_64), {}, {}, tmp_path, "images/t.toml: model.kernels",
                              "t", recorder, leave_out_unusable=True, platform="linux/arm64") is None


def test_the_aarch64_wheel_of_triton_3_8_0_is_keyed_too():
    """vLLM 0.33.0's Triton: its aarch64 cp312 wheel from PyPI, whose ptxas-blackwell (CUDA 13.3)
    prints its build time on a 12-hour clock; each text differs from the host's on that line alone."""
    toolchain = toolchain_for("3.8.0", "test-image", TOOLCHAIN_CACHE)
    arm64 = platform_wheel(toolchain, "3.12", "aarch64", "test-image", TOOLCHAIN_CACHE)
    assert (arm64.wheel, arm64.wheel_sha256) == (
        "triton-3.8.0-cp312-cp312-manylinux_2_27_aarch64.manylinux_2_28_aarch64.whl",
        "a9c404c69ed4a39e8ec632eaf6b9fe058a060bf98979c177f6ef666f06bb8d50")
    assert set(arm64.ptxas) == set(host_ptxas(toolchain).values())
    images = {}
    for host, image in arm64.ptxas.items():
        changed = [(a, b) for a, b in zip(host.splitlines(), image.splitlines(), strict=True) if a != b]
        assert [a.split()[:2] for a, _ in changed] == [["Built", "on"]], changed
        images[host.split(":")[0]] = image
    assert "Built on Fri_Apr_24_07:23:04_PM_PDT_2026\n" in images["ptxas-blackwell"]  # strings(1) of the aarch64 binary
    assert "Built on Tue_May_27_02:20:53_PDT_2025\n" in images["ptxas"]
    sources = read_key_sources(toolchain.site, toolchain.version)
    keyed = platform_key(arm64.record, arm64.record, toolchain.record, sources, arm64.wheel)
    assert keyed.problem is None and keyed.libtriton_sha256 == record_hashes(arm64.record)[LIBTRITON]
    assert keyed.libtriton_sha256 != toolchain.libtriton_sha256
