"""P22 on real 0.20.1 source: shared dequant buffers reserved at construction, device-side cu_seqlens.

Behaviour test by extraction: the patched ``TurboQuantAttentionImpl.__init__`` and
``_continuation_prefill``, plus the module-level pool P22 adds, are taken from the patched
file and run with CPU torch against stand-ins (``tests/patchsets/support/turboquant_standins.py``:
the Triton dequant kernel is a gather from an fp16 stand-in cache, flash-attn a causal SDPA).
The pristine method runs on the same inputs to show what changes.
"""

import pytest
import torch  # CPU build, from the test extras

from kiln.patch.engine import isolated_run  # noqa: E402
from kiln.patch.model import BuildTarget, Verdict  # noqa: E402
from tests.patchsets.support import turboquant_standins as tq  # noqa: E402
from tests.patchsets.support.patchlib import assert_applies_once, patched_files  # noqa: E402

METHOD = "TurboQuantAttentionImpl._continuation_prefill"


@pytest.fixture(scope="module")
def pristine(sessions):
    return sessions("v0.20.1").tree.read(tq.TARGET)


@pytest.fixture(scope="module")
def patched(catalogue, sessions):
    return patched_files(catalogue, sessions("v0.20.1"), "P22")[tq.TARGET]


def _run(namespace, inputs, *, layer, self=None):
    self = self or tq.impl(key_fp8=True, head_size=inputs["query"].shape[2])
    return namespace["_continuation_prefill"](
        self,
        layer,
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


def test_init_reserves_one_pair_for_all_layers_at_max_model_len(patched, monkeypatch):
    namespace = tq.load(patched, [], tq.module_namespace(), ("P22",))
    config = tq.vllm_config(max_model_len=1000, block_size=16)
    tq.exec_init(patched, namespace, config, monkeypatch)
    k_buf, v_buf = namespace["_TQ_SHARED_DEQUANT_BUFFERS"][(2, 16)]
    assert k_buf.shape == v_buf.shape == (1, 2, 1008, 16)  # 1000 rounded up to the block size
    assert k_buf.dtype == torch.float16 and k_buf.data_ptr() != v_buf.data_ptr()
    tq.exec_init(patched, namespace, config, monkeypatch)  # another layer: same pair, no new allocation
    assert namespace["_TQ_SHARED_DEQUANT_BUFFERS"][(2, 16)][0] is k_buf


@pytest.mark.parametrize(
    "config",
    [tq.vllm_config(max_num_batched_tokens=128), tq.vllm_config(model=False)],
    ids=["no-continuation-prefill", "no-model-config"],
)
def test_init_reserves_nothing_when_continuation_prefill_cannot_happen(patched, monkeypatch, config):
    namespace = tq.load(patched, [], tq.module_namespace(), ("P22",))
    tq.exec_init(patched, namespace, config, monkeypatch)
    assert namespace["_TQ_SHARED_DEQUANT_BUFFERS"] == {}


def test_layers_dequantize_into_the_reserved_pair(patched, pristine, monkeypatch):
    kernel = tq.dequant_kernel()
    namespace = tq.load(patched, [METHOD], tq.module_namespace(kernel), ("P22",))
    tq.exec_init(patched, namespace, tq.vllm_config(max_model_len=1000), monkeypatch)
    k_buf, v_buf = namespace["_TQ_SHARED_DEQUANT_BUFFERS"][(2, 16)]
    layers = [tq.Layer(), tq.Layer()]
    for seed, layer in enumerate(layers):
        inputs = tq.continuation_inputs(cached_len=300, q_len=140, seed=seed)
        actual = _run(namespace, inputs, layer=layer)
        expected = _run(tq.load(pristine, [METHOD], tq.module_namespace()), inputs, layer=tq.Layer())
        assert torch.equal(actual, expected)
    assert [(k.data_ptr(), v.data_ptr()) for k, v in kernel.outputs] == [(k_buf.data_ptr(), v_buf.data_ptr())] * 2
    assert namespace["_TQ_SHARED_DEQUANT_BUFFERS"][(2, 16)][0] is k_buf  # reserved pair, never regrown
    assert not any(hasattr(layer, "_tq_k_dequant_buf") for layer in layers)


def test_pristine_allocates_dequant_buffers_per_layer(pristine):
    namespace = tq.load(pristine, [METHOD], tq.module_namespace())
    layers = [tq.Layer(), tq.Layer()]
    for layer in layers:
        _run(namespace, tq.continuation_inputs(cached_len=300, q_len=140), layer=layer)
    assert layers[0]._tq_k_dequant_buf.data_ptr() != layers[1]._tq_k_dequant_buf.data_ptr()


def test_a_longer_prefix_than_reserved_grows_the_pool(patched, pristine):
    namespace = tq.load(patched, [METHOD], tq.module_namespace(), ("P22",))
    namespace["_tq_shared_dequant_buffers"](2, 16, 64, "cpu")
    inputs = tq.continuation_inputs(cached_len=100, q_len=20)
    actual = _run(namespace, inputs, layer=tq.Layer())
    assert namespace["_TQ_SHARED_DEQUANT_BUFFERS"][(2, 16)][0].shape[2] == 112  # 100 rounded to blocks
    assert torch.equal(actual, _run(tq.load(pristine, [METHOD], tq.module_namespace()), inputs, layer=tq.Layer()))


def test_cu_seqlens_stay_on_the_device_and_are_updated_in_place(patched, pristine):
    calls: list = []
    self = tq.impl(key_fp8=False, head_size=16, flash_attn_varlen=tq.sdpa_flash_attn_varlen(calls))
    namespace = tq.load(patched, [METHOD], tq.module_namespace(flash_attn=True), ("P22",))
    first = tq.continuation_inputs(cached_len=40, q_len=24, seed=1)
    second = tq.continuation_inputs(cached_len=70, q_len=31, seed=2)
    out = _run(namespace, first, layer=tq.Layer(), self=self)
    _run(namespace, second, layer=tq.Layer(), self=self)
    assert [(c["q_vals"], c["k_vals"]) for c in calls] == [([0, 24], [0, 64]), ([0, 31], [0, 101])]
    assert calls[0]["cu_q"] is not calls[1]["cu_q"]  # views ...
    assert calls[0]["cu_q"].data_ptr() == calls[1]["cu_q"].data_ptr()  # ... of one tensor
    assert calls[0]["cu_k"].data_ptr() == calls[1]["cu_k"].data_ptr()
    assert calls[0]["cu_q"].dtype == torch.int32 and calls[0]["cu_q"].is_contiguous()

    pristine_calls: list = []
    self = tq.impl(key_fp8=False, head_size=16, flash_attn_varlen=tq.sdpa_flash_attn_varlen(pristine_calls))
    expected = _run(tq.load(pristine, [METHOD], tq.module_namespace(flash_attn=True)), first, layer=tq.Layer(), self=self)
    assert torch.equal(out, expected)


def test_verdicts(catalogue, sessions):
    session = sessions("v0.20.1")
    assert isolated_run(catalogue, session, BuildTarget(session.tree.vllm_version), "P22").outcomes["P22"].verdict is Verdict.APPLIES
    session = sessions("v0.33.0")
    outcome = isolated_run(catalogue, session, BuildTarget(session.tree.vllm_version), "P22").outcomes["P22"]
    assert outcome.verdict is Verdict.UPSTREAM
    assert "_reserve_workspace" in outcome.detail and "WorkspaceManager" in outcome.detail


def test_applying_twice_is_already_patched(catalogue, sessions):
    session = sessions("v0.20.1")
    assert_applies_once(catalogue, session, "P22")
