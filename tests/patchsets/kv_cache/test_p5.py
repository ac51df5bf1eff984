"""P5 on real 0.20.1 source: hybrid KV page sizes unify at a multiple of the attention LCM.

Behaviour test by extraction: the patched ``unify_kv_cache_spec_page_size`` is taken from the
patched ``v1/core/kv_cache_utils.py`` and run on vLLM's *real* spec classes
(``TQFullAttentionSpec``, ``MambaSpec``, ... extracted from the pristine
``v1/kv_cache_interface.py`` and executed with a torch stand-in, see ``kvspecs``); the real
modules import torch and CUDA extensions.
"""

from dataclasses import replace

import pytest

from kiln.patch.engine import isolated_run
from kiln.patch.model import BuildTarget, Verdict
from tests.patchsets.support import kvspecs
from tests.patchsets.support.kvspecs import BLOCK_SIZE, MAMBA_PADDED_PAGE, TORCH, TQ_PAGE
from tests.patchsets.support.patchlib import assert_applies_once, patched_files

TARGET = "v1/core/kv_cache_utils.py"


@pytest.fixture(scope="module")
def specs(trees):
    return kvspecs.spec_classes(trees("v0.20.1"))


@pytest.fixture(scope="module")
def unify(catalogue, sessions, specs):
    return kvspecs.unify_function(patched_files(catalogue, sessions("v0.20.1"), "P5")[TARGET], specs)


@pytest.fixture(scope="module")
def pristine_unify(trees, specs):
    return kvspecs.unify_function(trees("v0.20.1").read(TARGET), specs)


def test_pristine_rejects_the_turboquant_hybrid(pristine_unify, specs):
    assert MAMBA_PADDED_PAGE % TQ_PAGE != 0
    with pytest.raises(NotImplementedError, match="not divisible"):
        pristine_unify(kvspecs.qwen36_tq_hybrid(specs))


def test_turboquant_hybrid_unifies_at_the_attention_lcm(unify, specs):
    layers = kvspecs.qwen36_tq_hybrid(specs)
    out = unify(layers)
    target = 2 * TQ_PAGE  # smallest multiple of the TQ page >= the padded Mamba page
    assert {spec.page_size_bytes for spec in out.values()} == {target}
    for name, spec in out.items():
        if isinstance(spec, specs.TQFullAttentionSpec):
            # attention grows by whole blocks, never padded
            assert spec.block_size == 2 * BLOCK_SIZE
            assert spec.page_size_padded is None
            assert spec.real_page_size_bytes == target
        else:
            assert isinstance(spec, specs.MambaSpec)
            assert spec.block_size == BLOCK_SIZE  # Mamba pages do not scale with block_size
            assert spec.page_size_padded == target
            assert spec.shapes == layers[name].shapes
    # the cost Genesis measured on Qwen3.6 + k8v4: +51.6% per Mamba page
    assert target / MAMBA_PADDED_PAGE == pytest.approx(1.516, abs=1e-3)


def test_inputs_upstream_accepts_unify_as_before(unify, pristine_unify, specs):
    def full(block_size, heads):
        return specs.FullAttentionSpec(block_size=block_size, num_kv_heads=heads, head_size=128, dtype=TORCH.bfloat16)

    layers = {"a": full(16, 8), "b": full(16, 2), "c": full(32, 1), "d": full(16, 8)}
    assert unify(layers) == pristine_unify(layers)
    assert {s.page_size_bytes for s in unify(layers).values()} == {16 * 8 * 256 * 2}


def test_smaller_mamba_page_is_padded_not_asserted(unify, pristine_unify, specs):
    """A Mamba page below a (divisible) attention page: upstream scales Mamba's block_size,
    which does not change its page, and fails its assertion."""
    attention = specs.FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=8, head_size=256, dtype=TORCH.bfloat16)
    mamba = specs.MambaSpec(block_size=BLOCK_SIZE, shapes=kvspecs.GDN_SHAPES, dtypes=(TORCH.bfloat16, TORCH.float32))
    layers = {"attn": attention, "mamba": replace(mamba, page_size_padded=attention.page_size_bytes // 2)}
    with pytest.raises(AssertionError):
        pristine_unify(layers)
    out = unify(layers)
    assert out["attn"] is attention
    assert out["mamba"].page_size_padded == attention.page_size_bytes


@pytest.mark.parametrize(("label", "expected"), [("v0.20.1", Verdict.APPLIES), ("v0.33.0", Verdict.UPSTREAM)])
def test_verdicts(catalogue, sessions, label, expected):
    session = sessions(label)
    outcome = isolated_run(catalogue, session, BuildTarget(session.tree.vllm_version), "P5").outcomes["P5"]
    assert outcome.verdict is expected, outcome.detail
    if expected is Verdict.UPSTREAM:
        assert "kv_cache_planning.py" in outcome.detail


def test_applying_twice_changes_nothing(catalogue, sessions):
    session = sessions("v0.20.1")
    assert_applies_once(catalogue, session, "P5", version="0.20.1")


@pytest.mark.network  # reads releases' wheels (verify)
def test_upstream_from_0210_by_the_platform_turboquant_page():
    """0.21.0: the platform sizes the hybrid attention page from TurboQuant's packed layout
    (vllm#39931), so the Mamba page is padded to the real TurboQuant page and unify never sees
    pages that do not divide; the verdict names the branch, in the pristine file's lines."""
    kvspecs.assert_upstream_from_0210_by_the_platform_page("P5")
