"""Kernels keyed for the image's Triton: another Python's wheel of the same release.

Real data: the toolchain is Triton 3.6.0's wheel for kiln's Python from PyPI (fetched once,
shared by the tests); the image's side is the real RECORD of the cp312 wheel that vLLM's
images install (``tests/support/triton-3.6.0-cp312.RECORD``, provenance in
``tests/support/registry.py``). The key itself is checked against Triton's own
``triton_key()`` run over an install that differs from the toolchain in libtriton.so only.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.triton import worker as worker_module
from kiln.triton.aot import KernelSources, compile_kernel_caches, kernel_cache_files
from kiln.triton.imagekey import LIBTRITON, record_hashes, runtime_key
from kiln.triton.kernels import parse_kernel_preset
from kiln.triton.toolchain import toolchain_for
from tests.support.registry import TOOLCHAIN_CACHE, TRITON_CP312_RECORD

CP312 = TRITON_CP312_RECORD.read_text()
SMALL = {"launchers": ["turboquant_store", "turboquant_decode"], "head_dim": 64, "num_heads": 6,
         "num_kv_heads": 2, "block_sizes": [16], "max_model_len": 256, "max_num_seqs": 2}


@pytest.fixture(scope="module")
def toolchain():
    return toolchain_for("3.6.0", "test-image", TOOLCHAIN_CACHE)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def test_record_hashes_are_the_files_sha256(toolchain):
    hashes = record_hashes(toolchain.record)
    for rel in ("triton/runtime/cache.py", "triton/language/core.py", "triton/backends/nvidia/bin/ptxas"):
        assert hashes[rel] == _sha256(toolchain.site / rel)
    assert toolchain.libtriton_sha256 == hashes[LIBTRITON]
    assert not any(path.endswith(".pyc") for path in record_hashes(CP312))  # rows without a hash are skipped


def test_the_cp312_wheel_differs_only_in_its_extension_modules(toolchain):
    if toolchain.wheel_python == "3.12":
        pytest.skip("kiln runs Python 3.12 here: the toolchain is the cp312 wheel itself")
    keyed = runtime_key(CP312, toolchain.record, "3.12", toolchain.wheel_python)
    assert keyed.problem is None and keyed.substitutes
    assert keyed.libtriton_sha256 == record_hashes(CP312)[LIBTRITON] != toolchain.libtriton_sha256
    assert keyed.toolchain_libtriton_sha256 == toolchain.libtriton_sha256


def test_same_wheel_keys_with_its_own_libtriton(toolchain):
    keyed = runtime_key(toolchain.record, toolchain.record, "3.12", toolchain.wheel_python)
    assert keyed.problem is None and not keyed.substitutes
    assert keyed.libtriton_sha256 == toolchain.libtriton_sha256


def test_a_triton_that_is_not_the_wheel_is_named(toolchain):
    changed = CP312.replace("triton/language/core.py,sha256=", "triton/language/core.py,sha256=AAAA", 1)
    changed = changed.replace("triton/backends/nvidia/bin/ptxas,sha256=", "triton/backends/nvidia/bin/ptxas,sha256=AAAA", 1)
    keyed = runtime_key(changed, toolchain.record, "3.12", toolchain.wheel_python)
    assert keyed.libtriton_sha256 is None and not keyed.substitutes
    assert "2 file(s) differ" in keyed.problem
    assert "triton/backends/nvidia/bin/ptxas" in keyed.problem and "triton/language/core.py" in keyed.problem
    missing = "".join(line for line in CP312.splitlines(True) if not line.startswith("triton/language/math.py"))
    assert "triton/language/math.py" in runtime_key(missing, toolchain.record, "3.12", toolchain.wheel_python).problem


def test_without_a_record_only_the_same_python_is_assumed(toolchain):
    same = runtime_key(None, toolchain.record, toolchain.wheel_python, toolchain.wheel_python)
    assert same.problem is None and same.libtriton_sha256 == toolchain.libtriton_sha256
    other = runtime_key(None, toolchain.record, "3.99", toolchain.wheel_python)
    assert other.libtriton_sha256 is None and "no RECORD" in other.problem and "3.99" in other.problem


def test_worker_key_is_triton_key_of_the_image_install(toolchain, tmp_path):
    """Triton's own ``triton_key()`` over an install with another libtriton.so = the worker's key."""
    image = tmp_path / "image"
    shutil.copytree(toolchain.site / "triton", image / "triton", copy_function=os.symlink,
                    ignore=shutil.ignore_patterns("__pycache__"))
    lib = image / "triton/_C/libtriton.so"
    lib.unlink()
    lib.write_bytes(b"another Python's libtriton.so")
    image_sha = hashlib.sha256(lib.read_bytes()).hexdigest()
    script = f"""
import importlib.util, json, sys, types
sys.path.insert(0, {str(toolchain.site)!r})
spec = importlib.util.spec_from_file_location("kiln_worker", {worker_module.__file__!r})
worker = importlib.util.module_from_spec(spec)
spec.loader.exec_module(worker)
from triton.runtime import autotuner, cache
real = cache.triton_key.__wrapped__
image_key = types.FunctionType(real.__code__, {{**real.__globals__,
                                                "__file__": {str(image / "triton/runtime/cache.py")!r}}})()
own_key = cache.triton_key()
worker._key_for_image({{"own": {toolchain.libtriton_sha256!r}, "image": {image_sha!r}}})
print(json.dumps([own_key, image_key, cache.triton_key(), autotuner.triton_key()]))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    own_key, image_key, keyed, autotuned = json.loads(result.stdout)
    assert own_key != image_key and image_sha in image_key and toolchain.libtriton_sha256 in own_key
    assert keyed == image_key == autotuned


def test_worker_refuses_a_key_without_the_named_libtriton(toolchain):
    script = f"""
import importlib.util, sys
sys.path.insert(0, {str(toolchain.site)!r})
spec = importlib.util.spec_from_file_location("kiln_worker", {worker_module.__file__!r})
worker = importlib.util.module_from_spec(spec)
spec.loader.exec_module(worker)
worker._key_for_image({{"own": "0" * 64, "image": "1" * 64}})
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode != 0 and "exactly once" in result.stderr


def test_entries_keyed_for_the_image_hold_the_same_cubins(toolchain, tree_0201, tmp_path):
    preset = parse_kernel_preset(SMALL, "float16", "turboquant_k8v4", 1, lambda f, w: pytest.fail(f"{f}: {w}"))
    sources = KernelSources({}, tree_0201.root)
    image_sha = record_hashes(CP312)[LIBTRITON]
    own = compile_kernel_caches(preset, [120], sources, toolchain, tmp_path / "a")[120]
    keyed = compile_kernel_caches(preset, [120], sources, toolchain, tmp_path / "b", image_libtriton=image_sha)[120]
    assert own.libtriton == toolchain.libtriton_sha256 and keyed.libtriton == image_sha
    assert keyed.key != own.key  # the kiln cache entry knows what it was keyed for
    own_dirs = {p.name for p in own.root.iterdir() if p.is_dir()}
    keyed_dirs = {p.name for p in keyed.root.iterdir() if p.is_dir()}
    assert own_dirs and len(keyed_dirs) == len(own_dirs) and not own_dirs & keyed_dirs  # every key differs
    cubins = lambda root: sorted(p.read_bytes() for p in root.glob("*/*.cubin"))  # noqa: E731
    assert cubins(own.root) == cubins(keyed.root)  # same compiler, same code
    audit = json.loads(kernel_cache_files(keyed, toolchain, preset)["opt/kiln/triton-kernels.json"])
    assert audit["triton"]["keyed_for_libtriton_sha256"] == image_sha
    again = compile_kernel_caches(preset, [120], sources, toolchain, tmp_path / "b", image_libtriton=image_sha)[120]
    assert again.cached and again.libtriton == image_sha
    same = compile_kernel_caches(preset, [120], sources, toolchain, tmp_path / "a",
                                 image_libtriton=toolchain.libtriton_sha256)[120]
    assert same.cached and same.key == own.key  # the image's own wheel: nothing substituted


def _found(tree, record: str | None):
    from kiln.source.image import ImageVllm

    return ImageVllm(tree, "docker.io/vllm/vllm-openai:test", "sha256:" + "0" * 64, "sha256:" + "1" * 64,
                     "usr/local/lib/python3.12/dist-packages", (), "3.6.0", record, ())


@pytest.mark.parametrize("case", ["cp312", "vendor", "no-record"])
def test_the_build_step_keys_for_the_image_or_says_why_not(case, toolchain, tree_0201, tmp_path, monkeypatch):
    from kiln.report import Recorder
    from kiln.triton.cachelayer import triton_cache_layer

    monkeypatch.setenv("KILN_TRITON_TOOLCHAINS", str(toolchain.site.parent))
    record = {"cp312": CP312, "no-record": None,
              "vendor": CP312.replace("triton/language/core.py,sha256=", "triton/language/core.py,sha256=AAAA", 1)}[case]
    preset = parse_kernel_preset(SMALL, "float16", "turboquant_k8v4", 1, lambda f, w: pytest.fail(f"{f}: {w}"))
    recorder = Recorder()
    layer = triton_cache_layer(preset, 120, _found(tree_0201, record), {}, {}, tmp_path, "images/t.toml: model.kernels",
                               "t", recorder)
    summary = layer.summary
    if case == "cp312" and toolchain.wheel_python != "3.12":
        assert summary["keyed_for_image"] and summary["libtriton_sha256"] == record_hashes(CP312)[LIBTRITON]
        assert not recorder.warnings
    elif case == "vendor":
        assert not summary["keyed_for_image"] and summary["libtriton_sha256"] == toolchain.libtriton_sha256
        [warning] = recorder.warnings
        assert "sm_120: the image's Triton is not the PyPI wheel" in warning and "triton/language/core.py" in warning
    elif case == "no-record" and toolchain.wheel_python != "3.12":
        assert not summary["keyed_for_image"]
        [warning] = recorder.warnings
        assert "has no RECORD" in warning and "compiles them at first launch" in warning


def test_a_toolchain_record_without_libtriton_is_a_one_line_error(tmp_path):
    from kiln.errors import KilnError
    from kiln.triton.toolchain import Toolchain

    info = tmp_path / "triton-9.9.9.dist-info"
    info.mkdir()
    (info / "RECORD").write_text("triton/__init__.py,sha256=AAAA,1\n")
    toolchain = Toolchain("9.9.9", tmp_path, "f" * 64, "triton-9.9.9-cp311-cp311-linux_x86_64.whl")
    with pytest.raises(KilnError, match=r"RECORD lists no triton/_C/libtriton.so") as caught:
        _ = toolchain.libtriton_sha256
    assert "\n" not in str(caught.value) and str(tmp_path) in str(caught.value)
    with pytest.raises(KilnError, match="cannot tell its cache key"):
        runtime_key(CP312, toolchain.record, "3.12", "3.11")
