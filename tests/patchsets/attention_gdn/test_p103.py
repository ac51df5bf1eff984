"""P103 on real 0.33.0 source: the GDN prefill gives the stock outputs with h bounded by the window.

What runs, under Triton's interpreter (``TRITON_INTERPRET=1``, CPU torch) in a fresh process:
0.33.0's whole FLA ops package (``third_party/flash_linear_attention/ops``: chunk, chunk_delta_h,
chunk_o, solve_tril, ...) twice, pristine and with P103's ``chunk.py``, loaded side by side with
stand-ins for the few vLLM modules they import (``tests/patchsets/support/fla_interpret.py``).
Both copies' public ``chunk_gated_delta_rule`` (the autograd function's forward, what
``ChunkGatedDeltaRule.forward_native`` calls) run a grid of steps: one long sequence, varlen
batches with sequences that are not multiples of 64 and empty ones, the precomputed
``chunk_indices``/``chunk_offsets`` vLLM's GDN metadata passes, equal-length batches without
``cu_seqlens``, grouped value heads, the ``core_attn_out`` buffer, no initial state, with windows
of 1 to 3 chunks (the patched module's ``KILN_P103_WINDOW_CHUNKS``, set small so the interpreter
stays fast). Checked: the patched ``o`` and ``final_state`` equal the pristine ones bit for bit;
both match an independent float64 recurrence (so the interpreter computed the real rule); a torch
dispatch mode records every 5-D allocation (the chunk states ``h``): the pristine code allocates
all chunks of the step at once, more than the window, the patched code never more than the window.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from kiln.patch.engine import isolated_run
from kiln.patch.model import BuildTarget, Verdict
from tests.patchsets.support.fla_interpret import OPS, ops_files
from tests.patchsets.support.interpreted_child import run_child
from tests.patchsets.support.patchlib import patched_files

CHUNK = f"{OPS}/chunk.py"

# (name, lens or None for a dense batch, dense (B, T), value heads, key heads, window, options)
CASES = [
    ("one long sequence", [150], None, 1, 1, 1, {}),
    ("varlen, ragged and empty", [70, 5, 100, 0], None, 1, 1, 2, {}),
    ("varlen, vLLM's chunk indices", [64, 1, 130], None, 1, 1, 2, {"chunk_indices": True}),
    ("dense batch, no initial state", None, (2, 80), 1, 1, 2, {"no_initial_state": True}),
    ("grouped heads, core_attn_out", [90, 30], None, 2, 1, 2, {"core_attn_out": True}),
    ("no final state wanted", [40, 100], None, 1, 1, 1, {"no_final_state": True}),
]


def test_verdicts(catalogue, sessions):
    new = sessions("v0.33.0")
    target = BuildTarget(new.tree.vllm_version)
    first = isolated_run(catalogue, new, target, "P103")
    assert first.outcomes["P103"].verdict is Verdict.APPLIES, first.outcomes["P103"].detail
    again = isolated_run(catalogue, new.overlay(first.state.changed), target, "P103")
    assert again.outcomes["P103"].verdict is Verdict.ALREADY_PATCHED

    old = sessions("v0.20.1")
    outcome = isolated_run(catalogue, old, BuildTarget(old.tree.vllm_version), "P103").outcomes["P103"]
    assert outcome.verdict is Verdict.GATED, outcome.detail  # the code is in model_executor/layers/fla/ there


@pytest.fixture(scope="module")
def results(catalogue, sessions, tmp_path_factory):
    where = tmp_path_factory.mktemp("p103")
    new = sessions("v0.33.0")
    pristine = ops_files(new.tree.read)
    patched = {**pristine, CHUNK: patched_files(catalogue, new, "P103")[CHUNK]}
    for name, files in (("pristine", pristine), ("patched", patched)):
        (where / f"{name}.json").write_text(json.dumps(files))
    return run_child(__name__, where, timeout=900)


def test_the_grid_ran(results):
    assert [case["name"] for case in results] == [case[0] for case in CASES]


@pytest.mark.parametrize("index", range(len(CASES)), ids=[case[0] for case in CASES])
def test_patched_equals_stock_bit_for_bit(results, index):
    case = results[index]
    assert case["windows_used"] >= 2, case  # the patched path did split this step
    assert case["o_equal"], case
    assert case["final_equal"], case


@pytest.mark.parametrize("index", range(len(CASES)), ids=[case[0] for case in CASES])
def test_both_compute_the_gated_delta_rule(results, index):
    case = results[index]
    for name in ("pristine", "patched"):
        assert case[name]["o_error"] < 2e-2, case
        if case[name]["final_error"] is not None:
            assert case[name]["final_error"] < 2e-2, case


@pytest.mark.parametrize("index", range(len(CASES)), ids=[case[0] for case in CASES])
def test_h_is_bounded_by_the_window(results, index):
    case = results[index]
    assert case["pristine"]["h_chunks"] == [case["step_chunks"]]  # the whole step at once
    assert case["step_chunks"] > case["window"]
    assert case["patched"]["h_chunks"], case
    assert max(case["patched"]["h_chunks"]) <= case["window"], case
    assert sum(case["patched"]["h_chunks"]) == case["step_chunks"], case  # every chunk, once


# -- the child process ----------------------------------------------------------------------------


def _reference(q, k, v, g, beta, h0, bounds, scale, torch):
    """The gated delta rule token by token in float64, sharing no code with the kernels."""
    T, H = v.shape[1], v.shape[2]
    group = H // q.shape[2]
    o = torch.zeros(T, H, v.shape[3], dtype=torch.float64)
    finals = []
    for n in range(len(bounds) - 1):
        state = h0[n].double().clone() if h0 is not None else torch.zeros(H, v.shape[3], k.shape[3], dtype=torch.float64)
        for t in range(bounds[n], bounds[n + 1]):
            for head in range(H):
                kt, qt = k[0, t, head // group].double(), q[0, t, head // group].double()
                state[head] *= torch.exp(g[0, t, head].double())
                delta = beta[0, t, head].double() * (v[0, t, head].double() - state[head] @ kt)
                state[head] += torch.outer(delta, kt)
                o[t, head] = state[head] @ qt * scale
        finals.append(state)
    return o, torch.stack(finals)


def _inputs(case, torch):
    name, lens, dense, heads, key_heads, window, options = case
    gen = torch.Generator().manual_seed(len(name))
    batch, tokens = dense if dense else (1, sum(lens))
    dim = 32
    q = torch.randn(batch, tokens, key_heads, dim, generator=gen).half()
    k = torch.nn.functional.normalize(torch.randn(batch, tokens, key_heads, dim, generator=gen), dim=-1).half()
    v = torch.randn(batch, tokens, heads, dim, generator=gen).half()
    g = torch.nn.functional.logsigmoid(torch.randn(batch, tokens, heads, generator=gen) + 2)
    beta = torch.rand(batch, tokens, heads, generator=gen)
    n_seqs = batch if dense else len(lens)
    h0 = None if options.get("no_initial_state") else torch.randn(n_seqs, heads, dim, dim, generator=gen) * 0.5
    cu = None if dense else torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, g, beta, h0, cu


def _h_recorder(torch):
    from torch.utils._python_dispatch import TorchDispatchMode

    allocations = {torch.ops.aten.empty.memory_format, torch.ops.aten.new_empty.default,
                   torch.ops.aten.empty_strided.default}

    class HRecorder(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.chunks = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func in allocations and isinstance(out, torch.Tensor) and out.dim() == 5:
                self.chunks.append(int(out.shape[0] * out.shape[1]))  # h: (B, NT, H, V, K)
            return out

    return HRecorder


def _run(chunk, inputs, options, torch, recorder):
    q, k, v, g, beta, h0, cu = inputs
    kwargs = {}
    if options.get("core_attn_out"):
        kwargs["core_attn_out"] = torch.full((v.numel() + 7,), float("nan"), dtype=v.dtype)
    if options.get("chunk_indices"):  # as vLLM's GDN metadata passes them, computed once per step
        index = sys.modules[chunk.__name__.rsplit(".", 1)[0] + ".index"]
        kwargs["chunk_indices"] = index.prepare_chunk_indices(cu, 64)
        kwargs["chunk_offsets"] = index.prepare_chunk_offsets(cu, 64)
    with recorder() as record:
        o, final = chunk.chunk_gated_delta_rule(
            q, k, v, g, beta, initial_state=None if h0 is None else h0.clone(),
            output_final_state=not options.get("no_final_state"), cu_seqlens=cu, **kwargs,
        )
    return o, final, record.chunks


def child_main() -> None:
    """Entry of the interpreter subprocess: ``TRITON_INTERPRET=1`` is set in its environment."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    import torch

    from tests.patchsets.support.fla_interpret import load_fla

    where = Path(sys.argv[1])
    chunks = {
        name: load_fla(json.loads((where / f"{name}.json").read_text()), where / "packages", f"p103_{name}")
        for name in ("pristine", "patched")
    }
    recorder = _h_recorder(torch)
    stock = chunks["patched"].chunk_gated_delta_rule_fwd
    out = []
    for case in CASES:
        name, lens, dense, _, _, window, options = case
        chunks["patched"].KILN_P103_WINDOW_CHUNKS = window
        inputs = _inputs(case, torch)
        q, k, v, g, beta, h0, cu = inputs
        bounds = cu.tolist() if cu is not None else None
        step_chunks = sum(-(-n // 64) for n in lens) if lens else dense[0] * -(-dense[1] // 64)
        calls = []

        def count(*args, _calls=calls, **kwargs):
            _calls.append(1)
            return stock(*args, **kwargs)

        chunks["patched"].chunk_gated_delta_rule_fwd = count
        result = {"name": name, "window": window, "step_chunks": step_chunks}
        runs = {}
        try:
            for which in ("pristine", "patched"):
                runs[which] = _run(chunks[which], inputs, options, torch, recorder)
        finally:
            chunks["patched"].chunk_gated_delta_rule_fwd = stock
        result["windows_used"] = len(calls)
        (o_p, f_p, _), (o_k, f_k, _) = runs["pristine"], runs["patched"]
        result["o_equal"] = bool(torch.equal(o_p, o_k))
        result["final_equal"] = (f_p is None and f_k is None) or bool(
            f_p is not None and f_k is not None and torch.equal(f_p, f_k)
        )
        for which, (o, final, h_chunks) in runs.items():
            errors = {"h_chunks": h_chunks, "o_error": 0.0, "final_error": None}
            for b in range(q.shape[0]):
                one = [t[b : b + 1] for t in (q, k, v, g, beta)]
                seq_bounds = bounds if bounds is not None else [0, q.shape[1]]
                start = None if h0 is None else (h0 if bounds is not None else h0[b : b + 1])
                ref_o, ref_final = _reference(*one, start, seq_bounds, 32 ** -0.5, torch)
                errors["o_error"] = max(errors["o_error"], float((o[b].double() - ref_o).abs().max()))
                if final is not None:
                    mine = final if bounds is not None else final[b : b + 1]
                    error = float((mine.double() - ref_final).abs().max())
                    errors["final_error"] = max(errors["final_error"] or 0.0, error)
            result[which] = errors
        out.append(result)
    print(json.dumps(out))
