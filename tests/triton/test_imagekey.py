"""Kernels keyed for the image's Triton: another Python's wheel of the same release.

Real data: the toolchain is Triton 3.6.0's wheel for kiln's Python from PyPI (fetched once,
shared by the tests); the image's side is the real RECORD of the cp312 wheel that vLLM's
images install (``tests/support/triton-<version>-cp312.RECORD``, provenance in
``tests/support/registry.py``), for every Triton the pins' images carry: 3.6.0 (vLLM 0.20.1) and
3.8.0 (vLLM 0.33.0), compared with the real cp311 wheels' RECORDs whatever Python runs the tests.
Which files ``triton_key()`` reads is decided from each version's own source and checked
against the files Triton's own ``triton_key()`` opens; the key itself against ``triton_key()``
run over an install that differs from the toolchain in libtriton.so only.
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

from kiln.errors import KilnError
from kiln.triton import worker as worker_module
from kiln.triton.aot import KernelSources, compile_kernel_caches, kernel_cache_files
from kiln.triton.imagekey import LIBTRITON, record_hashes, runtime_key
from kiln.triton.kernels import parse_kernel_preset
from kiln.triton.keyfiles import key_sources, read_key_sources
from kiln.triton.toolchain import toolchain_for
from tests.support.registry import TOOLCHAIN_CACHE, TRITON_CP311_RECORDS, TRITON_CP312_RECORDS

CP312 = TRITON_CP312_RECORDS["3.6.0"].read_text()
PINNED_TRITONS = ("3.6.0", "3.8.0")  # vLLM 0.20.1's, 0.33.0's (torch 2.14.0: triton~=3.8.0)
SMALL = {"launchers": ["turboquant_store", "turboquant_decode"], "head_dim": 64, "num_heads": 6,
         "num_kv_heads": 2, "block_sizes": [16], "max_model_len": 256, "max_num_seqs": 2}


@pytest.fixture(scope="module")
def toolchain():
    return toolchain_for("3.6.0", "test-image", TOOLCHAIN_CACHE)


@pytest.fixture(scope="module", params=PINNED_TRITONS)
def pinned(request):
    """(version, its toolchain, its key sources) for every Triton the pins' images carry."""
    chain = toolchain_for(request.param, "test-image", TOOLCHAIN_CACHE)
    return request.param, chain, read_key_sources(chain.site, request.param)


def _sources(toolchain):
    return read_key_sources(toolchain.site, toolchain.version)


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


def test_key_sources_are_the_files_triton_key_opens(pinned):
    """Decided from the version's source = what its own ``triton_key()`` opens, file for file."""
    version, chain, sources = pinned
    assert sources.extension == LIBTRITON and sources.own_file == "triton/runtime/cache.py"
    script = f"""
import json, os, sys
sys.path.insert(0, {str(chain.site)!r})
from triton.runtime import cache
site, seen = os.path.realpath({str(chain.site)!r}), set()
def hook(event, args):
    if event == "open" and isinstance(args[0], str):
        seen.add(os.path.relpath(os.path.realpath(args[0]), site))
sys.addaudithook(hook)
cache.triton_key.__wrapped__()
print(json.dumps(sorted(p for p in seen if p.startswith("triton/") and "__pycache__" not in p)))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    opened = set(json.loads(result.stdout))
    decided = sources.files(record_hashes(chain.record))
    assert decided == opened and LIBTRITON in opened and "triton/language/core.py" in opened
    assert not any(p.startswith("triton/plugins/") for p in decided)


def test_the_cp312_wheel_keys_for_the_image(pinned):
    """The image's cp312 Triton against the cp311 wheel: same key but for libtriton.so."""
    version = pinned[0]
    cp312, cp311 = (records[version].read_text() for records in (TRITON_CP312_RECORDS, TRITON_CP311_RECORDS))
    differing = {p for p in set(record_hashes(cp311)) | set(record_hashes(cp312))
                 if record_hashes(cp311).get(p) != record_hashes(cp312).get(p)}
    if version == "3.8.0":  # what kiln on Python 3.11 used to refuse: a native library triton_key() never reads
        assert "triton/plugins/libMLIRDialectPlugin.so.23.0git" in differing
    keyed = runtime_key(cp312, cp311, "3.12", "3.11", pinned[2])
    assert keyed.problem is None and keyed.substitutes
    assert keyed.libtriton_sha256 == record_hashes(cp312)[LIBTRITON] != record_hashes(cp311)[LIBTRITON]
    assert LIBTRITON in differing and not differing & pinned[2].files(record_hashes(cp312)) - {LIBTRITON}


def test_same_wheel_keys_with_its_own_libtriton(toolchain):
    keyed = runtime_key(toolchain.record, toolchain.record, "3.12", toolchain.wheel_python, _sources(toolchain))
    assert keyed.problem is None and not keyed.substitutes
    assert keyed.libtriton_sha256 == toolchain.libtriton_sha256


def _changed(record: str, *paths: str) -> str:
    for path in paths:
        assert f"{path},sha256=" in record, path
        record = record.replace(f"{path},sha256=", f"{path},sha256=AAAA", 1)
    return record


def test_a_triton_that_is_not_the_wheel_is_named(pinned):
    version, chain, sources = pinned
    cp312, cp311 = TRITON_CP312_RECORDS[version].read_text(), TRITON_CP311_RECORDS[version].read_text()
    changed = _changed(cp312, "triton/language/core.py", "triton/backends/nvidia/bin/ptxas")
    keyed = runtime_key(changed, cp311, "3.12", "3.11", sources)
    assert keyed.libtriton_sha256 is None and not keyed.substitutes
    assert "2 file(s) differ" in keyed.problem
    assert "triton/backends/nvidia/bin/ptxas" in keyed.problem and "triton/language/core.py" in keyed.problem
    missing = "".join(line for line in cp312.splitlines(True) if not line.startswith("triton/language/math.py"))
    assert "triton/language/math.py" in runtime_key(missing, cp311, "3.12", "3.11", sources).problem
    # files triton_key() does not read, outside the directories it walks, may differ
    elsewhere = _changed(cp312, "triton/_C/libproton.so", "triton/profiler/flags.py")
    assert runtime_key(elsewhere, cp311, "3.12", "3.11", sources).problem is None


def test_without_a_record_only_the_same_python_is_assumed(toolchain):
    sources = _sources(toolchain)
    same = runtime_key(None, toolchain.record, toolchain.wheel_python, toolchain.wheel_python, sources)
    assert same.problem is None and same.libtriton_sha256 == toolchain.libtriton_sha256
    other = runtime_key(None, toolchain.record, "3.99", toolchain.wheel_python, sources)
    assert other.libtriton_sha256 is None and "no RECORD" in other.problem and "3.99" in other.problem


@pytest.mark.parametrize("change, why", [
    ("    contents = []\n", "    contents = [os.walk(TRITON_PATH)]\n", ),
    ('    with open(__file__, "rb") as f:\n', '    with open(TRITON_PATH + "/x", "rb") as f:\n'),
    ("def triton_key():", "def triton_key_renamed():"),
], ids=["os.walk", "open", "renamed"])
def test_a_triton_key_kiln_cannot_read_is_refused_in_one_line(toolchain, change, why):
    source = (toolchain.site / "triton/runtime/cache.py").read_text()
    assert change in source
    with pytest.raises(KilnError, match="kiln cannot tell which files its triton_key") as caught:
        key_sources(source.replace(change, why, 1), "3.6.0")
    assert "\n" not in str(caught.value) and "Triton 3.6.0: triton/runtime/cache.py" in str(caught.value)


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
worker._keys.key_for_image({{"own": {toolchain.libtriton_sha256!r}, "image": {image_sha!r}}})
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
worker._keys.key_for_image({{"own": "0" * 64, "image": "1" * 64}})
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


def _found(tree, record: str | None, version: str = "3.6.0", python: str = "3.12"):
    from kiln.source.image import ImageVllm

    return ImageVllm(tree, "docker.io/vllm/vllm-openai:test", "sha256:" + "0" * 64, "sha256:" + "1" * 64,
                     f"usr/local/lib/python{python}/dist-packages", (), version, record, ())


def _preset():
    return parse_kernel_preset(SMALL, "float16", "turboquant_k8v4", 1, lambda f, w: pytest.fail(f"{f}: {w}"))


def test_the_build_step_keys_for_a_base_with_the_real_cp312_triton(pinned, tree_0201, tmp_path, monkeypatch):
    """A base carrying the cp312 dist-info of each pinned Triton: the layer is keyed for it."""
    from kiln.report import Recorder
    from kiln.triton.cachelayer import triton_cache_layer

    version, chain, _ = pinned
    monkeypatch.setenv("KILN_TRITON_TOOLCHAINS", str(chain.site.parent))
    cp312 = TRITON_CP312_RECORDS[version].read_text()
    recorder = Recorder()
    layer = triton_cache_layer(_preset(), 120, _found(tree_0201, cp312, version), {}, {}, tmp_path,
                               "images/t.toml: model.kernels", "t", recorder)
    assert layer.summary["keyed_for_image"] and layer.summary["triton"] == version
    assert layer.summary["libtriton_sha256"] == record_hashes(cp312)[LIBTRITON]
    assert layer.summary["kernels"] > 0 and not recorder.warnings


@pytest.mark.parametrize("case", ["vendor", "no-record"])
def test_a_layer_the_image_cannot_use_fails_the_build_in_one_line(case, toolchain, tree_0201, tmp_path, monkeypatch):
    """Never a layer the image would not read: one line before anything compiles, or left out when told."""
    from kiln.report import Recorder
    from kiln.triton.cachelayer import LEAVE_OUT_OPTION, triton_cache_layer

    monkeypatch.setenv("KILN_TRITON_TOOLCHAINS", str(toolchain.site.parent))
    # no RECORD: the base's Python is one kiln does not run, so its libtriton.so is unknown
    found = (_found(tree_0201, _changed(CP312, "triton/language/core.py")) if case == "vendor"
             else _found(tree_0201, None, python="3.99"))
    recorder = Recorder()
    with pytest.raises(KilnError) as caught:
        triton_cache_layer(_preset(), 120, found, {}, {}, tmp_path, "images/t.toml: model.kernels", "t", recorder)
    message = str(caught.value)
    assert "\n" not in message and message.startswith("images/t.toml: model.kernels: sm_120: ")
    assert LEAVE_OUT_OPTION in message and "would never read these kernels" in message
    assert ("triton/language/core.py" in message) if case == "vendor" else ("has no RECORD" in message)
    assert not recorder.warnings and not (tmp_path / "triton" / "kernels").exists()  # nothing compiled
    left_out = triton_cache_layer(_preset(), 120, found, {}, {}, tmp_path, "images/t.toml: model.kernels", "t",
                                  recorder, leave_out_unusable=True)
    assert left_out is None
    [warning] = recorder.warnings
    assert "the kernel layer is left out" in warning and LEAVE_OUT_OPTION in warning


_SOURCE = """
def triton_key():
    TRITON_PATH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(TRITON_PATH, "_C", f"libtriton.{ext}"), "rb") as f:
        pass
"""


def test_a_toolchain_record_without_libtriton_is_a_one_line_error(tmp_path):
    from kiln.triton.toolchain import Toolchain

    info = tmp_path / "triton-9.9.9.dist-info"
    info.mkdir()
    (info / "RECORD").write_text("triton/__init__.py,sha256=AAAA,1\n")
    toolchain = Toolchain("9.9.9", tmp_path, "f" * 64, "triton-9.9.9-cp311-cp311-linux_x86_64.whl", "e" * 64)
    with pytest.raises(KilnError, match=r"RECORD lists no triton/_C/libtriton.so") as caught:
        _ = toolchain.libtriton_sha256
    assert "\n" not in str(caught.value) and str(tmp_path) in str(caught.value)
    with pytest.raises(KilnError, match="cannot tell its cache key"):
        runtime_key(CP312, toolchain.record, "3.12", "3.11", key_sources(_SOURCE, "9.9.9"))
