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
(``cu_seqlens``, what vLLM always passes) are split by sequence boundaries read on the host, only
on steps that exceed the window (vLLM's GDN metadata passes ``chunk_indices``, whose length is the
step's chunk count; steps within it take the stock call unchanged, without a sync).

Host work, which would otherwise starve the GPU (three times the stock time, measured on an
H200): the plan of a step's windows is made once per step and cached for its GDN layers (keyed,
like ``prepare_chunk_indices``, by the identity of ``cu_seqlens`` and vLLM's per-step
``chunk_indices``): one allowed sync, and one host-to-device copy of every window's
``cu_seqlens``, ``chunk_indices`` and ``chunk_offsets`` packed in one tensor, so no window's
stock call runs ``prepare_chunk_indices`` (a sync and a copy each). The sequences' float32
states live in one tensor: a window's initial states are a view of its rows, its output is
written in place into ``o``, and the only per-window work besides the stock call is one copy of
its final states back into those rows. Each window numbers its own pieces in its chunk indices,
so an empty sequence before a non-empty one (which stock's indices misnumber; vLLM sends none)
gives the right result. At kiln's presets (4096 batched tokens, 4 sequences, so at most 67
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

CACHE_SOURCE = '''
from .utils import tensor_cache
'''

PLAN_SOURCE = '''
def _kiln_p103_windows(lens, window_chunks, chunk_size):
    """Consecutive pieces ``(seq, begin, end)`` of sequences of ``lens`` tokens, grouped in
    windows of at most ``window_chunks`` chunks; a sequence is cut only at a chunk boundary, and
    a full window takes the empty sequences that follow it (no window is left without a chunk)."""
    windows, pieces, used = [], [], 0
    for seq, length in enumerate(lens):
        begin = 0
        while True:
            if used == window_chunks and begin < length:
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


def _kiln_p103_pack(windows, bounds, chunk_size, align=4):
    """Every window's ``cu_seqlens``, ``chunk_indices`` and ``chunk_offsets`` (the stock
    ``prepare_*`` values of its pieces) in one int list, each part starting at a multiple of
    ``align`` entries (16 bytes, aligned as a fresh tensor is), and per window
    ``(first seq, last seq, first token, end token, where its parts start, pieces, chunks)``."""
    packed, plans = [], []

    def part():
        packed.extend([0] * (-len(packed) % align))
        return len(packed)

    for pieces in windows:
        counts = [-(-(end - begin) // chunk_size) for _, begin, end in pieces]
        at_cu, total = part(), 0
        packed.append(0)
        for _, begin, end in pieces:
            total += end - begin
            packed.append(total)
        at_indices = part()
        for n, count in enumerate(counts):
            for i in range(count):
                packed += (n, i)
        at_offsets, total = part(), 0
        packed.append(0)
        for count in counts:
            total += count
            packed.append(total)
        (first, begin, _), (last, _, end) = pieces[0], pieces[-1]
        plans.append((first, last, bounds[first] + begin, bounds[last] + end,
                      at_cu, at_indices, at_offsets, len(pieces), sum(counts)))
    return packed, plans


@tensor_cache
def _kiln_p103_plan(cu_seqlens, chunk_indices, window_chunks):
    """None if the step's chunks fit one window, else per window its sequences (rows of the
    states), its tokens, and its ``cu_seqlens``, ``chunk_indices`` and ``chunk_offsets`` on the
    device (views of one packed tensor). One host sync and one host-to-device copy per step: the
    GDN layers of a step share ``cu_seqlens`` and vLLM's per-step ``chunk_indices`` (the cache's
    key, by identity, as ``prepare_chunk_indices``'s)."""
    from vllm.utils.gpu_sync_debug import gpu_sync_allowed
    from vllm.utils.torch_utils import async_tensor_h2d

    with gpu_sync_allowed():
        bounds = cu_seqlens.tolist()
    lens = [end - begin for begin, end in zip(bounds, bounds[1:])]
    if sum(-(-n // FLA_CHUNK_SIZE) for n in lens) <= window_chunks:
        return None
    windows = _kiln_p103_windows(lens, window_chunks, FLA_CHUNK_SIZE)
    packed, plans = _kiln_p103_pack(windows, bounds, FLA_CHUNK_SIZE)
    packed = async_tensor_h2d(packed, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    return [
        (slice(first, last + 1), slice(start, end), packed[at_cu : at_cu + pieces + 1],
         packed[at_indices : at_indices + 2 * chunks].view(chunks, 2),
         packed[at_offsets : at_offsets + pieces + 1])
        for first, last, start, end, at_cu, at_indices, at_offsets, pieces, chunks in plans
    ]
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
    plan = None
    if SUPPRESS_LEVEL < 3 and most > window and cu_seqlens is not None:
        plan = _kiln_p103_plan(cu_seqlens, chunk_indices, window)
    if SUPPRESS_LEVEL >= 3 or most <= window or (cu_seqlens is not None and plan is None):
        return chunk_gated_delta_rule_fwd(
            q, k, v, g, beta, scale, initial_state, output_final_state,
            cu_seqlens, chunk_indices, chunk_offsets, core_attn_out,
        )
    if core_attn_out is not None:
        o = core_attn_out[: v.numel()].view(*v.shape)
    else:
        o = torch.empty_like(v)
    if cu_seqlens is None:  # equal-length sequences: windows of whole chunks of all of them
        state = initial_state
        step = max(1, window // B) * BT
        for start in range(0, T, step):
            part = slice(start, min(start + step, T))
            _, o_part, _, state, _, _, _ = chunk_gated_delta_rule_fwd(
                q[:, part].contiguous(), k[:, part].contiguous(), v[:, part].contiguous(),
                g[:, part].contiguous(), beta[:, part].contiguous(), scale, state, True,
            )
            o[:, part] = o_part
        return None, o, None, state if output_final_state else None, None, None, None
    # Row n of ``states``: sequence n's state as the kernel reads it (float32), its initial one
    # until a window ends in it, then the one that window ended with; at the end, its final one.
    # A window's sequences are consecutive rows, so its initial states are a view, and writing
    # its final states back is one copy.
    H, V, K = v.shape[2], v.shape[3], k.shape[3]
    if initial_state is None:
        states = k.new_zeros(n_seqs, H, V, K, dtype=torch.float32)
    else:
        states = initial_state.to(torch.float32, copy=True)
    flat_o = o.view(-1)
    for rows, part, window_cu, window_indices, window_offsets in plan:
        _, _, _, part_final, _, _, _ = chunk_gated_delta_rule_fwd(
            q[:, part].contiguous(),
            k[:, part].contiguous(),
            v[:, part].contiguous(),
            g[:, part].contiguous(),
            beta[:, part].contiguous(),
            scale,
            states[rows],
            True,
            window_cu,
            window_indices,
            window_offsets,
            flat_o[part.start * H * V :],  # o written in place: the window's tokens are contiguous
        )
        states[rows] = part_final
    return None, o, None, states if output_final_state else None, None, None, None
'''

WHY = "the chunk states h of a whole step grow with its tokens: hold them one bounded window at a time"


class AddWindowedForward(Codemod):
    """The windowed forward, its window size and its planner, after ``chunk_gated_delta_rule_fwd``."""

    target = TARGET
    anchor = (func("chunk_gated_delta_rule_fwd"),)
    patched = (func(WINDOWED, leading_lines=marked("P103")),)

    def rewrite(self, node):
        (size,) = statements(WINDOW_SOURCE)
        (cache,) = statements(CACHE_SOURCE)
        plan = statements(PLAN_SOURCE)
        (windowed,) = statements(WINDOWED_SOURCE)
        size_why = "chunks of h held at once (64 x 64 tokens: kiln's presets' step size)"
        cache_why = "the windows' plan is made once per step, for all its GDN layers"
        added = [top_level(size, "P103", size_why), top_level(cache, "P103", cache_why)]
        added += [top_level(s, "P103", WHY) for s in plan]
        return cst.FlattenSentinel([node, *added, top_level(windowed, "P103", WHY)])


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
