"""PN353A on real 0.21.0, 0.22.1 and 0.23.0 source: TurboQuant scratch is reserved before the lock.

What runs: the tree's real ``WorkspaceManager`` (``v1/worker/workspace.py``, on CPU;
``tests/patchsets/support/tq_workspace.py``), the (patched) ``TurboQuantMetadataBuilder.__init__``
and the reservation method PN353A adds, and the tree's own ``_continuation_prefill`` and
``_decode_attention`` extracted from the backend (``turboquant_standins``: the dequant kernel
is a gather from an fp16 stand-in cache, the decode kernel a recorder). The engine's order is
replayed: build the metadata builder (profile run), lock the workspace (end of
``capture_model``), then serve a long continuation chunk and a decode step.
"""

from __future__ import annotations

import types

import pytest
import torch
from packaging.version import Version

from kiln.patch.engine import Session, isolated_run
from kiln.patch.model import BuildTarget, Verdict
from kiln.source.wheel import WheelSource
from tests.patchsets.support import tq_workspace as ws
from tests.patchsets.support import turboquant_standins as tq
from tests.patchsets.support.patchlib import patched_files

# releases' wheels from PyPI on a machine whose kiln cache lacks them (tests/conftest.py keeps this true)
pytestmark = pytest.mark.network

RELEASES = ["0.21.0", "0.22.1", "0.23.0"]
METHOD = "_reserve_tq_workspace"


@pytest.fixture(scope="module")
def sources():
    return {v: Session(WheelSource(Version(v)).fetch()) for v in RELEASES}


@pytest.fixture(scope="module")
def texts(catalogue, sources):
    """release -> (pristine backend, patched backend, workspace.py)."""
    out = {}
    for version, session in sources.items():
        tree = session.tree
        out[version] = (tree.read(tq.TARGET), patched_files(catalogue, session, "PN353A")[tq.TARGET], tree.read(ws.WORKSPACE))
    return out


def _engine(backend_text, workspace_text, monkeypatch, *, methods=(METHOD,), **config):
    """A fresh manager, the builder constructed on it (profile run), then the lock."""
    workspace = ws.load_workspace(workspace_text, monkeypatch)
    workspace.init_workspace_manager(torch.device("cpu"))
    builder_cls = ws.builder(backend_text, workspace, methods)
    builder = builder_cls(ws.kv_cache_spec(), ["layers.3.attn"], ws.vllm_config(**config), torch.device("cpu"))
    assert builder.reorder_batch_threshold == 1
    workspace.lock_workspace()
    return workspace


def _continuation(backend_text, workspace, *, cached_len, q_len=140):
    namespace = tq.module_namespace()
    namespace.update(current_workspace_manager=workspace.current_workspace_manager)
    tq.load(backend_text, ["TurboQuantAttentionImpl._continuation_prefill"], namespace)
    inputs = tq.continuation_inputs(cached_len=cached_len, q_len=q_len)
    self = tq.impl(key_fp8=True, head_size=16)
    return namespace["_continuation_prefill"](
        self, tq.Layer(), inputs["query"], inputs["key_chunk"], inputs["val_chunk"], inputs["kv_cache"],
        inputs["block_table"], inputs["cached_len"], inputs["seq_len"], inputs["Pi"], inputs["centroids"],
    )


def _decode(backend_text, workspace, *, rows):
    taken = []

    def kernel(**kwargs):
        taken.append(kwargs)
        return torch.empty_like(kwargs["query"])

    namespace = {
        "torch": torch,
        "triton_turboquant_decode_attention": kernel,
        "current_workspace_manager": workspace.current_workspace_manager,
        "is_workspace_manager_initialized": workspace.is_workspace_manager_initialized,
        "TurboQuantMetadata": object,
    }
    tq.load(backend_text, ["TurboQuantAttentionImpl._decode_attention"], namespace)
    self = types.SimpleNamespace(head_size=16, num_heads=4, max_num_kv_splits=8, scale=0.25,
                                 tq_config=types.SimpleNamespace(key_mse_bits=0, key_packed_size=16,
                                                                 effective_value_quant_bits=4, key_fp8=True,
                                                                 norm_correction=False))
    metadata = types.SimpleNamespace(block_table=torch.zeros(rows, 4, dtype=torch.int32),
                                     seq_lens=torch.full((rows,), 20, dtype=torch.int32))
    query = torch.zeros(rows, 4, 16, dtype=torch.bfloat16)
    namespace["_decode_attention"](self, query, torch.zeros(8, 16, 2, 40, dtype=torch.uint8), metadata, None, None)
    return taken[0]


@pytest.mark.parametrize("version", RELEASES)
def test_long_continuation_after_the_lock(texts, version, monkeypatch):
    pristine, patched, workspace_text = texts[version]
    workspace = _engine(patched, workspace_text, monkeypatch)
    out = _continuation(patched, workspace, cached_len=860, q_len=139)
    reference = _continuation(pristine, _unlocked(workspace_text, monkeypatch), cached_len=860, q_len=139)
    assert torch.equal(out, reference)
    # the longest prefix max_model_len (1000) allows: 999 cached tokens, alloc_len 1008
    _continuation(patched, workspace, cached_len=999, q_len=140)

    broken = _engine(pristine, workspace_text, monkeypatch, methods=())
    with pytest.raises(AssertionError, match="Workspace is locked"):
        _continuation(pristine, broken, cached_len=860, q_len=139)


@pytest.mark.parametrize("version", RELEASES)
def test_decode_after_the_lock(texts, version, monkeypatch):
    pristine, patched, workspace_text = texts[version]
    # decode scratch alone (no continuation reservation that would also cover it)
    workspace = _engine(patched, workspace_text, monkeypatch, max_num_batched_tokens=128)
    call = _decode(patched, workspace, rows=4)  # max_num_seqs rows
    assert call["mid_o_buf"].shape == (4, 4, 8, 17) and call["output_buf"].dtype == torch.bfloat16
    base = workspace.current_workspace_manager()._current_workspaces[0].data_ptr()
    assert call["mid_o_buf"].data_ptr() == base  # a view of the reserved workspace

    broken = _engine(pristine, workspace_text, monkeypatch, methods=())
    with pytest.raises(AssertionError, match="Workspace is locked"):
        _decode(pristine, broken, rows=4)


@pytest.mark.parametrize("version", RELEASES)
def test_short_chunks_reserve_the_decode_scratch_only(texts, version, monkeypatch):
    _, patched, workspace_text = texts[version]
    workspace = _engine(patched, workspace_text, monkeypatch, max_num_batched_tokens=128)
    size = workspace.current_workspace_manager()._current_workspaces[0].numel()
    decode_bytes = sum(-(-n // 256) * 256 for n in (4 * 4 * 8 * 17 * 4, 4 * 4 * 16 * 2, 4 * 4 * 4))
    assert size == decode_bytes


def _unlocked(workspace_text, monkeypatch):
    workspace = ws.load_workspace(workspace_text, monkeypatch)
    workspace.init_workspace_manager(torch.device("cpu"))
    return workspace


def test_verdicts(catalogue, sessions, sources):
    def verdict(session):
        return isolated_run(catalogue, session, BuildTarget(session.tree.vllm_version), "PN353A").outcomes["PN353A"]

    for session in sources.values():
        assert verdict(session).verdict is Verdict.APPLIES
    assert verdict(sessions("v0.20.1")).verdict is Verdict.GATED
    upstream = verdict(sessions("v0.33.0"))
    assert upstream.verdict is Verdict.UPSTREAM
    assert upstream.detail.startswith(f"{tq.TARGET}:243: TurboQuantMetadataBuilder._reserve_workspace")
    first = Session(WheelSource(Version("0.24.0")).fetch())  # vllm#44053's release
    assert verdict(first).verdict is Verdict.UPSTREAM


def test_applying_twice_is_already_patched(catalogue, sources):
    session = sources["0.21.0"]
    target = BuildTarget(session.tree.vllm_version)
    first = isolated_run(catalogue, session, target, "PN353A")
    again = isolated_run(catalogue, session.overlay(first.state.changed), target, "PN353A")
    assert again.outcomes["PN353A"].verdict is Verdict.ALREADY_PATCHED
