"""PN12: SiluAndMul's CUDA path writes into one buffer shared by all layers, not a new tensor each call.

What it changes: ``SiluAndMul.forward_cuda`` (``model_executor/layers/activation.py:149`` on
0.33.0, ``:146`` on 0.20.1) allocates its ``[tokens, intermediate_size]`` output with
``torch.empty`` on every call, so a prefill chunk of 4096 tokens frees and allocates a
~138 MiB block in each of the 64 MLP layers of Qwen3.6-27B. The caching allocator hands the
freed block back to the next layer, but between two layers other allocations can split it, and
on a nearly full 24 GB card the next 138 MiB request can then fail (the out-of-memory reports
behind Genesis PN12). The patch gives the call a view of a buffer kept across calls, one per
(width, dtype, device, CUDA stream), as many rows as the largest call so far; a larger call
replaces the buffer (the smaller one is released first). Written anew after Genesis PN12's
pool; vllm#34207 (an out-variant of the op that Inductor can plan around) is the alternative
upstream has not merged.

Why reuse is safe, and where the patch does not pool:
- A layer's output is read by its ``down_proj`` before the next layer's ``SiluAndMul`` runs
  (``Qwen2MoeMLP.forward``, ``models/qwen2_moe.py:115-118`` on 0.33.0, which Qwen3.5/3.6 use).
  The patch does not rely on that: it reuses the buffer only when no tensor still views its
  storage (the storage's use count is back to its idle value), which is the condition under
  which the caching allocator would reuse a freed block. An output a caller still holds keeps
  its memory; that call gets a fresh tensor, as on the stock path.
- GPU work: kernels of one stream run in issue order, so the next write is ordered after every
  earlier read on that stream, the guarantee the caching allocator relies on for a freed block.
  Each stream has its own buffer, so work on another stream (dual-batch-overlap ubatches,
  ``v1/worker/ubatching.py``; shared experts on the aux stream,
  ``model_executor/layers/fused_moe/runner/shared_experts.py:78``) never shares one.
- While a CUDA graph is being captured the call allocates as before: the graph's private pool
  owns what it records, and a later growth of the buffer can never free memory a graph replays.
- While Dynamo traces (``torch.compiler.is_compiling()``), the call allocates as before: vLLM
  drops the guards of its compiled graphs (``compilation/wrapper.py:126-146``), so a
  size-dependent branch traced once would be replayed for every size.
- Devices other than CUDA (ROCm included) and CPU (POWERPC's ``forward_cpu`` calls
  ``forward_cuda``) allocate as before; the buffer is created outside inference mode, so it can
  be written inside and outside it.

Where it runs: ``forward_cuda`` is SiluAndMul's path only when the custom op is enabled
(``model_executor/custom_op.py:183-205``): ``--enforce-eager`` / ``-O0`` (``custom_ops``
defaults to ``all``) or ``custom_ops`` naming ``+silu_and_mul``. With vLLM's default
``VLLM_COMPILE`` mode and Inductor, ``custom_ops`` defaults to ``none``
(``config/vllm.py:1840-1845`` on 0.33.0, ``:952-957`` on 0.20.1) and the op runs
``forward_native`` inside the compiled graph, where Inductor allocates the output (Genesis
PN25's concern); this patch does not reach that path.

Verdicts: 0.20.1 APPLIES, 0.33.0 APPLIES.

Verdicts across releases (``patchsets/release-train.toml``, reviewed on every release
0.20.1-0.33.0): APPLIES on every one; ``forward_cuda`` keeps the same four statements from
0.20.1 to 0.33.0 (0.33.0 only adds a POWERPC ``forward_cpu`` that calls it), and no release
pools or pre-allocates the output.
"""

import libcst.matchers as m

from kiln.patch.model import Codemod, Patch
from kiln.patch.shapes import cls, func, insert_after, marked, statements, with_marker

TARGET = "model_executor/layers/activation.py"
SILU_AND_MUL = cls("SiluAndMul")
FORWARD_CUDA = func("forward_cuda")
POOLED_OUTPUT = "_pooled_output"


def _assign_out(value: m.BaseExpression, **kwargs) -> m.SimpleStatementLine:
    return m.SimpleStatementLine(
        body=[m.Assign(targets=[m.AssignTarget(m.Name("out"))], value=value)], **kwargs
    )


# ``out = torch.empty(output_shape, ...)``: the per-call allocation.
ALLOCATE_OUT = _assign_out(m.Call(func=m.Attribute(value=m.Name("torch"), attr=m.Name("empty"))))
# ``out = self._pooled_output(...)``: the patched line.
POOLED_OUT = m.Call(func=m.Attribute(value=m.Name("self"), attr=m.Name(POOLED_OUTPUT)))

POOL_SOURCE = f'''
_output_pools: dict = {{}}
@classmethod
def {POOLED_OUTPUT}(cls, x: torch.Tensor, output_shape: torch.Size) -> torch.Tensor:
    """Memory for one call's output: a view of a buffer all SiluAndMul layers share.

        One buffer per (width, dtype, device, CUDA stream), as many rows as the largest call
        so far; a larger call replaces it. A fresh tensor instead while Dynamo traces (vLLM
        drops the compiled graph's guards), while a CUDA graph is captured (its private pool
        must own what it records), on other devices, and while a tensor still views the
        buffer (a caller keeps an earlier output): the buffer is reused only when nothing
        references it, as the caching allocator reuses a freed block.
        """
    if torch.compiler.is_compiling():
        return torch.empty(output_shape, dtype=x.dtype, device=x.device)
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if (
        use_count is None
        or x.device.type not in ("cuda", "cpu")
        or (x.is_cuda and torch.cuda.is_current_stream_capturing())
    ):
        return torch.empty(output_shape, dtype=x.dtype, device=x.device)
    rows = torch.Size(output_shape[:-1]).numel()
    stream = torch.cuda.current_stream(x.device).cuda_stream if x.is_cuda else None
    key = (output_shape[-1], x.dtype, x.device, stream)
    entry = cls._output_pools.get(key)
    if entry is not None:
        if use_count(entry[0].untyped_storage()._cdata) != entry[1]:
            return torch.empty(output_shape, dtype=x.dtype, device=x.device)
        if entry[0].shape[0] >= rows:
            return entry[0][:rows].view(output_shape)
        # release the smaller buffer before allocating its replacement
        del cls._output_pools[key], entry
    with torch.inference_mode(False):
        buffer = torch.empty((rows, output_shape[-1]), dtype=x.dtype, device=x.device)
    cls._output_pools[key] = (buffer, use_count(buffer.untyped_storage()._cdata))
    return buffer[:rows].view(output_shape)
'''


class AddOutputPool(Codemod):
    """The shared buffers and the method that hands out their views, after ``forward_cuda``."""

    target = TARGET
    anchor = (SILU_AND_MUL, FORWARD_CUDA)
    patched = (SILU_AND_MUL, func(POOLED_OUTPUT, leading_lines=marked("PN12")))

    def rewrite(self, node):
        pools, method = statements(POOL_SOURCE)
        pools = with_marker(pools, "PN12", "buffers shared by every SiluAndMul, keyed by width, dtype, device, stream")
        method = with_marker(method, "PN12", "a view of the shared buffer instead of a new tensor per layer")
        return insert_after(node, pools, method)


class UsePooledOutput(Codemod):
    """``forward_cuda`` takes its output from the pool instead of ``torch.empty``."""

    target = TARGET
    anchor = (SILU_AND_MUL, FORWARD_CUDA, ALLOCATE_OUT)
    patched = (SILU_AND_MUL, FORWARD_CUDA, _assign_out(POOLED_OUT, leading_lines=marked("PN12")))

    def rewrite(self, node):
        (line,) = statements(f"out = self.{POOLED_OUTPUT}(x, output_shape)")
        why = "the output reuses one buffer across layers: no 138 MiB allocation per layer per prefill chunk"
        return with_marker(line.with_changes(leading_lines=node.leading_lines), "PN12", why)


class PN12(Patch):
    id = "PN12"
    family = "memory"
    title = "SiluAndMul's CUDA path writes into a buffer shared across layers instead of allocating per call"
    why = (
        "forward_cuda allocates a [tokens, intermediate_size] output per layer per step (~138 MiB "
        "per layer for a 4096-token chunk of Qwen3.6-27B), which other allocations can split between "
        "layers on a nearly full card. Reuse one buffer per width, dtype, device and stream, only "
        "when nothing references it, never while compiling or capturing a CUDA graph."
    )
    upstream_refs = ("vllm#34207",)
    written_for = ">=0.20.1"
    edits = (AddOutputPool, UsePooledOutput)

