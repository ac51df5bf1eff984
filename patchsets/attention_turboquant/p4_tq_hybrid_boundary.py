"""P4: TurboQuant KV cache on hybrid (attention + Mamba/GDN) models.

Without the patch, vLLM 0.20.1 refuses to start a hybrid model (Qwen3.5/3.6, Qwen3-Next,
Jamba, ...) with a ``turboquant_*`` KV cache: ``EngineArgs.create_engine_config``
(``engine/arg_utils.py``) raises ``NotImplementedError`` because its boundary protection
(keep the first and last 2 layers unquantized) counts *all* decoder layers, and in a hybrid
most of those are linear-attention/Mamba layers that have no KV cache at all.

The patch rewrites that block: for a hybrid, the full-attention layers are identified from the
model config (``layer_types`` for Qwen3.5/3.6/Next, ``layers_block_type`` for Jamba/Zamba2,
``attn_type_list`` for MiniMax) and TurboQuant is kept on all of them; no boundary layer is
added (a hybrid has ~10 full-attention layers, and 2+2 of them would leave ~40% of its KV cache
unquantized). A hybrid whose full-attention layers cannot be identified still raises, with a
message that says so. Dense models keep the upstream boundary protection unchanged; layers the
user lists in ``--kv-cache-dtype-skip-layers`` are still skipped. Whether the model is hybrid is
decided at runtime in the emitted code: one image serves dense and hybrid models.

Note on the brief ("boundary layers computed from the full-attention layers only"): the
boundary set drawn from the full-attention layers is *empty* for hybrids, exactly as vLLM's own
fix and the Genesis P4 do. Protecting the first/last two full-attention layers instead would
diverge from upstream (the 0.33.0 verdict below would then not be honest) and cost ~40% of the
KV savings that are the point of TurboQuant on 24-32 GB cards.

0.33.0 verdict: UPSTREAM. ``TurboQuantConfig.get_boundary_skip_layers(model_config)``
(``model_executor/layers/quantization/turboquant/config.py``) now takes the model config and
handles hybrids itself (``if model_config.is_hybrid:`` → ``_get_full_attention_layer_indices``,
raise only if none, ``return []``), and ``create_engine_config`` calls it with
``model_config``, no hybrid raise left. Detected by ``upstream_fix`` on both shapes.

Verdicts across releases (``patchsets/release-train.toml``, reviewed on every release
0.20.1-0.33.0):
- 0.20.1, 0.20.2: APPLIES (the hybrid ``raise`` above).
- 0.21.0 on: UPSTREAM. vllm#39931 (TurboQuant on hybrid models) moved the hybrid handling
  into ``TurboQuantConfig.get_boundary_skip_layers(model_config)`` (``turboquant/config.py:187``
  on 0.21.0, ``:194`` on 0.33.0) and ``create_engine_config`` passes ``model_config``
  (``engine/arg_utils.py:1719`` on 0.21.0). The same shape through 0.33.0.
"""

import libcst.matchers as m

from kiln.patch.model import Codemod, Gates, Patch
from kiln.patch.shapes import cls, func, marked, place_of, statements, with_marker

TQ_CONFIG = "model_executor/layers/quantization/turboquant/config.py"
ENGINE_ARGS_FILE = "engine/arg_utils.py"

ENGINE_ARGS = cls("EngineArgs")
CREATE = func("create_engine_config")
# `if resolved_cache_dtype.startswith("turboquant_"):` (the other TQ check in the method is a
# boolean expression, so this test shape is unique)
TQ_BLOCK = m.If(
    test=m.Call(
        func=m.Attribute(value=m.Name("resolved_cache_dtype"), attr=m.Name("startswith")),
        args=[m.Arg(value=m.SimpleString('"turboquant_"'))],
    )
)
IS_HYBRID = m.Attribute(value=m.Name("model_config"), attr=m.Name("is_hybrid"))
HYBRID_RAISE = m.If(test=IS_HYBRID, body=m.IndentedBlock(body=[m.SimpleStatementLine(body=[m.Raise()])]))
BOUNDARY = m.SimpleStatementLine(
    body=[
        m.Assign(
            targets=[m.AssignTarget(target=m.Name("boundary"))],
            value=m.Call(func=m.Attribute(value=m.Name("TurboQuantConfig"), attr=m.Name("get_boundary_skip_layers"))),
        )
    ]
)

WHY_HYBRID = "hybrids keep TurboQuant on their full-attention layers (Mamba/GDN layers hold no KV cache)"
WHY_BOUNDARY = "no boundary skip for hybrids: 2+2 of their ~10 attention layers would stay unquantized"


class HybridBoundaryFromAttentionLayers(Codemod):
    """Replace the hybrid ``raise`` and make the boundary set empty for hybrids."""

    target = ENGINE_ARGS_FILE
    anchor = (ENGINE_ARGS, CREATE, TQ_BLOCK)
    patched = (ENGINE_ARGS, CREATE, TQ_BLOCK, m.If(test=IS_HYBRID, leading_lines=marked("P4")))

    def rewrite(self, node):
        (hybrid,) = statements(
            """
            if model_config.is_hybrid:
                text_config = model_config.hf_text_config
                layer_types = getattr(text_config, "layer_types", None)
                block_types = getattr(text_config, "layers_block_type", None)
                attn_type_list = getattr(model_config.hf_config, "attn_type_list", None)
                if layer_types is not None:
                    attn_layers = [
                        i
                        for i, t in enumerate(layer_types)
                        if t in ("full_attention", "attention")
                    ]
                elif block_types is not None:
                    attn_layers = [
                        i for i, t in enumerate(block_types) if t in ("attention", "hybrid")
                    ]
                elif attn_type_list is not None:
                    attn_layers = [i for i, t in enumerate(attn_type_list) if t == 1]
                else:
                    attn_layers = []
                if not attn_layers:
                    raise NotImplementedError(
                        "TurboQuant KV cache on a hybrid model needs identifiable "
                        "full-attention layers (layer_types, layers_block_type or "
                        "attn_type_list in the model config); none were found."
                    )
                logger.info("TQ hybrid: full-attention layers %s", attn_layers)
            """
        )
        (boundary,) = statements(
            """
            boundary = (
                []
                if model_config.is_hybrid
                else TurboQuantConfig.get_boundary_skip_layers(num_layers)
            )
            """
        )
        body = []
        for stmt in node.body.body:
            if m.matches(stmt, HYBRID_RAISE):
                stmt = with_marker(hybrid.with_changes(leading_lines=stmt.leading_lines), "P4", WHY_HYBRID)
            elif m.matches(stmt, BOUNDARY):
                stmt = with_marker(boundary.with_changes(leading_lines=stmt.leading_lines), "P4", WHY_BOUNDARY)
            body.append(stmt)
        if sum(a is not b for a, b in zip(body, node.body.body, strict=True)) != 2:
            raise ValueError("expected exactly one hybrid raise and one boundary assignment in the TurboQuant block")
        return node.with_changes(body=node.body.with_changes(body=body))


# Upstream shape: get_boundary_skip_layers(model_config, ...) branches on is_hybrid and returns.
UPSTREAM_HYBRID_BRANCH = (
    cls("TurboQuantConfig"),
    func("get_boundary_skip_layers"),
    m.If(test=IS_HYBRID, body=m.IndentedBlock(body=[m.ZeroOrMore(), m.SimpleStatementLine(body=[m.Return()]), m.ZeroOrMore()])),
)
UPSTREAM_CALL = (
    ENGINE_ARGS,
    CREATE,
    m.Call(
        func=m.Attribute(value=m.Name("TurboQuantConfig"), attr=m.Name("get_boundary_skip_layers")),
        args=[m.Arg(value=m.Name("model_config")), m.ZeroOrMore()],
    ),
)


class P4(Patch):
    id = "P4"
    family = "attention_turboquant"
    title = "TurboQuant KV on hybrid models (boundary layers from full-attention layers only)"
    why = (
        "create_engine_config raises NotImplementedError for turboquant_* KV on hybrid "
        "(attention + Mamba/GDN) models. Identify the full-attention layers instead and skip no "
        "boundary layers for hybrids; dense models keep boundary protection."
    )
    upstream_refs = ("vllm#39931",)
    written_for = ">=0.20.1"
    gates = Gates(kv_cache_dtypes=("turboquant_*",))
    edits = (HybridBoundaryFromAttentionLayers,)

    def upstream_fix(self, module_of) -> str | None:
        branch = place_of(TQ_CONFIG, module_of(TQ_CONFIG), UPSTREAM_HYBRID_BRANCH)
        call = place_of(ENGINE_ARGS_FILE, module_of(ENGINE_ARGS_FILE), UPSTREAM_CALL)
        if branch and call:
            return (
                f"{branch}: TurboQuantConfig.get_boundary_skip_layers(model_config) returns no "
                f"boundary layers for hybrids (raising only when no full-attention layer is "
                f"found); {call}: create_engine_config passes model_config (vllm#39931)"
            )
        return None
