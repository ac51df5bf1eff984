"""PN353A: TurboQuant reserves its WorkspaceManager scratch before the workspace is locked.

From 0.21.0 (vllm#40941's change) ``TurboQuantAttentionImpl`` takes its scratch from the
process-wide ``WorkspaceManager`` instead of per-layer buffers: the decode kernel's
``mid_o``/``output``/``lse`` in ``_decode_attention`` and the K/V dequant buffers of
``_continuation_prefill`` (``v1/attention/backends/turboquant_attn.py:879`` and :747 on
0.21.0). The manager grows on demand until ``GPUModelRunner.capture_model`` calls
``lock_workspace()``; after that a larger request raises ``AssertionError: Workspace is locked
but allocation from 'turboquant_attn.py:...:_continuation_prefill' requires ... MB``
(``v1/worker/workspace.py:158``), which kills the engine (vllm#41565, #42544, #43357).

Nothing before the lock makes those requests at their real size: the profile run has no
continuation chunk, so the first chunk of a prompt longer than ``--max-num-batched-tokens``
(cached prefix, then a continuation of more than 128 tokens) needs ``2 * Hk * L * D * 2``
bytes for its L cached tokens and crashes a 0.21.0-0.23.0 server (a ~6-8k-token prompt on the
reports). The decode scratch is only sized by FULL-graph capture of single-token decode
batches; with P65 (spec decode: FULL graphs for single-token decode only, and MTP batches are
K+1 wide) decode may not be captured at all, and the first eager decode after the lock
crashes the same way.

The patch adds ``TurboQuantMetadataBuilder._reserve_tq_workspace``, called from the builder's
``__init__``: the decode scratch for ``max_num_seqs`` rows (decode rows never exceed it
outside FULL graphs, and FULL capture, which happens before the lock, grows the workspace
itself), and, when a continuation can exceed the 128-token decode threshold
(``max_num_batched_tokens > 128``, with or without chunked prefill: a prefix-cache hit makes a
continuation too), the dequant pair for ``max_model_len - 1`` tokens rounded up to the group's
block size (``_continuation_prefill`` rounds to the kernel block, which divides it). Builders
are constructed during the profile run (``initialize_kv_cache(..., is_profiling=True)``), so
the reservation is counted before the KV cache is sized. It is one shared buffer (the
manager's), not per layer.

Gate ``vllm>=0.21.0``: 0.20.1 allocates the decode buffers per layer through the kernel's
``buf_holder`` (``turboquant_attn.py:808-832``) and the dequant buffers per layer
(:695-707; P22's business), so there is no workspace to outgrow.

Verdicts: 0.20.1 GATED. 0.33.0 UPSTREAM: vllm#44053 (0.24.0) added
``TurboQuantMetadataBuilder._reserve_workspace`` (``turboquant_attn.py:227``, called from
``__init__`` at :225) with the same two reservations. ``upstream_fix`` recognises any builder
method called from ``__init__`` that takes ``current_workspace_manager().get_simultaneous``
(or ``__init__`` doing it itself) and names the call's file:line. APPLIES on 0.21.0, 0.22.x,
0.23.0 (tested on their real source).

The id is Genesis's for the same fix (its PN353A backports vllm#44053); kiln called it P98 until
the ids were aligned, and records written then still read (``kiln.patch.catalog.RENAMED``).
Genesis's own P98 is a different remedy for the same release range: it reverted the dequant
buffers to per-layer allocations (and originally the decode scratch too, for a -17% decode
regression measured on Ampere that its own later A/B on a newer pin did not reproduce). That
brings back the per-layer growth P22 removed, so kiln keeps the shared workspace and reserves
it instead, as upstream did.

Verdicts across releases (``patchsets/release-train.toml``, reviewed on every release
0.20.1-0.33.0):
- 0.20.1, 0.20.2: GATED (``vllm>=0.21.0``): TurboQuant takes no scratch from the
  ``WorkspaceManager`` there (``turboquant_attn.py`` never calls ``current_workspace_manager``;
  its buffers are per layer), so there is nothing to reserve.
- 0.21.0-0.23.0: APPLIES: the decode and dequant scratch come from the workspace
  (``current_workspace_manager`` in ``turboquant_attn.py`` from 0.21.0) and nothing reserves
  them before the lock.
- 0.24.0 on: UPSTREAM: ``TurboQuantMetadataBuilder._reserve_workspace``, called from the
  builder's ``__init__`` (``turboquant_attn.py:205``/``:207`` on 0.24.0), takes both
  reservations at construction (its ``get_simultaneous`` at ``:223`` on 0.24.0, ``:243`` from
  0.29.0; vllm#44053). 0.23.0 has no such method.
"""

import libcst.matchers as m

from kiln.patch.anchor import find, line_of
from kiln.patch.model import Codemod, Gates, Patch
from kiln.patch.shapes import cls, func, insert_after, marked, statements, with_marker

TARGET = "v1/attention/backends/turboquant_attn.py"
BUILDER = cls("TurboQuantMetadataBuilder")
INIT = func("__init__")
METHOD = "_reserve_tq_workspace"
WHY = "reserve the decode and continuation scratch now: the workspace is locked after capture"

# `self._init_reorder_batch_threshold(1, supports_spec_as_decode=False)`
REORDER = m.SimpleStatementLine(
    body=[m.Expr(value=m.Call(func=m.Attribute(value=m.Name("self"), attr=m.Name("_init_reorder_batch_threshold"))))]
)
WORKSPACE_TAKE = m.Call(
    func=m.Attribute(value=m.Call(func=m.Name("current_workspace_manager")), attr=m.Name("get_simultaneous"))
)


class AddWorkspaceReservation(Codemod):
    """``TurboQuantMetadataBuilder._reserve_tq_workspace``, right after ``__init__``."""

    target = TARGET
    anchor = (BUILDER, INIT)
    patched = (BUILDER, func(METHOD, leading_lines=marked("PN353A")))

    def rewrite(self, node):
        (method,) = statements(
            f'''
            def {METHOD}(self) -> None:
                """Grow the shared workspace to what decode and continuation prefill can ask for."""
                if not is_workspace_manager_initialized():
                    return
                config = self.vllm_config
                model_config = config.model_config
                scheduler_config = config.scheduler_config
                num_heads = model_config.get_num_attention_heads(config.parallel_config)
                head_size = self.kv_cache_spec.head_size
                splits = config.attention_config.tq_max_kv_splits_for_cuda_graph
                rows = scheduler_config.max_num_seqs
                workspace = current_workspace_manager()
                # _decode_attention: mid_o, output (query dtype), lse
                workspace.get_simultaneous(
                    ((rows, num_heads, splits, head_size + 1), torch.float32),
                    ((rows, num_heads, head_size), model_config.dtype),
                    ((rows, num_heads), torch.float32),
                )
                if scheduler_config.max_num_batched_tokens <= _CONTINUATION_DECODE_THRESHOLD:
                    return  # continuations this short take the decode kernel, not the dequant
                # _continuation_prefill: fp16 K and V of the longest cached prefix
                block_size = self.kv_cache_spec.block_size
                cached = math.ceil((model_config.max_model_len - 1) / block_size) * block_size
                shape = (1, self.kv_cache_spec.num_kv_heads, cached, head_size)
                workspace.get_simultaneous((shape, torch.float16), (shape, torch.float16))
            '''
        )
        return insert_after(node, with_marker(method, "PN353A", WHY))


class ReserveAtConstruction(Codemod):
    """``__init__`` calls the reservation once the batch-reorder threshold is set."""

    target = TARGET
    anchor = (BUILDER, INIT, REORDER)
    patched = (BUILDER, INIT, m.SimpleStatementLine(leading_lines=marked("PN353A")))

    def rewrite(self, node):
        (call,) = statements(f"self.{METHOD}()")
        return insert_after(node, with_marker(call, "PN353A", WHY), blank_line=False)


def _is_kiln(node) -> bool:
    return any(line.comment and line.comment.value.startswith("# kiln PN353A:") for line in node.leading_lines)


class PN353A(Patch):
    id = "PN353A"
    family = "attention_turboquant"
    title = "TurboQuant WorkspaceManager scratch reserved at builder construction, before the lock"
    why = (
        "From 0.21.0 TurboQuant decode and continuation prefill take scratch from the "
        "WorkspaceManager, which is locked after capture and never saw a continuation: the first "
        "long prompt crashes the engine (locked-workspace AssertionError). Reserve it up front."
    )
    upstream_refs = ("vllm#40941", "vllm#41565", "vllm#40798", "vllm#44053")
    written_for = ">=0.20.1"
    gates = Gates(vllm=">=0.21.0", kv_cache_dtypes=("turboquant_*",))
    edits = (AddWorkspaceReservation, ReserveAtConstruction)

    def upstream_fix(self, module_of):
        module = module_of(TARGET)
        if module is None:
            return None
        for builder in find(module, BUILDER):
            methods = {node.name.value: node for node in find(builder, m.FunctionDef()) if not _is_kiln(node)}
            init = methods.get("__init__")
            if init is None:
                continue
            called = {
                call.func.attr.value
                for call in m.findall(init, m.Call(func=m.Attribute(value=m.Name("self"))))
            }
            for name in ["__init__", *sorted(called)]:
                takes = find(methods[name], WORKSPACE_TAKE) if name in methods else []
                if takes:
                    return (
                        f"{TARGET}:{line_of(module, takes[0])}: TurboQuantMetadataBuilder.{name} "
                        "reserves the WorkspaceManager scratch at construction, before the lock"
                    )
        return None
