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
all chunks of the step at once, more than the window, the patched code never more than the window;
no window's stock call runs ``prepare_chunk_indices``/``prepare_chunk_offsets`` (a GPU sync and a
copy each). An empty sequence after a non-empty one is held to the float64 recurrence only: the
stock chunk indices misnumber the sequences after it.

Host work (the stock forward of each window stubbed out, so only the windowed forward's own work
is seen): a dispatch mode counts the aten ops it issues on CPU tensors for steps of 10, 20 and 30
windows, twice on each step's metadata (its first GDN layer, then the next): a fixed setup, then
one copy and a few views per window; one allowed sync and one host tensor per step.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import sys
from pathlib import Path

import pytest

from kiln.patch.engine import isolated_run
from kiln.patch.model import BuildTarget, Verdict
from tests.patchsets.support.fla_interpret import OPS, ops_files
from tests.patchsets.support.interpreted_child import run_child
from tests.patchsets.support.patchlib import assert_applies_once, patched_files

CHUNK = f"{OPS}/chunk.py"

# (name, lens or None for a dense batch, dense (B, T), value heads, key heads, window, options)
CASES = [
    ("one long sequence", [150], None, 1, 1, 1, {}),
    ("varlen, ragged and empty", [70, 5, 100, 0], None, 1, 1, 2, {}),
    ("varlen, vLLM's chunk indices", [64, 1, 130], None, 1, 1, 2, {"chunk_indices": True}),
    ("dense batch, no initial state", None, (2, 80), 1, 1, 2, {"no_initial_state": True}),
    ("grouped heads, core_attn_out", [90, 30], None, 2, 1, 2, {"core_attn_out": True}),
    ("no final state wanted", [40, 100], None, 1, 1, 1, {"no_final_state": True}),
    # The stock chunk indices give a chunk the number of chunk-0s before it as its sequence, so a
    # chunk after an empty sequence reads that sequence's bounds (no tokens): the stock outputs
    # and final states of the sequences after one are wrong. vLLM sends no empty prefill
    # sequence; the windows' own indices number their pieces, so the patched ones are right.
    ("empty sequences after a full window", [128, 0, 0, 70], None, 1, 1, 2, {"stock_wrong": True}),
]

# Host work: steps whose chunks fill 10, 20 and 30 windows of 2 chunks, cut inside sequences
HOST_WINDOW = 2
HOST_STEPS = {10: [256, 700, 300], 20: [512, 1400, 600], 30: [768, 2100, 900]}
# Aten ops that only make views: no data moves, no kernel runs
VIEWS = {"slice", "view", "select", "alias", "as_strided", "unsqueeze", "squeeze", "unbind", "detach", "t"}


def test_verdicts(catalogue, sessions):
    new = sessions("v0.33.0")
    assert_applies_once(catalogue, new, "P103")

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


@pytest.fixture(scope="module")
def grid(results):
    return results["grid"]


@pytest.fixture(scope="module")
def host(results):
    return results["host"]


def test_the_grid_ran(grid):
    assert [case["name"] for case in grid] == [case[0] for case in CASES]


@pytest.mark.parametrize("index", range(len(CASES)), ids=[case[0] for case in CASES])
def test_patched_equals_stock_bit_for_bit(grid, index):
    case = grid[index]
    assert case["windows_used"] >= 2, case  # the patched path did split this step
    if CASES[index][-1].get("stock_wrong"):
        return  # the next test holds the patched results to the reference
    assert case["o_equal"], case
    assert case["final_equal"], case


@pytest.mark.parametrize("index", range(len(CASES)), ids=[case[0] for case in CASES])
def test_both_compute_the_gated_delta_rule(grid, index):
    case = grid[index]
    for name in ("pristine", "patched"):
        if name == "pristine" and CASES[index][-1].get("stock_wrong"):
            continue  # its wrong outputs come from memory no kernel wrote: no fixed value to hold
        assert case[name]["o_error"] < 2e-2, (name, case[name])
        if case[name]["final_error"] is not None:
            assert case[name]["final_error"] < 2e-2, (name, case[name])


@pytest.mark.parametrize("index", range(len(CASES)), ids=[case[0] for case in CASES])
def test_h_is_bounded_by_the_window(grid, index):
    case = grid[index]
    assert case["pristine"]["h_chunks"] == [case["step_chunks"]]  # the whole step at once
    assert case["step_chunks"] > case["window"]
    assert case["patched"]["h_chunks"], case
    assert max(case["patched"]["h_chunks"]) <= case["window"], case
    assert sum(case["patched"]["h_chunks"]) == case["step_chunks"], case  # every chunk, once


@pytest.mark.parametrize("index", range(len(CASES)), ids=[case[0] for case in CASES])
def test_windows_get_their_chunk_metadata(grid, index):
    """No window's stock call builds its chunk indices or offsets: ``prepare_chunk_indices``
    syncs with the GPU (``.tolist()``) and copies to it, once per call it is not given them."""
    case = grid[index]
    assert case["patched"]["prepare_calls"] == 0, case


def test_host_work_per_window_is_one_state_copy(host):
    """What the windowed forward issues itself (the stock forward of each window stubbed out),
    on one GDN layer call of steps of 10, 20 and 30 windows: the same fixed setup whatever the
    window count, then per window views and one copy (the window's final states back into the
    carried rows); no per-window cat/stack, zeros, dtype conversion, host tensor or per-piece copy."""
    for call in ("first_call", "next_layer"):
        runs = {int(windows): run[call] for windows, run in host.items()}
        setup = {windows: ops["work"] - windows for windows, ops in runs.items()}
        assert len(set(setup.values())) == 1 and setup[10] <= 3, (call, runs)  # states, o, packed metadata
        for windows, ops in runs.items():
            assert ops["counts"].get("copy_", 0) == windows, (call, windows, ops)
    for windows, run in host.items():  # views: per window its inputs, its states' rows, its part of o
        assert run["next_layer"]["all"] - run["next_layer"]["work"] <= 8 * int(windows) + 2, (windows, run)


def test_host_work_is_planned_once_per_step(host):
    """The first GDN layer call of a step reads ``cu_seqlens`` on the host (one allowed sync) and
    copies every window's metadata to the device in one tensor; the step's other layers (same
    ``cu_seqlens`` and ``chunk_indices``) reuse that plan: no sync, no host tensor."""
    for windows, run in host.items():
        assert run["first_call"]["syncs"] == 1, (windows, run)
        assert run["first_call"]["counts"].get("lift_fresh", 0) == 1, (windows, run)
        assert run["next_layer"]["syncs"] == 0, (windows, run)
        assert run["next_layer"]["counts"].get("lift_fresh", 0) == 0, (windows, run)
        assert run["next_layer"]["work"] == run["first_call"]["work"] - 1, (windows, run)
        assert run["windows_called"] == int(windows), (windows, run)
        assert run["metadata_given"], (windows, run)  # every window: chunk_indices and chunk_offsets


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


def _error(mine, reference, torch):
    """Largest absolute difference, a NaN counting as infinitely far (``max`` would drop it)."""
    return float(torch.nan_to_num((mine.double() - reference).abs(), nan=float("inf")).max())


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


def _prepare_counter(chunk):
    """Counts the calls of ``prepare_chunk_indices``/``prepare_chunk_offsets`` from any module of
    ``chunk``'s package (each module binds them by name at import)."""
    package = chunk.__name__.rsplit(".", 1)[0]
    modules = [module for name, module in sys.modules.items() if name.startswith(f"{package}.")]
    calls = []

    def counted(stock):
        def call(*args, **kwargs):
            calls.append(stock.__name__)
            return stock(*args, **kwargs)

        return call

    @contextlib.contextmanager
    def counting():
        saved = [(module, name, getattr(module, name)) for module in modules
                 for name in ("prepare_chunk_indices", "prepare_chunk_offsets") if hasattr(module, name)]
        for module, name, stock in saved:
            setattr(module, name, counted(stock))
        try:
            yield calls
        finally:
            for module, name, stock in saved:
                setattr(module, name, stock)

    return counting


def _run(chunk, inputs, options, torch, recorder):
    q, k, v, g, beta, h0, cu = inputs
    kwargs = {}
    if options.get("core_attn_out"):
        kwargs["core_attn_out"] = torch.full((v.numel() + 7,), float("nan"), dtype=v.dtype)
    if options.get("chunk_indices"):  # as vLLM's GDN metadata passes them, computed once per step
        index = sys.modules[chunk.__name__.rsplit(".", 1)[0] + ".index"]
        kwargs["chunk_indices"] = index.prepare_chunk_indices(cu, 64)
        kwargs["chunk_offsets"] = index.prepare_chunk_offsets(cu, 64)
    with recorder() as record, _prepare_counter(chunk)() as prepared:
        o, final = chunk.chunk_gated_delta_rule(
            q, k, v, g, beta, initial_state=None if h0 is None else h0.clone(),
            output_final_state=not options.get("no_final_state"), cu_seqlens=cu, **kwargs,
        )
    return o, final, record.chunks, len(prepared)


def _host_work(chunk, torch):
    """The aten ops the windowed forward issues itself on CPU tensors, and its allowed syncs, for
    two GDN layer calls of each of ``HOST_STEPS``, the stock forward of each window stubbed out."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class OpCounter(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops, self.paused = [], False

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not self.paused:
                self.ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    sync_debug = sys.modules["vllm.utils.gpu_sync_debug"]
    syncs = []

    @contextlib.contextmanager
    def sync_allowed():
        syncs.append(1)
        yield

    stock = chunk.chunk_gated_delta_rule_fwd
    out = {}
    for windows, lens in HOST_STEPS.items():
        chunk.KILN_P103_WINDOW_CHUNKS = HOST_WINDOW
        gen = torch.Generator().manual_seed(windows)
        tokens, heads, dim = sum(lens), 1, 32
        q, k, v = (torch.randn(1, tokens, heads, dim, generator=gen).half() for _ in range(3))
        g, beta = torch.randn(1, tokens, heads, generator=gen), torch.rand(1, tokens, heads, generator=gen)
        h0 = torch.randn(len(lens), heads, dim, dim, generator=gen).half()
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        index = sys.modules[chunk.__name__.rsplit(".", 1)[0] + ".index"]
        chunk_indices, chunk_offsets = index.prepare_chunk_indices(cu, 64), index.prepare_chunk_offsets(cu, 64)
        given = []
        counter = OpCounter()

        def stub(q, k, v, g, beta, scale, state, final, cu_seqlens=None, chunk_indices=None,
                 chunk_offsets=None, core_attn_out=None, _given=given, _counter=counter):
            _counter.paused = True
            try:
                _given.append(chunk_indices is not None and chunk_offsets is not None)
                o = core_attn_out[: v.numel()].view(*v.shape) if core_attn_out is not None else torch.empty_like(v)
                states = torch.zeros(len(cu_seqlens) - 1, v.shape[2], v.shape[3], k.shape[3])
                return None, o, None, states, None, None, None
            finally:
                _counter.paused = False

        run = {}
        chunk.chunk_gated_delta_rule_fwd = stub
        sync_debug.gpu_sync_allowed = sync_allowed
        try:
            for call in ("first_call", "next_layer"):  # the same step's metadata: as its next GDN layer
                counter.ops, syncs[:] = [], []
                with counter:
                    chunk.chunk_gated_delta_rule_fwd_in_windows(
                        q, k, v, g, beta, dim ** -0.5, h0, True, cu, chunk_indices, chunk_offsets,
                    )
                counts = collections.Counter(counter.ops)
                work = sum(n for op, n in counts.items() if op not in VIEWS)
                run[call] = {"all": len(counter.ops), "work": work, "counts": dict(counts), "syncs": len(syncs)}
        finally:
            chunk.chunk_gated_delta_rule_fwd = stock
            sync_debug.gpu_sync_allowed = contextlib.nullcontext
        run["windows_called"] = len(given) // 2
        run["metadata_given"] = all(given)
        out[str(windows)] = run
    return out


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
        (o_p, f_p, _, _), (o_k, f_k, _, _) = runs["pristine"], runs["patched"]
        result["o_equal"] = bool(torch.equal(o_p, o_k))
        result["final_equal"] = (f_p is None and f_k is None) or bool(
            f_p is not None and f_k is not None and torch.equal(f_p, f_k)
        )
        for which, (o, final, h_chunks, prepared) in runs.items():
            errors = {"h_chunks": h_chunks, "prepare_calls": prepared, "o_error": 0.0, "final_error": None}
            for b in range(q.shape[0]):
                one = [t[b : b + 1] for t in (q, k, v, g, beta)]
                seq_bounds = bounds if bounds is not None else [0, q.shape[1]]
                start = None if h0 is None else (h0 if bounds is not None else h0[b : b + 1])
                ref_o, ref_final = _reference(*one, start, seq_bounds, 32 ** -0.5, torch)
                errors["o_error"] = max(errors["o_error"], _error(o[b], ref_o, torch))
                if final is not None:
                    mine = final if bounds is not None else final[b : b + 1]
                    error = _error(mine, ref_final, torch)
                    errors["final_error"] = max(errors["final_error"] or 0.0, error)
            result[which] = errors
        out.append(result)
    print(json.dumps({"grid": out, "host": _host_work(chunks["patched"], torch)}))
