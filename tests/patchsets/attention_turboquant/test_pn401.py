"""PN401 on real 0.20.1 and 0.33.0 source: the flash fast path no longer drops a co-batched cached prefix.

Behaviour test by extraction (``tests/patchsets/support/tq_prefill.py``): the patched
``TurboQuantMetadata``, ``TurboQuantMetadataBuilder.build`` (+ the check PN401 adds),
``TurboQuantAttentionImpl.forward`` and ``_prefill_attention``, and the tree's own
``split_decodes_and_prefills``, run on CPU. The decode kernel and flash attention are exact
stand-ins over an fp16 stand-in cache; the output is compared with attention computed
independently over each request's true context. The pristine code runs on the same batches
to show the failure is real on that source.
"""

from __future__ import annotations

import pytest
import torch

from kiln.patch.engine import isolated_run, run_selection
from kiln.patch.model import BuildTarget, Verdict
from tests.patchsets.support import tq_prefill as tp
from tests.patchsets.support.patchlib import assert_applies_once, patched_files

LABELS = ["v0.20.1", "v0.33.0"]
PATCHED_BUILDER = ("build", "_prefill_has_cached_prefix")
TOLERANCE = 2e-3  # fp16 output rounding

# fresh prompt as long as the batch + a request with a cached prefix (q_len < seq_len)
CACHED_PREFIX_BATCHES = {
    "chunked-prefill continuation": [tp.Row(40, 40), tp.Row(10, 32)],
    "MTP verify row": [tp.Row(40, 40), tp.Row(4, 30)],
    "prefix-cache hit, longest request": [tp.Row(40, 40), tp.Row(24, 40)],
    "mixed: decode + fresh + continuation": [tp.Row(1, 20), tp.Row(40, 40), tp.Row(10, 32)],
}
FRESH_BATCHES = {
    "fresh prompts": [tp.Row(40, 40), tp.Row(25, 25)],
    "mixed: decode + fresh prompts": [tp.Row(1, 20), tp.Row(40, 40), tp.Row(25, 25)],
}


@pytest.fixture(scope="module")
def backends(catalogue, sessions):
    """label -> (pristine Backend factory, patched Backend factory)."""
    out = {}
    for label in LABELS:
        tree = sessions(label).tree
        pristine, utils = tree.read(tp.TARGET), tree.read(tp.UTILS)
        patched = patched_files(catalogue, sessions(label), "PN401")[tp.TARGET]
        out[label] = (
            lambda text=pristine, u=utils: tp.Backend(text, u),
            lambda text=patched, u=utils: tp.Backend(text, u, PATCHED_BUILDER),
        )
    return out


@pytest.mark.parametrize("label", LABELS)
@pytest.mark.parametrize("case", sorted(CACHED_PREFIX_BATCHES))
def test_cached_prefix_is_attended(backends, label, case):
    pristine, patched = backends[label]
    batch = tp.Batch(CACHED_PREFIX_BATCHES[case])
    reference = batch.reference()
    fixed = patched()
    assert (fixed.forward(batch) - reference).abs().max() < TOLERANCE
    # every flash call of the patched code covers a fresh prompt only (q offsets == k offsets,
    # one request per call): no row with a cached prefix went to flash
    assert all(len(cu_q) == 2 for cu_q, _ in fixed.flash_calls), fixed.flash_calls
    broken = pristine()
    assert (broken.forward(batch) - reference).abs().max() > 0.1  # the failure on this source
    assert len(broken.flash_calls) == 1 and len(broken.flash_calls[0][0]) > 2  # one call, whole batch


@pytest.mark.parametrize("label", LABELS)
@pytest.mark.parametrize("case", sorted(FRESH_BATCHES))
def test_fresh_prompts_keep_one_flash_call(backends, label, case):
    _, patched = backends[label]
    batch = tp.Batch(FRESH_BATCHES[case])
    backend = patched()
    assert (backend.forward(batch) - batch.reference()).abs().max() < TOLERANCE
    (call,) = backend.flash_calls
    assert call[0] == call[1] and len(call[0]) == 3  # the two prompts in one call


@pytest.mark.parametrize("label", LABELS)
def test_builder_flag(backends, label):
    _, patched = backends[label]
    backend = patched()
    flag = "prefill_has_cached_prefix"
    assert getattr(backend.metadata(tp.Batch([tp.Row(40, 40), tp.Row(25, 25)])), flag) is False
    assert getattr(backend.metadata(tp.Batch([tp.Row(40, 40), tp.Row(4, 30)])), flag) is True
    # decodes before the prefills do not count: their q_len (1) is always below seq_len
    assert getattr(backend.metadata(tp.Batch([tp.Row(1, 20), tp.Row(40, 40)])), flag) is False
    # an optimistic host bound on a verify row still says "cached prefix"
    assert getattr(backend.metadata(tp.Batch([tp.Row(40, 40), tp.Row(4, 30, host_extra=3)])), flag) is True
    cam = tp.Batch([tp.Row(40, 40)]).common_metadata()
    cam.seq_lens_cpu_upper_bound = None  # host lengths unknown: take the path that reads the cache
    assert getattr(backend.builder.build(0, cam), flag) is True
    # the dataclass default for metadata built elsewhere
    fields = backend.namespace["TurboQuantMetadata"].__dataclass_fields__
    assert fields[flag].default is True


@pytest.mark.parametrize("label", LABELS)
def test_verdict_applies(catalogue, sessions, label):
    session = sessions(label)
    outcome = isolated_run(catalogue, session, BuildTarget(session.tree.vllm_version), "PN401").outcomes["PN401"]
    assert outcome.verdict is Verdict.APPLIES, outcome.detail


def test_upstream_guard_retires_it(catalogue, sessions):
    """vllm#46461's shape (a `_has_continuation` guard on the fast path) reads UPSTREAM, with file:line."""
    import libcst as cst

    session = sessions("v0.33.0")
    text = session.tree.read(tp.TARGET)
    bare = "if _HAS_FLASH_ATTN and attn_metadata.max_query_len == attn_metadata.max_seq_len:"
    assert text.count(bare) == 1
    guarded = text.replace(bare, bare[:-1] + " and not _has_continuation:")
    fixed = session.overlay({tp.TARGET: cst.parse_module(guarded)})
    outcome = isolated_run(catalogue, fixed, BuildTarget(session.tree.vllm_version), "PN401").outcomes["PN401"]
    line = guarded[: guarded.index(bare[:-1])].count("\n") + 1
    assert outcome.verdict is Verdict.UPSTREAM
    assert f"{tp.TARGET}:{line}:" in outcome.detail


def test_composes_with_the_other_turboquant_patches(catalogue, sessions):
    session = sessions("v0.20.1")
    ids = ["P22", "P38", "P44", "P65", "PN401"]
    result = run_selection(catalogue, session, BuildTarget(session.tree.vllm_version), ids)
    assert {pid: o.verdict for pid, o in result.outcomes.items()} == dict.fromkeys(ids, Verdict.APPLIES)
    result = run_selection(catalogue, session, BuildTarget(session.tree.vllm_version), ["P67", "PN401"])
    assert all(o.verdict is Verdict.APPLIES for o in result.outcomes.values()), result.outcomes


def test_applying_twice_is_already_patched(catalogue, sessions):
    session = sessions("v0.33.0")
    assert_applies_once(catalogue, session, "PN401")


def test_reference_is_not_trivial():
    batch = tp.Batch(CACHED_PREFIX_BATCHES["chunked-prefill continuation"])
    assert batch.reference().abs().max() > 0.1
    assert torch.isfinite(batch.reference()).all()
