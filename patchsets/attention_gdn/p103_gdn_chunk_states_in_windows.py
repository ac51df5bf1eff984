"""P103: GDN chunked prefill holds the chunk states of a bounded window of tokens, not of the whole step.

What fails: the Triton (FLA) prefill of a gated-delta-net layer, ``chunk_gated_delta_rule_fwd``
(``third_party/flash_linear_attention/ops/chunk.py``), computes the recurrent state at the
start of every 64-token chunk of every sequence of the step at once:
``chunk_gated_delta_rule_fwd_h`` allocates ``h = k.new_empty(B, NT, H, V, K)``
(``ops/chunk_delta_h.py:312`` on 0.33.0), one value-heads x 128 x 128 state per chunk in the
activation dtype, and ``chunk_fwd_o`` then reads it. ``NT`` grows with the step's token count:
48 value heads (Qwen3.6-27B) give 1.5 MiB per chunk, 805 MiB for a 64k-token step, per GDN layer
call. The V2 runner's profile run reaches no GDN prefill (the GDN layers get no metadata and run
only a 64-token warm-up), so that transient is not in the profiled peak: a long single step, a
large ``--max-num-batched-tokens`` or a long prompt without chunked prefill, runs out of memory
past the budget (Genesis's "Cliff 2").

What the patch does: ``ChunkGatedDeltaRuleFunction.forward`` calls
``chunk_gated_delta_rule_fwd_in_windows`` instead. When the step can hold more than
``KILN_P103_WINDOW_CHUNKS`` (64) chunks, it runs the stock ``chunk_gated_delta_rule_fwd`` on
consecutive token windows of at most 64 chunks each, cut at 64-token chunk boundaries of each
sequence (so every chunk, its gate cumsum and its WY factors are the stock ones), and carries
each cut sequence's recurrent state from one window to the next through ``initial_state`` /
``final_state``. The kernel keeps that state in float32 and writes it out unchanged, so the
carried state is exactly the running state the stock kernel would have continued with: outputs
and final states are the stock ones, bit for bit. ``h`` then never holds more than 64 chunks
(96 MiB on the 27B, 64 MiB on the 35B-A3B), whatever the step's size. Varlen batches
(``cu_seqlens``, what vLLM always passes) are split by sequence boundaries read on the host (one
allowed sync per layer call, only on steps that exceed the window: vLLM's GDN metadata passes
``chunk_indices``, whose length is the step's chunk count); steps within it take the stock call
unchanged, without a sync. At kiln's presets (4096 batched tokens, 4 sequences, so at most 67
chunks) a step splits only when its sequences' partial chunks push it past 64 chunks.
With ``GDN_RECOMPUTE_SUPPRESS_LEVEL >= 3`` (the caller wants w, h and v_new back) it never splits.
Inside windows the forward's ``g`` and ``A`` come back as None: the forward, the only caller,
uses ``o`` and ``final_state`` only. Genesis's P103 splits only inputs without ``cu_seqlens``, so
it never acts in vLLM's serving path; its PN59 streams the same tensor window by window.

Verdicts: 0.20.1 GATED: the same code lives in ``model_executor/layers/fla/ops/chunk.py``
(``chunk_delta_h.py:332``), which vLLM moved to ``third_party/flash_linear_attention/ops/`` in
0.26.0; a codemod names one file, so this patch rewrites the new place only. 0.33.0 APPLIES.

Verdicts across releases (``patchsets/release-train.toml``): 0.20.1-0.25.1 GATED (the old
path, above); 0.26.0-0.33.0 APPLIES: ``chunk.py`` is the same file on every one of them, and
``chunk_gated_delta_rule_fwd_h`` allocates the whole ``h`` on all of them.
"""

import libcst as cst
import libcst.matchers as m

from kiln.patch.model import Codemod, Gates, Patch
from kiln.patch.shapes import cls, func, marked, statements, top_level, with_marker

TARGET = "third_party/flash_linear_attention/ops/chunk.py"
WINDOWED = "chunk_gated_delta_rule_fwd_in_windows"
FORWARD = (cls("ChunkGatedDeltaRuleFunction"), func("forward"))

WINDOW_SOURCE = '''
KILN_P103_WINDOW_CHUNKS = 64
'''

PLAN_SOURCE = '''
def _kiln_p103_windows(lens, window_chunks, chunk_size):
    """Consecutive pieces ``(seq, begin, end)`` of sequences of ``lens`` tokens, grouped in
    windows of at most ``window_chunks`` chunks; a sequence is cut only at a chunk boundary."""
    windows, pieces, used = [], [], 0
    for seq, length in enumerate(lens):
        begin = 0
        while True:
            if used == window_chunks:
                windows.append(pieces)
                pieces, used = [], 0
            end = min(length, begin + (window_chunks - used) * chunk_size)
            pieces.append((seq, begin, end))
            used += -(-(end - begin) // chunk_size)
            if end == length:
                break
            begin = end
    if pieces:
        windows.append(pieces)
    return windows
'''

WINDOWED_SOURCE = f'''
def {WINDOWED}(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor,
    output_final_state: bool,
    cu_seqlens: torch.Tensor | None = None,
    chunk_indices: torch.Tensor | None = None,
    chunk_offsets: torch.Tensor | None = None,
    core_attn_out: torch.Tensor | None = None,
):
    """``chunk_gated_delta_rule_fwd`` over token windows of at most ``KILN_P103_WINDOW_CHUNKS``
    chunks, each sequence's recurrent state carried across the windows (float32, exact)."""
    B, T = q.shape[:2]
    BT = FLA_CHUNK_SIZE
    window = KILN_P103_WINDOW_CHUNKS
    n_seqs = B if cu_seqlens is None else len(cu_seqlens) - 1
    if cu_seqlens is not None and chunk_indices is not None:
        most = len(chunk_indices)  # the step's chunk count, from a shape: no sync
    else:
        most = B * (T // BT) + n_seqs  # a bound on it
    if SUPPRESS_LEVEL >= 3 or most <= window:
        return chunk_gated_delta_rule_fwd(
            q, k, v, g, beta, scale, initial_state, output_final_state,
            cu_seqlens, chunk_indices, chunk_offsets, core_attn_out,
        )
    if cu_seqlens is None:
        bounds, lens = [0, T], [T]
        step = max(1, window // B) * BT
        windows = [[(0, s, min(s + step, T))] for s in range(0, T, step)]
    else:
        from vllm.utils.gpu_sync_debug import gpu_sync_allowed

        with gpu_sync_allowed():
            bounds = cu_seqlens.tolist()
        lens = [end - begin for begin, end in zip(bounds, bounds[1:])]
        if sum(-(-n // BT) for n in lens) <= window:
            return chunk_gated_delta_rule_fwd(
                q, k, v, g, beta, scale, initial_state, output_final_state,
                cu_seqlens, chunk_indices, chunk_offsets, core_attn_out,
            )
        windows = _kiln_p103_windows(lens, window, BT)
    if core_attn_out is not None:
        o = core_attn_out[: v.numel()].view(*v.shape)
    else:
        o = torch.empty_like(v)
    final_state = None
    state = initial_state
    carried = None
    for pieces in windows:
        start = bounds[pieces[0][0]] + pieces[0][1]
        stop = bounds[pieces[-1][0]] + pieces[-1][2]
        part = slice(start, stop)
        sub_cu = None
        if cu_seqlens is not None:
            sub_bounds = [0]
            rows = []
            for seq, begin, end in pieces:
                sub_bounds.append(sub_bounds[-1] + end - begin)
                if begin:
                    rows.append(carried)
                elif initial_state is None:
                    rows.append(k.new_zeros(v.shape[2], v.shape[3], k.shape[3], dtype=torch.float32))
                else:
                    rows.append(initial_state[seq].to(torch.float32))
            state = torch.stack(rows)
            sub_cu = torch.tensor(sub_bounds, dtype=cu_seqlens.dtype).to(cu_seqlens.device)
        _, o_part, _, part_final, _, _, _ = chunk_gated_delta_rule_fwd(
            q[:, part].contiguous(),
            k[:, part].contiguous(),
            v[:, part].contiguous(),
            g[:, part].contiguous(),
            beta[:, part].contiguous(),
            scale,
            state,
            True,
            sub_cu,
        )
        o[:, part] = o_part
        if cu_seqlens is None:
            state = final_state = part_final
            continue
        if final_state is None:
            final_state = part_final.new_empty(n_seqs, *part_final.shape[1:])
        for (seq, _, end), row in zip(pieces, part_final):
            if end == lens[seq]:
                final_state[seq] = row
            else:
                carried = row
    return None, o, None, final_state if output_final_state else None, None, None, None
'''

WHY = "the chunk states h of a whole step grow with its tokens: hold them one bounded window at a time"


class AddWindowedForward(Codemod):
    """The windowed forward, its window size and its planner, after ``chunk_gated_delta_rule_fwd``."""

    target = TARGET
    anchor = (func("chunk_gated_delta_rule_fwd"),)
    patched = (func(WINDOWED, leading_lines=marked("P103")),)

    def rewrite(self, node):
        (size,) = statements(WINDOW_SOURCE)
        (plan,) = statements(PLAN_SOURCE)
        (windowed,) = statements(WINDOWED_SOURCE)
        size_why = "chunks of h held at once (64 x 64 tokens: kiln's presets' step size)"
        return cst.FlattenSentinel(
            [node, top_level(size, "P103", size_why), top_level(plan, "P103", WHY), top_level(windowed, "P103", WHY)]
        )


def _forward_call(name: str, **kwargs) -> m.SimpleStatementLine:
    """``g, o, A, ... = <name>(...)`` in the autograd function's forward."""
    return m.SimpleStatementLine(body=[m.Assign(value=m.Call(func=m.Name(name)))], **kwargs)


class RouteForwardThroughWindows(Codemod):
    """``ChunkGatedDeltaRuleFunction.forward`` calls the windowed forward."""

    target = TARGET
    anchor = (*FORWARD, _forward_call("chunk_gated_delta_rule_fwd"))
    patched = (*FORWARD, _forward_call(WINDOWED, leading_lines=marked("P103")))

    def rewrite(self, node):
        assign = node.body[0]
        call = assign.value.with_changes(func=cst.Name(WINDOWED))
        routed = node.with_changes(body=[assign.with_changes(value=call)])
        return with_marker(routed, "P103", "same result, chunk states bounded by a window")


class P103(Patch):
    id = "P103"
    family = "attention_gdn"
    title = "GDN chunked prefill: chunk states h held for a bounded token window, not the whole step"
    why = (
        "The FLA gated-delta-rule prefill allocates the chunk state of every 64-token chunk of a "
        "step at once (805 MiB per GDN layer at 64k tokens on Qwen3.6-27B), unprofiled. Run it over "
        "windows of at most 64 chunks, carrying each sequence's float32 state across them: same "
        "outputs bit for bit, h bounded by the window."
    )
    upstream_refs = ()
    written_for = ">=0.20.1"
    gates = Gates(vllm=">=0.26.0")
    edits = (AddWindowedForward, RouteForwardThroughWindows)
