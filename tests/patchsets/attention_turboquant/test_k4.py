"""K4 on real 0.21.0 and 0.33.0 source: verify rows attend over the device lengths.

Behaviour test by extraction (``tests/patchsets/support/tq_prefill.py``): the patched
``TurboQuantMetadataBuilder.build``, ``TurboQuantAttentionImpl.forward`` and
``_prefill_attention`` and the tree's ``split_decodes_and_prefills`` run on CPU; the decode
kernel is an exact stand-in over an fp16 stand-in cache whose slots past every request's
length hold other (stale) values. A batch of MTP verify rows whose host
``seq_lens_cpu_upper_bound`` over-states the device ``seq_lens`` (async spec decode after a
rejection) is compared with attention over the true context. 0.20.1 runs pristine only: its
loop reads the device lengths, which is why the patch is gated there.
"""

from __future__ import annotations

import pytest
from packaging.version import Version

from kiln.patch.engine import Session, isolated_run, run_selection
from kiln.patch.model import BuildTarget, Verdict
from kiln.source.wheel import WheelSource
from tests.patchsets.support import tq_prefill as tp
from tests.patchsets.support.patchlib import patched_files

# releases' wheels from PyPI on a machine whose kiln cache lacks them (tests/conftest.py keeps this true)
pytestmark = pytest.mark.network

TOLERANCE = 2e-3
OVERSTATED = {
    "two verify rows, one over-stated": [tp.Row(4, 30, host_extra=2), tp.Row(4, 25)],
    "decode + over-stated verify row": [tp.Row(1, 20), tp.Row(4, 30, host_extra=3)],
    "over-stated verify row beside a long continuation chunk": [tp.Row(4, 26, host_extra=1), tp.Row(12, 40)],
}


@pytest.fixture(scope="module")
def session_0210():
    return Session(WheelSource(Version("0.21.0")).fetch())


@pytest.fixture(scope="module")
def sources(sessions, session_0210):
    return {"0.21.0": session_0210, "v0.33.0": sessions("v0.33.0")}


@pytest.mark.parametrize("label", ["0.21.0", "v0.33.0"])
@pytest.mark.parametrize("case", sorted(OVERSTATED))
def test_verify_rows_attend_their_true_context(catalogue, sources, label, case):
    session = sources[label]
    utils = session.tree.read(tp.UTILS)
    patched = patched_files(catalogue, session, "K4")[tp.TARGET]
    batch = tp.Batch(OVERSTATED[case])
    reference = batch.reference()
    fixed = tp.Backend(patched, utils)
    assert (fixed.forward(batch) - reference).abs().max() < TOLERANCE
    # one launch per continuation row (the single decode row goes through _decode_attention)
    launched = [lengths.tolist() for lengths in fixed.decode_calls if len(lengths) > 1]
    assert launched == [list(range(r.seq_len - r.q_len + 1, r.seq_len + 1)) for r in _continuations(batch)]
    broken = tp.Backend(session.tree.read(tp.TARGET), utils)
    assert (broken.forward(batch) - reference).abs().max() > 0.05  # the failure on this source


def _continuations(batch):
    return [row for row in batch.rows if 1 < row.q_len < row.seq_len]


@pytest.mark.parametrize("label", ["0.21.0", "v0.33.0"])
def test_exact_host_lengths_give_the_same_output(catalogue, sources, label):
    session = sources[label]
    utils = session.tree.read(tp.UTILS)
    # (the fresh prompt is shorter than the continuation: no flash fast path, PN401's business)
    batch = tp.Batch([tp.Row(1, 20), tp.Row(4, 30), tp.Row(20, 20), tp.Row(10, 32)])
    patched = tp.Backend(patched_files(catalogue, session, "K4")[tp.TARGET], utils).forward(batch)
    pristine = tp.Backend(session.tree.read(tp.TARGET), utils).forward(batch)
    assert (patched - pristine).abs().max() == 0
    assert (patched - batch.reference()).abs().max() < TOLERANCE


def test_0201_reads_device_lengths_so_it_is_gated(catalogue, sessions):
    session = sessions("v0.20.1")
    batch = tp.Batch(OVERSTATED["two verify rows, one over-stated"])
    pristine = tp.Backend(session.tree.read(tp.TARGET), session.tree.read(tp.UTILS))
    assert (pristine.forward(batch) - batch.reference()).abs().max() < TOLERANCE
    outcome = isolated_run(catalogue, session, BuildTarget(session.tree.vllm_version), "K4").outcomes["K4"]
    assert outcome.verdict is Verdict.GATED


@pytest.mark.parametrize("version", ["0.22.1", "0.24.0", "0.28.0", "0.32.0"])
def test_applies_on_every_release_since_0210(catalogue, version):
    session = Session(WheelSource(Version(version)).fetch())
    outcome = isolated_run(catalogue, session, BuildTarget(Version(version)), "K4").outcomes["K4"]
    assert outcome.verdict is Verdict.APPLIES, outcome.detail


def test_device_lengths_upstream_retire_it(catalogue, sessions):
    import libcst as cst

    session = sessions("v0.33.0")
    text = session.tree.read(tp.TARGET)
    host = "synth_seq_lens = _arange_cache[cached_len + 1 : seq_len + 1]"
    assert text.count(host) == 1
    device = "synth_seq_lens = attn_metadata.seq_lens[i] - q_len + 1 + _arange_cache[:q_len]"
    fixed = session.overlay({tp.TARGET: cst.parse_module(text.replace(host, device))})
    outcome = isolated_run(catalogue, fixed, BuildTarget(session.tree.vllm_version), "K4").outcomes["K4"]
    assert outcome.verdict is Verdict.UPSTREAM


def test_composes_with_pn401_and_the_spec_decode_choices(catalogue, sessions):
    session = sessions("v0.33.0")
    target = BuildTarget(session.tree.vllm_version)
    for ids in (["P65", "PN401", "K4"], ["P67", "PN401", "K4"]):
        result = run_selection(catalogue, session, target, ids)
        assert all(o.verdict is Verdict.APPLIES for o in result.outcomes.values()), result.outcomes
