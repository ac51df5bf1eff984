"""P38 on real 0.20.1 and 0.33.0 source: continuation prefill writes K/V into shared persistent buffers.

Behaviour test by extraction: the patched ``TurboQuantAttentionImpl._continuation_prefill``
and ``__init__``, plus the module-level pool P38 adds, are taken from the patched file and
run with CPU torch against stand-ins (``tests/patchsets/support/turboquant_standins.py``): the Triton
dequant kernel becomes a gather from an fp16 stand-in cache, the SDPA fallback
(``_HAS_FLASH_ATTN`` false) is vLLM's own code. The pristine method runs on the same inputs.
On 0.33.0 the method's dequant buffers come from a stand-in ``current_workspace_manager()``.
"""

import pytest
import torch  # CPU build, from the test extras

from kiln.patch.engine import isolated_run, run_selection  # noqa: E402
from kiln.patch.model import BuildTarget, Verdict  # noqa: E402
from tests.patchsets.support import turboquant_standins as tq  # noqa: E402
from tests.patchsets.support.patchlib import extract, patched_files  # noqa: E402

METHOD = "TurboQuantAttentionImpl._continuation_prefill"


@pytest.fixture(scope="module")
def pristine(sessions):
    return sessions("v0.20.1").tree.read(tq.TARGET)


@pytest.fixture(scope="module")
def patched(catalogue, sessions):
    return patched_files(catalogue, sessions("v0.20.1"), "P38")[tq.TARGET]


def _recording_sdpa(seen: list):
    real = torch.nn.functional.scaled_dot_product_attention

    def sdpa(q, k, v, **kwargs):
        seen.append(k)
        return real(q, k, v, **kwargs)

    return sdpa


def _prefill(source, patch_ids=(), seen=None):
    namespace = tq.module_namespace()
    if seen is not None:
        namespace["F"] = type("F", (), {"scaled_dot_product_attention": staticmethod(_recording_sdpa(seen))})
    tq.load(source, [METHOD], namespace, patch_ids)
    return namespace


def _run(namespace, *, key_fp8, inputs, layer=None):
    self = tq.impl(key_fp8=key_fp8, head_size=inputs["query"].shape[2])
    return namespace["_continuation_prefill"](
        self,
        layer or tq.Layer(),
        inputs["query"],
        inputs["key_chunk"],
        inputs["val_chunk"],
        inputs["kv_cache"],
        inputs["block_table"],
        inputs["cached_len"],
        inputs["seq_len"],
        inputs["Pi"],
        inputs["centroids"],
    )


@pytest.mark.parametrize("key_fp8", [True, False], ids=["fp8-keys", "mse-keys"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_output_is_identical_to_the_pristine_method(pristine, patched, key_fp8, dtype):
    inputs = tq.continuation_inputs(cached_len=37, q_len=9, dtype=dtype)
    expected = _run(_prefill(pristine), key_fp8=key_fp8, inputs=inputs)
    actual = _run(_prefill(patched, ("P38",)), key_fp8=key_fp8, inputs=inputs)
    assert actual.dtype == expected.dtype
    assert torch.equal(actual, expected)


def test_kv_full_lives_in_one_shared_buffer_reused_across_calls_and_layers(patched):
    seen: list = []
    namespace = _prefill(patched, ("P38",), seen)
    first = tq.continuation_inputs(cached_len=60, q_len=20, seed=1)  # seq_len 80
    _run(namespace, key_fp8=False, inputs=first, layer=tq.Layer())
    (k_pool, v_pool) = namespace["_TQ_SHARED_KV_FULL"][(2, 16, torch.bfloat16)]
    assert k_pool.shape == (80, 2, 16)
    second = tq.continuation_inputs(cached_len=30, q_len=10, seed=2)  # shorter, other layer
    _run(namespace, key_fp8=True, inputs=second, layer=tq.Layer())
    assert namespace["_TQ_SHARED_KV_FULL"][(2, 16, torch.bfloat16)][0] is k_pool  # not reallocated
    # what the attention read is a view of the pool (no fresh torch.cat result)
    assert [k.untyped_storage().data_ptr() for k in seen] == [k_pool.untyped_storage().data_ptr()] * 2


def test_a_longer_sequence_grows_the_pool_and_stays_correct(pristine, patched):
    namespace = _prefill(patched, ("P38",))
    _run(namespace, key_fp8=False, inputs=tq.continuation_inputs(cached_len=20, q_len=10, seed=3))
    longer = tq.continuation_inputs(cached_len=70, q_len=30, seed=4)
    actual = _run(namespace, key_fp8=False, inputs=longer)
    assert namespace["_TQ_SHARED_KV_FULL"][(2, 16, torch.bfloat16)][0].shape[0] == 100
    assert torch.equal(actual, _run(_prefill(pristine), key_fp8=False, inputs=longer))


def test_pristine_method_builds_fresh_concatenations(pristine):
    seen: list = []
    namespace = _prefill(pristine, seen=seen)
    _run(namespace, key_fp8=True, inputs=tq.continuation_inputs(cached_len=37, q_len=9))
    assert "_TQ_SHARED_KV_FULL" not in namespace and "_tq_shared_kv_full" not in namespace
    (k_t,) = seen
    assert k_t.shape[2] == 46  # torch.cat of the 37 cached and 9 new positions


def test_init_reserves_the_pool_at_max_model_len_in_the_model_dtype(patched, monkeypatch):
    namespace = tq.load(patched, [], tq.module_namespace(), ("P38",))
    config = tq.vllm_config(max_model_len=1000, dtype=torch.float16)
    tq.exec_init(patched, namespace, config, monkeypatch)
    (k_pool, v_pool) = namespace["_TQ_SHARED_KV_FULL"][(2, 16, torch.float16)]
    assert k_pool.shape == v_pool.shape == (1000, 2, 16)
    tq.exec_init(patched, namespace, config, monkeypatch)  # a second layer shares it
    assert namespace["_TQ_SHARED_KV_FULL"][(2, 16, torch.float16)][0] is k_pool


@pytest.mark.parametrize(
    "config",
    [tq.vllm_config(max_num_batched_tokens=128), tq.vllm_config(model=False)],
    ids=["no-continuation-prefill", "no-model-config"],
)
def test_init_reserves_nothing_when_continuation_prefill_cannot_happen(patched, monkeypatch, config):
    namespace = tq.load(patched, [], tq.module_namespace(), ("P38",))
    tq.exec_init(patched, namespace, config, monkeypatch)
    assert namespace["_TQ_SHARED_KV_FULL"] == {}


def test_composes_with_p22_and_matches_pristine(catalogue, sessions, pristine):
    session = sessions("v0.20.1")
    result = run_selection(catalogue, session, BuildTarget(session.tree.vllm_version), ["P22", "P38"])
    assert {pid: o.verdict for pid, o in result.outcomes.items()} == {"P22": Verdict.APPLIES, "P38": Verdict.APPLIES}
    both = result.changed_text()[tq.TARGET]
    for key_fp8 in (True, False):
        inputs = tq.continuation_inputs(cached_len=45, q_len=19, seed=5)
        expected = _run(_prefill(pristine), key_fp8=key_fp8, inputs=inputs)
        assert torch.equal(_run(_prefill(both, ("P22", "P38")), key_fp8=key_fp8, inputs=inputs), expected)


def test_verdicts(catalogue, sessions):
    for label in ("v0.20.1", "v0.33.0"):
        session = sessions(label)
        outcome = isolated_run(catalogue, session, BuildTarget(session.tree.vllm_version), "P38").outcomes["P38"]
        assert outcome.verdict is Verdict.APPLIES, outcome.detail


# -- 0.33.0: vLLM copies into two fresh torch.empty buffers; P38 makes them views of the pool --


class _Workspace:
    """``current_workspace_manager()``: hands out the requested buffers (fresh, unzeroed)."""

    def get_simultaneous(self, *specs):
        return tuple(torch.empty(shape, dtype=dtype) for shape, dtype in specs)


@pytest.fixture(scope="module")
def pristine_0330(sessions):
    return sessions("v0.33.0").tree.read(tq.TARGET)


@pytest.fixture(scope="module")
def patched_0330(catalogue, sessions):
    return patched_files(catalogue, sessions("v0.33.0"), "P38")[tq.TARGET]


def _prefill_0330(source, patch_ids=(), seen=None):
    namespace = _prefill(source, patch_ids, seen)
    namespace["current_workspace_manager"] = _Workspace
    return namespace


def _run_0330(namespace, *, key_fp8, inputs):
    layer = tq.Layer()
    layer._tq_Pi_half = inputs["Pi"].half()  # what 0.33.0's rotation reads (fp16 matmul)
    self = tq.impl(key_fp8=key_fp8, head_size=inputs["query"].shape[2])
    self._soa_store = False  # the CUDA path (the SoA branch is ROCm's)
    return namespace["_continuation_prefill"](
        self, layer, inputs["query"], inputs["key_chunk"], inputs["val_chunk"], inputs["kv_cache"],
        inputs["block_table"], inputs["cached_len"], inputs["seq_len"], inputs["Pi"], inputs["centroids"],
    )


def test_0330_only_the_two_allocations_change(pristine_0330, patched_0330):
    assert "k_full = torch.empty(seq_len, Hk, D" in pristine_0330
    assert "k_full = torch.empty" not in patched_0330 and "v_full = torch.empty" not in patched_0330
    assert patched_0330.count("k_full, v_full = _tq_shared_kv_full(Hk, D, seq_len, qdtype, device)") == 1
    kept = ("k_flat = k_flat @ Pi_half", "if self._soa_store:", "k_full[:cached_len] = k_cached_trim.to(qdtype)")
    assert all(line in patched_0330 for line in kept)


@pytest.mark.parametrize("key_fp8", [True, False], ids=["fp8-keys", "mse-keys"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_0330_output_is_identical_to_the_pristine_method(pristine_0330, patched_0330, key_fp8, dtype):
    inputs = tq.continuation_inputs(cached_len=37, q_len=9, dtype=dtype, seed=6)
    expected = _run_0330(_prefill_0330(pristine_0330), key_fp8=key_fp8, inputs=inputs)
    actual = _run_0330(_prefill_0330(patched_0330, ("P38",)), key_fp8=key_fp8, inputs=inputs)
    assert actual.dtype == expected.dtype
    assert torch.equal(actual, expected)


def test_0330_pristine_allocates_per_call_patched_reads_the_pool(pristine_0330, patched_0330):
    fresh: list = []
    inputs = tq.continuation_inputs(cached_len=50, q_len=14, seed=7)
    for _ in range(2):
        _run_0330(_prefill_0330(pristine_0330, seen=fresh), key_fp8=True, inputs=inputs)
    assert len({k.untyped_storage().data_ptr() for k in fresh}) == 2  # a new buffer each call

    seen: list = []
    namespace = _prefill_0330(patched_0330, ("P38",), seen)
    _run_0330(namespace, key_fp8=True, inputs=inputs)
    _run_0330(namespace, key_fp8=False, inputs=tq.continuation_inputs(cached_len=20, q_len=5, seed=8))
    (k_pool, _) = namespace["_TQ_SHARED_KV_FULL"][(2, 16, torch.bfloat16)]
    assert k_pool.shape == (64, 2, 16)
    assert [k.untyped_storage().data_ptr() for k in seen] == [k_pool.untyped_storage().data_ptr()] * 2


def test_0330_init_reserves_the_pool(patched_0330, monkeypatch):
    namespace = tq.load(patched_0330, [], tq.module_namespace(), ("P38",))
    reserve = extract(patched_0330, "TurboQuantAttentionImpl.__init__")
    assert "# kiln P38: reserve the shared K/V buffers now" in reserve
    assert reserve.index("self.max_num_kv_splits") < reserve.index("_tq_shared_kv_full(")
    namespace["_tq_shared_kv_full"](2, 16, 1000, torch.float16, "cpu")  # what the reservation calls
    assert namespace["_TQ_SHARED_KV_FULL"][(2, 16, torch.float16)][0].shape == (1000, 2, 16)


@pytest.mark.parametrize("label", ["v0.20.1", "v0.33.0"])
def test_applying_twice_is_already_patched(catalogue, sessions, label):
    session = sessions(label)
    target = BuildTarget(session.tree.vllm_version)
    first = isolated_run(catalogue, session, target, "P38")
    again = isolated_run(catalogue, session.overlay(first.state.changed), target, "P38")
    assert again.outcomes["P38"].verdict is Verdict.ALREADY_PATCHED
