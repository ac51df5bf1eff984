"""P44 on real 0.20.1 source: mixed decode+prefill batches use a pooled, unzeroed output buffer.

Behaviour test by extraction: the patched ``TurboQuantAttentionImpl.forward`` and the pool
P44 adds are taken from the patched file and run with CPU torch; the decode and prefill
kernels are stand-ins (deterministic functions of the query) and ``TurboQuantMetadata`` a
plain namespace. The pristine ``forward`` runs on the same batch.
"""

import types

import pytest
import torch  # CPU build, from the test extras

from kiln.patch.engine import isolated_run  # noqa: E402
from kiln.patch.model import BuildTarget, Verdict  # noqa: E402
from tests.patchsets.support import turboquant_standins as tq  # noqa: E402
from tests.patchsets.support.patchlib import assert_applies_once, patched_files  # noqa: E402

HQ, HK, D = 4, 2, 8


@pytest.fixture(scope="module")
def pristine(sessions):
    return sessions("v0.20.1").tree.read(tq.TARGET)


@pytest.fixture(scope="module")
def patched(catalogue, sessions):
    return patched_files(catalogue, sessions("v0.20.1"), "P44")[tq.TARGET]


class Impl:
    """``self`` of TurboQuantAttentionImpl with stand-in decode/prefill attention."""

    num_heads, head_size, num_kv_heads = HQ, D, HK

    def _ensure_on_device(self, layer, device):
        layer._tq_Pi = layer._tq_PiT = torch.eye(D)
        layer._tq_centroids = torch.zeros(4)

    def _decode_attention(self, q, kv_cache, meta, Pi, centroids, PiT, layer):
        assert meta.num_actual_tokens == q.shape[0]
        return q * 2

    def _prefill_attention(self, q, k, v, kv_cache, meta, Pi, centroids, PiT, layer=None):
        assert meta.num_actual_tokens == q.shape[0]
        return q * 3 + k.repeat_interleave(HQ // HK, dim=1)


def _forward(source, patch_ids=()):
    namespace = tq.load(
        source,
        [],
        {**tq.module_namespace(), "AttentionLayer": object, "TurboQuantMetadata": types.SimpleNamespace},
        patch_ids,
    )
    return tq.load(source, ["TurboQuantAttentionImpl.forward"], namespace)


def _mixed_batch(num_decodes: int, prefill_lens: list[int], *, num_tokens: int | None = None, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    n = num_decodes + sum(prefill_lens)
    num_tokens = num_tokens or n
    q_lens = [1] * num_decodes + prefill_lens
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor([50] * num_decodes + [q + 7 for q in prefill_lens], dtype=torch.int32)
    meta = types.SimpleNamespace(
        seq_lens=seq_lens,
        slot_mapping=torch.arange(n),
        block_table=torch.zeros(len(q_lens), 4, dtype=torch.int32),
        query_start_loc=qsl,
        num_actual_tokens=n,
        max_query_len=max(q_lens),
        max_seq_len=int(seq_lens.max()),
        is_prefill=True,
        num_decodes=num_decodes,
        num_decode_tokens=num_decodes,
    )
    query = torch.randn(num_tokens, HQ * D, generator=gen).to(torch.bfloat16)
    key = torch.randn(num_tokens, HK * D, generator=gen).to(torch.bfloat16)
    return query, key, key.clone(), meta


def _call(namespace, batch, layer=None):
    query, key, value, meta = batch
    output = torch.full((query.shape[0], HQ * D), -7.0, dtype=query.dtype)
    return namespace["forward"](Impl(), layer or tq.Layer(), query, key, value, torch.empty(0), meta, output=output)


def test_mixed_batch_output_matches_pristine(pristine, patched):
    batch = _mixed_batch(3, [5, 4], num_tokens=16)  # padded: rows past N stay untouched
    assert torch.equal(_call(_forward(patched, ("P44",)), batch), _call(_forward(pristine), batch))


def test_buffer_is_pooled_across_calls_and_layers_and_never_zeroed(patched, pristine):
    namespace = _forward(patched, ("P44",))
    _call(namespace, _mixed_batch(2, [6]))  # N = 8
    (pool,) = namespace["_TQ_MIXED_BATCH_OUT"].values()
    assert pool.shape == (8, HQ, D) and pool.dtype == torch.bfloat16
    pool.fill_(float("nan"))  # whatever a previous layer left there
    smaller = _mixed_batch(1, [4], seed=1)  # N = 5, another layer
    out = _call(namespace, smaller, layer=tq.Layer())
    assert next(iter(namespace["_TQ_MIXED_BATCH_OUT"].values())) is pool  # reused, not reallocated
    assert not out.isnan().any()  # every row was written: no zero fill needed
    assert torch.equal(out, _call(_forward(pristine), smaller))


def test_a_larger_mixed_batch_grows_the_pool(patched, pristine):
    namespace = _forward(patched, ("P44",))
    _call(namespace, _mixed_batch(2, [3]))
    larger = _mixed_batch(4, [9, 7], seed=2)  # N = 20
    out = _call(namespace, larger)
    (pool,) = namespace["_TQ_MIXED_BATCH_OUT"].values()
    assert pool.shape[0] == 20
    assert torch.equal(out, _call(_forward(pristine), larger))


def test_pristine_zero_fills_a_fresh_buffer_every_call(pristine, monkeypatch):
    zeros_calls = []
    real_zeros = torch.zeros

    def spy(*args, **kwargs):
        zeros_calls.append(args)
        return real_zeros(*args, **kwargs)

    namespace = _forward(pristine)
    namespace["torch"] = types.SimpleNamespace(**{k: getattr(torch, k) for k in ("empty", "float16", "float32")}, zeros=spy)
    _call(namespace, _mixed_batch(2, [6]))
    _call(namespace, _mixed_batch(2, [6]))
    assert zeros_calls == [(8, HQ, D)] * 2


TARGET_FILE = "v1/attention/backends/turboquant_attn.py"


def test_verdicts(catalogue, sessions):
    session = sessions("v0.20.1")
    assert isolated_run(catalogue, session, BuildTarget(session.tree.vllm_version), "P44").outcomes["P44"].verdict is Verdict.APPLIES
    session = sessions("v0.33.0")
    outcome = isolated_run(catalogue, session, BuildTarget(session.tree.vllm_version), "P44").outcomes["P44"]
    # the zero fill is gone (torch.zeros became torch.empty); the allocation left is retired with it
    assert outcome.verdict is Verdict.UPSTREAM
    # the detail names the line of vLLM's own `attn_out = torch.empty(N, ...)` in the pristine file
    lines = session.tree.read(TARGET_FILE).splitlines()
    line = next(n for n, text in enumerate(lines, 1) if text.strip() == "attn_out = torch.empty(")
    assert f"allocates the mixed-batch output with torch.empty ({TARGET_FILE}:{line})" in outcome.detail
    assert "torch.zeros(" not in "\n".join(lines[line - 1:line + 6])


def test_applying_twice_is_already_patched(catalogue, sessions):
    session = sessions("v0.20.1")
    assert_applies_once(catalogue, session, "P44")
