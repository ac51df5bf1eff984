"""P67b on real 0.20.1 and 0.33.0 source: uniform verify batches become one decode launch.

What runs: ``TurboQuantAttentionImpl.forward``, ``_is_uniform_spec_verify`` and
``_spec_verify_attention`` are extracted from the *patched* backend file and executed on CPU
(``tests/patchsets/support/tq_interpret.py``; the impl's other methods are recording stand-ins).

- Routing without host syncs: the batch is built on the ``meta`` device, where reading any
  tensor value on the host raises, and the decode launcher is a recorder. The patched forward
  routes and launches; pristine 0.20.1 on the same input fails in ``_prefill_attention``'s
  ``.tolist()`` (the sync FULL cudagraph capture freezes).
- Numerics under Triton's interpreter (``TRITON_INTERPRET=1``): the real upstream store
  kernel fills a cache (turboquant_k8v4 and turboquant_4bit_nc, real Lloyd-Max centroids from
  the tree), then the patched forward runs the real upstream ``triton_turboquant_decode_attention``
  (and ``_fwd_kernel_stage2``) from the same tree, and the result is compared with a float64
  PyTorch decoder of the cache bytes doing causal attention, for GQA groups of 4 and 3, with a
  FULL-graph padding request in the batch.
"""

from __future__ import annotations

import types

import pytest
import torch
from packaging.version import Version

from kiln.patch.engine import isolated_run, run_selection
from kiln.patch.model import BuildTarget, Verdict
from tests.patchsets.support import tq_interpret as tq
from tests.patchsets.support.patchlib import patched_files

TARGET = "v1/attention/backends/turboquant_attn.py"
LABELS = ["v0.20.1", "v0.33.0"]


@pytest.mark.parametrize("label", LABELS)
def test_verdict_applies_on_both(catalogue, sessions, label):
    session = sessions(label)
    outcome = isolated_run(catalogue, session, BuildTarget(session.tree.vllm_version), "P67b").outcomes["P67b"]
    assert outcome.verdict is Verdict.APPLIES, outcome.detail
    assert set(outcome.files) == {TARGET}


def test_spec_as_decode_upstream_retires_it(catalogue, sessions):
    session = sessions("v0.33.0")
    text = session.tree.read(TARGET)
    assert text.count("supports_spec_as_decode=False") == 1
    import libcst as cst

    fixed = cst.parse_module(text.replace("supports_spec_as_decode=False", "supports_spec_as_decode=True"))
    outcome = isolated_run(catalogue, session.overlay({TARGET: fixed}), BuildTarget(Version("0.33.0")), "P67b")
    assert outcome.outcomes["P67b"].verdict is Verdict.UPSTREAM


def test_an_image_picks_p65_or_p67b(catalogue, sessions):
    session = sessions("v0.20.1")
    result = run_selection(catalogue, session, BuildTarget(Version("0.20.1")), ["P65", "P67b"])
    assert {pid: o.verdict for pid, o in result.outcomes.items()} == {"P65": Verdict.CONFLICT, "P67b": Verdict.CONFLICT}


class Recorder:
    """``triton_turboquant_decode_attention`` stand-in: keeps its arguments."""

    def __init__(self):
        self.calls = []

    def __call__(self, **kwargs):
        self.calls.append(kwargs)
        return torch.empty_like(kwargs["query"])


def _impl(text, launcher, layout=None, heads=(4, 1)):
    cls = tq.impl_class(text, {"triton_turboquant_decode_attention": launcher})
    return tq.make_impl(cls, layout or tq.TQLayout("turboquant_k8v4", 64), *heads, splits=4)


def _meta_forward(impl, metadata, num_heads=4, num_kv_heads=1, head_dim=64):
    n = metadata.num_actual_tokens
    query = torch.empty(n, num_heads * head_dim, dtype=torch.float16, device="meta")
    kv = torch.empty(n, num_kv_heads * head_dim, dtype=torch.float16, device="meta")
    cache = torch.empty(8, 16, num_kv_heads, 100, dtype=torch.uint8, device="meta")
    layer = types.SimpleNamespace(_tq_Pi=None, _tq_PiT=None, _tq_centroids=None)
    return impl.forward(layer, query, kv, kv, cache, metadata)


@pytest.mark.parametrize("label", LABELS)
def test_verify_batch_routes_without_reading_the_device(catalogue, sessions, label):
    text = patched_files(catalogue, sessions(label), "P67b")[TARGET]
    launcher = Recorder()
    impl = _impl(text, launcher)
    block_table = torch.arange(12, dtype=torch.int32).view(3, 4)
    metadata = tq.verify_metadata([40, 33, 0], block_table, q_len=4, device="meta")
    out = _meta_forward(impl, metadata)
    assert out.shape == (12, 4 * 64) and impl.paths == []  # neither pristine path ran
    (call,) = launcher.calls
    assert call["query"].shape == (12, 4, 64)
    assert call["seq_lens"].shape == (12,) and call["block_table"].shape == (12, 4)
    assert call["max_num_kv_splits"] == 4 and call["key_fp8"] is True


def test_pristine_forward_reads_lengths_on_the_host(sessions):
    pristine = sessions("v0.20.1").tree.read(TARGET)
    namespace = {"_HAS_FLASH_ATTN": False, "_CONTINUATION_DECODE_THRESHOLD": 128,
                 "triton_turboquant_decode_attention": Recorder()}
    cls = tq.impl_class(pristine, namespace, methods=("forward", "_prefill_attention"))
    impl = tq.make_impl(cls, tq.TQLayout("turboquant_k8v4", 64), 4, 1, splits=4)
    metadata = tq.verify_metadata([40, 33], torch.zeros(2, 4, dtype=torch.int32), q_len=4, device="meta")
    with pytest.raises((NotImplementedError, RuntimeError)) as raised:
        _meta_forward(impl, metadata)
    assert any(frame.name == "_prefill_attention" for frame in raised.traceback)


def test_synthetic_lengths_and_block_rows(catalogue, sessions):
    text = patched_files(catalogue, sessions("v0.20.1"), "P67b")[TARGET]
    launcher = Recorder()
    impl = _impl(text, launcher)
    block_table = torch.tensor([[7, 3, 0], [5, 0, 0], [0, 0, 0]], dtype=torch.int32)
    _meta_forward_cpu = tq.verify_metadata([20, 9, 0], block_table, q_len=3)  # last: padding
    query = torch.zeros(9, 4 * 64, dtype=torch.float16)
    impl.forward(types.SimpleNamespace(_tq_Pi=None, _tq_PiT=None, _tq_centroids=None), query,
                 query[:, :64], query[:, :64], torch.zeros(8, 16, 1, 100, dtype=torch.uint8), _meta_forward_cpu)
    (call,) = launcher.calls
    assert call["seq_lens"].tolist() == [18, 19, 20, 7, 8, 9, 0, 0, 0]
    assert call["block_table"].tolist() == [[7, 3, 0]] * 3 + [[5, 0, 0]] * 3 + [[0, 0, 0]] * 3


@pytest.mark.parametrize("label", LABELS)
def test_other_batches_keep_their_paths(catalogue, sessions, label):
    text = patched_files(catalogue, sessions(label), "P67b")[TARGET]
    impl = _impl(text, Recorder())
    table = torch.zeros(2, 4, dtype=torch.int32)
    uniform = tq.verify_metadata([40, 33], table, q_len=4)
    assert impl._is_uniform_spec_verify(uniform, 8)
    cases = {
        "ragged (4 + 2 tokens)": (tq.verify_metadata([40, 33], table, q_len=4), 6),
        "decodes first": (tq.verify_metadata([40, 33], table, q_len=4, num_decodes=1), 8),
        "fresh prompts": (tq.verify_metadata([4, 4], table, q_len=4), 8),
        "17-token chunks": (tq.verify_metadata([40, 33], table, q_len=17), 34),
        "single-token decode": (tq.verify_metadata([40, 33], table, q_len=1), 2),
    }
    for name, (metadata, n) in cases.items():
        assert not impl._is_uniform_spec_verify(metadata, n), name
    impl._soa_store = True  # 0.33.0's ROCm FlyDSL layout
    assert not impl._is_uniform_spec_verify(uniform, 8)


# --- numerics under Triton's interpreter --------------------------------------------------------


CASES = [
    ("v0.20.1", "turboquant_k8v4", 4),
    ("v0.20.1", "turboquant_4bit_nc", 3),
    ("v0.33.0", "turboquant_4bit_nc", 4),
    ("v0.33.0", "turboquant_k8v4", 3),
]


@pytest.fixture(scope="module")
def numerics(catalogue, sessions, tmp_path_factory):
    """Every case of this module in one interpreter subprocess (``tq_numerics``)."""
    where = tmp_path_factory.mktemp("p67b")
    cases = []
    for label in sorted({c[0] for c in CASES}):
        session = sessions(label)
        changed = patched_files(catalogue, session, "P67b")
        root = tq.write_root(session.tree, changed, where / label)
        for lab, preset, group in CASES:
            if lab == label:
                cases.append(dict(id=f"{label}-{preset}-{group}", root=root, backend=changed[TARGET],
                                  preset=preset, group=group, transposed=label == "v0.33.0"))
    return tq.interpret(cases, where)


@pytest.mark.parametrize(("label", "preset", "group"), CASES)
def test_routed_batch_matches_attention_over_the_dequantised_cache(numerics, label, preset, group):
    result = numerics[f"{label}-{preset}-{group}"]
    assert result["paths"] == []  # neither the decode nor the prefill path of the pristine chain
    assert result["launched"] == {"triton_turboquant_decode_attention": 1}
    assert result["max_abs_ref"] > 0.05  # a real signal, not an all-zero output
    assert result["max_abs_err"] < 2e-3, result  # fp16 output rounding
