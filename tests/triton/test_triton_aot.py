"""Ahead-of-time Triton kernel caches, on CPU: real Triton 3.6 compiles for four SMs.

The kernels are vLLM 0.20.1's TurboQuant store/decode launchers from the real wheel source,
compiled through Triton's JIT path with the stand-in driver and tensors (``kiln/triton/worker.py``,
``standin_torch.py``) by the Triton 3.6.0 wheel kiln fetches from PyPI (once, shared by the tests). The
preset is small (head dim 64) so the four SMs compile in CI time; bf16 makes the sm_86 fp8
store fail the way it does on a real sm_86 GPU.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.errors import KilnError
from kiln.oci.layer import LayerBuilder
from kiln.triton import aot
from kiln.triton.aot import (
    KernelSources,
    compile_kernel_caches,
    kernel_cache_files,
    rewrite_group_prefix,
)
from kiln.triton.kernels import (
    KERNELS,
    RUNTIME_CACHE_DIR,
    check_kernels,
    launch_plan,
    parse_kernel_preset,
)
from kiln.triton.runtime_layout import layout_for
from kiln.triton.toolchain import SOURCE_MTIME, toolchain_for
from tests.support.registry import TOOLCHAIN_CACHE

LAYOUT_0201 = layout_for((0, 20, 1))  # the tree these tests compile from

SMS = (86, 89, 90, 120)
SMALL = {"launchers": ["turboquant_store", "turboquant_decode"], "head_dim": 64, "num_heads": 6,
         "num_kv_heads": 2, "block_sizes": [16], "max_model_len": 256, "max_num_seqs": 2}


def _fail(field: str, why: str):
    raise KilnError(f"image.toml: {field}: {why}")


def preset(dtype: str = "bfloat16", **changes):
    return parse_kernel_preset({**SMALL, **changes}, dtype, "turboquant_k8v4", 1, _fail)


@pytest.fixture(scope="module")
def toolchain():
    return toolchain_for("3.6.0", "test-image", TOOLCHAIN_CACHE)


@pytest.fixture(scope="module")
def sources(tree_0201):
    return KernelSources({}, tree_0201.root)


@pytest.fixture(scope="module")
def built(tmp_path_factory, toolchain, sources):
    cache = tmp_path_factory.mktemp("kiln-cache")
    return cache, compile_kernel_caches(preset(), list(SMS), sources, toolchain, cache, jobs=2)


def _metadata(root: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(root.glob("*/*.json")) if not p.name.startswith("__grp__")]


def test_toolchain_is_the_pypi_wheel_at_fixed_mtimes(toolchain):
    import hashlib

    assert toolchain.version == "3.6.0" and toolchain.wheel.startswith("triton-3.6.0-cp")
    assert toolchain.site == TOOLCHAIN_CACHE / "triton" / "toolchains" / "triton-3.6.0"
    record = toolchain.site / "triton-3.6.0.dist-info" / "RECORD"
    assert toolchain.fingerprint == hashlib.sha256(record.read_bytes()).hexdigest()
    # ptxas writes each source file's mtime into a cubin's line info: content alone must decide it
    sources = list((toolchain.site / "triton" / "language").rglob("*.py"))
    assert sources and {int(p.stat().st_mtime) for p in sources} == {SOURCE_MTIME}
    assert (toolchain.site / "triton/backends/nvidia/bin/ptxas").stat().st_mode & 0o111
    assert toolchain_for("3.6.0", "test-image", TOOLCHAIN_CACHE) == toolchain  # fetched once


def test_four_sms_compile_real_cubins_for_their_arch(built):
    _, caches = built
    assert sorted(caches) == list(SMS)
    for sm, result in caches.items():
        meta = _metadata(result.root)
        names = {m["name"] for m in meta}
        assert {"_tq_decode_stage1", "_fwd_kernel_stage2"} <= names
        assert {m["target"]["arch"] for m in meta} == {sm}
        for cubin in result.root.glob("*/*.cubin"):
            assert cubin.read_bytes()[:4] == b"\x7fELF"
        # binary only: no ttir/ttgir/llir/ptx kept
        assert not list(result.root.glob("*/*.ptx")) and not list(result.root.glob("*/*.llir"))
        assert result.compiled == len(meta) and not result.cached


def test_sm86_bf16_fp8_store_is_reported_and_the_rest_built(built, toolchain):
    _, caches = built
    [failure] = caches[86].failures
    assert failure["kernel"] == "turboquant_store" and failure["params"]["kv_preset"] == "turboquant_k8v4"
    assert "float8e4b15" in failure["error"]
    assert "_tq_fused_store_fp8" not in {m["name"] for m in _metadata(caches[86].root)}
    for sm in (89, 90, 120):
        assert not caches[sm].failures
        assert "_tq_fused_store_fp8" in {m["name"] for m in _metadata(caches[sm].root)}
    audit = json.loads(kernel_cache_files(caches[86], toolchain, preset())["opt/kiln/triton-kernels.json"])
    assert audit["not_built"] == caches[86].failures


def test_group_files_name_the_runtime_path(built):
    _, caches = built
    for result in caches.values():
        groups = list(result.root.glob("*/__grp__*.json"))
        assert groups
        for group in groups:
            for path in json.loads(group.read_text())["child_paths"].values():
                assert path.startswith(RUNTIME_CACHE_DIR + "/")
                assert (result.root / path[len(RUNTIME_CACHE_DIR) + 1:]).is_file()


def test_fresh_process_rerun_compiles_nothing(built, toolchain, sources, tmp_path):
    """Independently of the build's own check: a new worker over a copy of the cache hits all."""
    _, caches = built
    result = caches[90]
    copy = tmp_path / "cache"
    shutil.copytree(result.root, copy)
    rewrite_group_prefix(copy, RUNTIME_CACHE_DIR, str(copy))
    staged, _ = aot.stage_sources(preset(), sources)
    job = {"mode": "check", "sm": 90, "toolchain_site": str(toolchain.staged_site()), "roots": [str(staged)],
           "standin_torch": str(aot._STANDIN_TORCH), "preset": preset().to_json(),
           "launches": launch_plan(preset(), LAYOUT_0201), "report": str(tmp_path / "r.json")}
    (tmp_path / "job.json").write_text(json.dumps(job))
    env = aot._worker_env(copy, tmp_path, {}, False)
    subprocess.run([sys.executable, str(Path(aot.__file__).parent / "worker.py"), str(tmp_path / "job.json")],
                   env=env, check=True, capture_output=True)
    report = json.loads((tmp_path / "r.json").read_text())
    assert [e["compiled"] for e in report["launches"]] == [[] for _ in report["launches"]]
    hits = {h["hash"] for e in report["launches"] for h in e["hits"]}
    assert hits == {m["hash"] for m in _metadata(result.root)}
    assert len(list(copy.glob("*"))) == len(list(result.root.glob("*")))  # nothing new written


def test_second_build_comes_from_the_kiln_cache(built, toolchain, sources):
    cache, caches = built
    again = compile_kernel_caches(preset(), list(SMS), sources, toolchain, cache, jobs=2)
    for sm in SMS:
        assert again[sm].cached and again[sm].compiled == 0
        assert again[sm].key == caches[sm].key and again[sm].root == caches[sm].root


def test_layer_is_deterministic_and_rebuilds_byte_identical(built, toolchain, sources, tmp_path):
    _, caches = built
    files = kernel_cache_files(caches[90], toolchain, preset())

    def digest(where: Path) -> str:
        builder = LayerBuilder()
        for path, data in files.items():
            builder.add_file(path, data)
        return builder.write(where).digest

    assert digest(tmp_path / "a") == digest(tmp_path / "b")
    # a cold rebuild in another kiln cache gives the same bytes (cubins, metadata, group files)
    fresh = compile_kernel_caches(preset(), [90], sources, toolchain, tmp_path / "other-cache")[90]
    assert not fresh.cached and fresh.compiled > 0
    assert kernel_cache_files(fresh, toolchain, preset()) == files
    assert all(path.startswith("opt/kiln/") for path in files)


def test_a_line_shift_is_a_named_miss(built, toolchain, tree_0201, tmp_path):
    """The self-check fails naming the kernel when the runtime source differs (one line lower)."""
    _, caches = built
    rel = KERNELS["turboquant_decode"].file
    shifted = KernelSources({rel: "\n" + tree_0201.read(rel)}, tree_0201.root)
    staged, _ = aot.stage_sources(preset(), shifted)
    build_dir = tmp_path / "cache"
    shutil.copytree(caches[120].root, build_dir)
    job = {"sm": 120, "toolchain_site": str(toolchain.staged_site()), "roots": [str(staged)],
           "standin_torch": str(aot._STANDIN_TORCH), "preset": preset().to_json(), "launches": launch_plan(preset(), LAYOUT_0201)}
    (tmp_path / "home").mkdir()
    with pytest.raises(KilnError) as err:
        aot._self_check(120, launch_plan(preset(), LAYOUT_0201), job, caches[120].launches, toolchain, tmp_path, build_dir,
                        RUNTIME_CACHE_DIR, {})
    assert "sm_120: self-check: kernel turboquant_decode" in str(err.value)
    assert "_tq_decode_stage1 again" in str(err.value) and "line numbers" in str(err.value)


def test_rewrite_group_prefix_round_trip(tmp_path):
    entry = tmp_path / "ABC"
    entry.mkdir()
    (entry / "k.cubin").write_bytes(b"x")
    group = entry / "__grp__k.json"
    group.write_text(json.dumps({"child_paths": {"k.cubin": f"{tmp_path}/ABC/k.cubin"}}))
    assert rewrite_group_prefix(tmp_path, str(tmp_path), "/opt/kiln/triton-cache") == 1
    assert json.loads(group.read_text()) == {"child_paths": {"k.cubin": "/opt/kiln/triton-cache/ABC/k.cubin"}}
    rewrite_group_prefix(tmp_path, "/opt/kiln/triton-cache", str(tmp_path))
    assert json.loads(group.read_text())["child_paths"]["k.cubin"] == f"{tmp_path}/ABC/k.cubin"
    with pytest.raises(KilnError, match="outside /elsewhere"):
        rewrite_group_prefix(tmp_path, "/elsewhere", "/x")


# -- bad input ----------------------------------------------------------------------------------


def test_sm_triton_cannot_target_is_named(toolchain, sources, tmp_path):
    with pytest.raises(KilnError, match=r"sm_30: Triton 3\.6\.0 cannot compile any kernel for this SM"):
        compile_kernel_caches(preset("float16", launchers=["turboquant_decode"]), [30], sources, toolchain,
                              tmp_path)
    assert not list((tmp_path / "triton" / "kernels").glob("[!.]*"))  # no entry kept


def test_base_without_triton_is_named(tmp_path):
    with pytest.raises(KilnError, match=r"docker.io/vllm/vllm-openai:x: base image has no Triton"):
        toolchain_for(None, "docker.io/vllm/vllm-openai:x", tmp_path)


def test_kernel_missing_from_the_patched_source_is_named(tree_0201):
    rel = KERNELS["turboquant_decode"].file
    renamed = tree_0201.read(rel).replace("def triton_turboquant_decode_attention(", "def renamed_launcher(")
    with pytest.raises(KilnError, match=r"kernel turboquant_decode: vllm/v1/attention/ops/triton_turboquant_decode\.py "
                                        r"has no function triton_turboquant_decode_attention"):
        check_kernels(preset(), KernelSources({rel: renamed}, tree_0201.root).read, "img.toml: model.kernels")
    missing = KernelSources({}, tree_0201.root / "nowhere")
    with pytest.raises(KilnError, match="kernel turboquant_store: vllm/v1/attention/ops/triton_turboquant_store.py "
                                        "does not exist"):
        check_kernels(preset(), missing.read, "img.toml: model.kernels")


@pytest.mark.parametrize(("change", "message"), [
    ({"launchers": ["nope"]}, "model.kernels.launchers: unknown kernel 'nope'"),
    ({"launchers": []}, "model.kernels.launchers: must be a non-empty list"),
    ({"num_heads": 5}, "model.kernels.num_heads: 5 is not a multiple of num_kv_heads 2"),
    ({"head_dim": "64"}, "model.kernels.head_dim: must be an integer"),
    ({"block_sizes": [0]}, "model.kernels.block_sizes: must be a non-empty list of positive integers"),
    ({"block_sizes": [16, 100]},
     "model.kernels.block_sizes: 100 is not a multiple of any TurboQuant kernel block size (16, 32, 64, 128)"),
    ({"kv_cache_presets": ["fp8"]}, "model.kernels.kv_cache_presets: 'fp8' is not a TurboQuant preset"),
    ({"dtype": "float32"}, "model.kernels.dtype: 'float32' is not one of"),
    ({"head_dims": 64}, "model.kernels.head_dims: unknown field"),
])
def test_bad_kernel_preset_names_the_field(change, message):
    with pytest.raises(KilnError, match=message.replace("(", r"\(").replace(")", r"\)")):
        preset(**change)


def test_reads_source_names_the_kernel_directories_and_the_config():
    small = preset()
    for launcher in small.launchers:
        assert aot.reads_source(small, KERNELS[launcher].file)
    assert aot.reads_source(small, "model_executor/layers/quantization/turboquant/config.py")
    assert not aot.reads_source(small, "v1/attention/backends/turboquant_attn.py")  # P22/P38/...: compiled beside
    assert not aot.reads_source(small, "v1/attention/opsx/other.py")  # a prefix is not a directory
