"""P5b on real 0.20.1 source: smaller hybrid KV pages are padded up to the largest page.

Behaviour tests by extraction (the real modules need torch, Triton and CUDA):
- the patched ``unify_kv_cache_spec_page_size`` runs on vLLM's real spec classes
  (``TQFullAttentionSpec``, ``MambaSpec``, ... executed with a torch stand-in, see ``kvspecs``);
- the patched padded-page branch of ``GPUModelRunner._reshape_kv_cache_tensors`` runs against
  a torch stand-in whose ``as_strided`` checks bounds like torch does, to show that every kernel
  block of a padded TurboQuant page stays inside its own page;
- the store-kernel edit is checked on the patched source (Triton cannot run here).
"""

import sys
import textwrap
import types
from dataclasses import replace

import libcst as cst
import libcst.matchers as m
import pytest

from kiln.patch.anchor import resolve
from kiln.patch.engine import isolated_run
from kiln.patch.model import BuildTarget, Verdict
from tests.patchsets.support import kvspecs
from tests.patchsets.support.kvspecs import (
    BLOCK_SIZE,
    KV_HEADS,
    MAMBA_PADDED_PAGE,
    TORCH,
    TQ_K8V4_SLOT,
    TQ_PAGE,
)
from tests.patchsets.support.patchlib import assert_applies_once, extract, patched_files

UTILS = "v1/core/kv_cache_utils.py"
RUNNER = "v1/worker/gpu_model_runner.py"
STORE = "v1/attention/ops/triton_turboquant_store.py"


@pytest.fixture(scope="module")
def specs(trees):
    return kvspecs.spec_classes(trees("v0.20.1"))


@pytest.fixture(scope="module")
def patched(catalogue, sessions):
    return patched_files(catalogue, sessions("v0.20.1"), "P5b")


@pytest.fixture
def unify(patched, specs, monkeypatch):
    # the patched function imports TQFullAttentionSpec from vllm.v1.kv_cache_interface
    monkeypatch.setitem(
        sys.modules, "vllm.v1.kv_cache_interface", types.SimpleNamespace(TQFullAttentionSpec=specs.TQFullAttentionSpec)
    )
    return kvspecs.unify_function(patched[UTILS], specs)


def test_pristine_rejects_the_turboquant_hybrid(trees, specs):
    pristine = kvspecs.unify_function(trees("v0.20.1").read(UTILS), specs)
    with pytest.raises(NotImplementedError):
        pristine(kvspecs.qwen36_tq_hybrid(specs))


def test_turboquant_pages_are_padded_to_the_largest_page(unify, specs):
    layers = kvspecs.qwen36_tq_hybrid(specs)
    out = unify(layers)
    assert {spec.page_size_bytes for spec in out.values()} == {MAMBA_PADDED_PAGE}
    for name, spec in out.items():
        if isinstance(spec, specs.TQFullAttentionSpec):
            assert spec.block_size == BLOCK_SIZE  # tokens per block unchanged
            assert spec.page_size_padded == MAMBA_PADDED_PAGE
            assert spec.real_page_size_bytes == TQ_PAGE  # the packed layout is still known
            assert spec.tq_slot_size == TQ_K8V4_SLOT
        else:
            assert spec is layers[name]  # the largest pages are left alone
    # ~34% less KV memory per block than P5's common multiple (2 x TQ page on every layer)
    p5_per_block = len(layers) * 2 * TQ_PAGE
    p5b_per_block = len(layers) * MAMBA_PADDED_PAGE
    assert 1 - p5b_per_block / p5_per_block == pytest.approx(0.340, abs=1e-3)


def test_smaller_mamba_page_is_padded(unify, specs):
    big_tq = replace(kvspecs.qwen36_tq_hybrid(specs)["model.layers.3.self_attn.attn"], block_size=4 * BLOCK_SIZE)
    mamba = specs.MambaSpec(block_size=BLOCK_SIZE, shapes=kvspecs.GDN_SHAPES, dtypes=(TORCH.bfloat16, TORCH.float32))
    out = unify({"attn": big_tq, "mamba": mamba})
    assert out["attn"] is big_tq
    assert out["mamba"].page_size_padded == big_tq.page_size_bytes


def test_plain_attention_is_still_scaled_or_rejected(unify, specs):
    def full(block_size, heads):
        return specs.FullAttentionSpec(block_size=block_size, num_kv_heads=heads, head_size=128, dtype=TORCH.bfloat16)

    out = unify({"a": full(16, 8), "b": full(16, 2)})
    assert out["b"].block_size == 64 and out["b"].page_size_padded is None
    # a (2, num_blocks, ...) FlashAttention cache cannot be read through a padded stride
    with pytest.raises(NotImplementedError, match="cannot be padded"):
        unify({"a": full(16, 3), "b": full(16, 2)})


# -- the runner's padded-page view ---------------------------------------------------------------

PADDED_BRANCH = (
    m.ClassDef(name=m.Name("GPUModelRunner")),
    m.FunctionDef(name=m.Name("_reshape_kv_cache_tensors")),
    m.If(test=m.Comparison(left=m.Attribute(value=m.Name("kv_cache_spec"), attr=m.Name("page_size_padded")))),
)


class FakeTensor:
    def __init__(self, numel, size=None, stride=None):
        self.numel, self.size, self.strides = numel, size, stride

    def stride(self):
        return self.strides


def contiguous_strides(shape):
    strides, acc = [], 1
    for dim in reversed(shape):
        strides.insert(0, acc)
        acc *= dim
    return tuple(strides)


def as_strided(raw, size, stride):
    last = sum((n - 1) * s for n, s in zip(size, stride, strict=True))
    if last >= raw.numel:  # torch: "setStorage: ... out of bounds for storage"
        raise RuntimeError(f"view reaches element {last} of a storage of {raw.numel}")
    return FakeTensor(raw.numel, tuple(size), tuple(stride))


FAKE_TORCH = types.SimpleNamespace(
    empty=lambda shape: FakeTensor(0, tuple(shape), contiguous_strides(shape)), as_strided=as_strided
)


def padded_view(source: str, num_blocks: int, kernel_block_size: int):
    module = cst.parse_module(source)
    node = resolve(module, PADDED_BRANCH).unique
    assert node is not None
    code = textwrap.dedent(module.code_for_node(node))
    spec = types.SimpleNamespace(page_size_bytes=MAMBA_PADDED_PAGE, page_size_padded=MAMBA_PADDED_PAGE)
    per = BLOCK_SIZE // kernel_block_size
    namespace = {
        "kv_cache_spec": spec,
        "dtype": TORCH.uint8,
        "get_dtype_size": lambda dtype: dtype.itemsize,
        "torch": FAKE_TORCH,
        "raw_tensor": FakeTensor(num_blocks * MAMBA_PADDED_PAGE),
        # TurboQuant: (num_blocks, block_size, num_kv_heads, slot), identity stride order
        "kv_cache_shape": (num_blocks * per, kernel_block_size, KV_HEADS, TQ_K8V4_SLOT),
        "inv_order": [0, 1, 2, 3],
        "num_blocks_per_kv_block": per,
    }
    exec(compile(code, RUNNER, "exec"), namespace)
    return namespace["kv_cache"], per


def test_padded_turboquant_page_view_stays_inside_each_page(patched):
    num_blocks, kernel_block = 10, 32
    view, per = padded_view(patched[RUNNER], num_blocks, kernel_block)
    kernel_page = kernel_block * KV_HEADS * TQ_K8V4_SLOT
    block_stride = view.stride()[0]
    assert block_stride == MAMBA_PADDED_PAGE // per
    assert view.stride()[1:] == (KV_HEADS * TQ_K8V4_SLOT, TQ_K8V4_SLOT, 1)
    for kernel_index in range(view.size[0]):
        start = kernel_index * block_stride
        page = kernel_index // per  # the KV block (page) the allocator gave this kernel block
        assert page * MAMBA_PADDED_PAGE <= start
        assert start + kernel_page <= (page + 1) * MAMBA_PADDED_PAGE


def test_pristine_view_of_a_padded_page_overruns_the_allocation(trees):
    with pytest.raises(RuntimeError, match="storage"):
        padded_view(trees("v0.20.1").read(RUNNER), num_blocks=10, kernel_block_size=32)


def test_store_kernels_take_the_strided_cache(patched, trees):
    pristine = extract(trees("v0.20.1").read(STORE), "triton_turboquant_store")
    store = extract(patched[STORE], "triton_turboquant_store")
    assert pristine.count("kv_cache.view(-1)") == 2
    assert "kv_cache.view(-1)" not in store
    assert store.count("# kiln P5b:") == 2


@pytest.mark.parametrize(("label", "expected"), [("v0.20.1", Verdict.APPLIES), ("v0.33.0", Verdict.UPSTREAM)])
def test_verdicts(catalogue, sessions, label, expected):
    session = sessions(label)
    outcome = isolated_run(catalogue, session, BuildTarget(session.tree.vllm_version), "P5b").outcomes["P5b"]
    assert outcome.verdict is expected, outcome.detail


def test_is_a_variant_conflicting_with_p5(catalogue):
    patch = catalogue.get("P5b")
    assert patch.variant and "P5" in patch.conflicts
    assert "P5b" not in catalogue.default_selection()


def test_applying_twice_changes_nothing(catalogue, sessions):
    session = sessions("v0.20.1")
    assert_applies_once(catalogue, session, "P5b", version="0.20.1")


@pytest.mark.network  # reads releases' wheels (verify)
def test_upstream_from_0210_by_the_platform_turboquant_page():
    """0.21.0: the platform sizes the hybrid attention page from TurboQuant's packed layout
    (vllm#39931), so the Mamba page is padded to the real TurboQuant page and unify never sees
    pages that do not divide; the verdict names the branch, in the pristine file's lines."""
    kvspecs.assert_upstream_from_0210_by_the_platform_page("P5b")
