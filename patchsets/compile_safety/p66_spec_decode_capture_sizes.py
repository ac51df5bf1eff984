"""P66: with spec decode, cudagraph capture sizes are multiples of 1 + num_speculative_tokens in every mode.

The hazard (vllm#28015, #28207): a uniform-decode FULL cudagraph captured at a size that is
not a multiple of the decode query length 1 + K bakes a dummy batch such as ``[4, 4, 2]``
(10 tokens at K=3) whose last request is a prefill, and replays of real decode batches run
that prefill path. On 0.20.1 vLLM already prevents it wherever FULL decode graphs are
captured: ``CompilationConfig.resolve_cudagraph_mode_and_sizes`` rounds the sizes up to
multiples of 1 + K with ``adjust_cudagraph_sizes_for_spec_decode`` when the *resolved*
decode mode is FULL (FULL, FULL_DECODE_ONLY, FULL_AND_PIECEWISE), and
``CudagraphDispatcher._create_padded_batch_descriptor`` asserts divisibility for uniform
keys.

So P66 changes behaviour only with spec decode when the resolved decode mode is PIECEWISE or
NONE: ``cudagraph_mode=PIECEWISE``, or FULL_AND_PIECEWISE downgraded to PIECEWISE because
the attention backend reports less than UNIFORM_BATCH under spec decode (TurboQuant with
P65). There the capture list stays the token grid ``1, 2, 4, 8, ...`` (or ``1..32`` with
``performance_mode=interactivity``): graphs at sizes no verify batch (B * (1 + K) tokens)
ever has, and none of the exact verify sizes at K=2 (3, 6, 9). P66 runs vLLM's own rounding
once more at the end of ``VllmConfig._set_cudagraph_sizes`` (config time, before the mode is
resolved), so the list is the one a FULL-decode configuration would capture (explicit
``cudagraph_capture_sizes`` included, as vLLM rounds those too): e.g. at K=3 interactivity
mode captures 4, 8, ..., 32 below 33 tokens (8 graphs instead of 32). In FULL decode modes
the later rounding then finds nothing to change. The cost: mixed batches whose token count falls
between two multiples pad a little more. Rounding rather than dropping (Genesis drops the
non-multiples and re-adds 1 + K) keeps coverage when 1 + K is not a power of two: at K=2 the
default grid rounds to 3, 6, 9, 18, 24, ... where dropping leaves 3, 24, 48, ...
Sequence parallelism (TP > 1 with ``pass_config.enable_sp``) is left alone: its sizes must
also be multiples of TP, and vLLM's rounding rejects incompatible K/TP pairs, which would
turn a working PIECEWISE configuration into a startup error.

Verdict on 0.33.0: UPSTREAM. ``VllmConfig._set_cudagraph_sizes`` builds
``uniform_decode_sizes`` itself (a request-count grid times 1 + K, per dynamic-spec tier)
and appends it to the default list in every mode, keeping the token grid for mixed batches
on purpose (its comments: dispatch needs an exact multiple of the decode query length);
``adjust_cudagraph_sizes_for_spec_decode`` (``config/compilation.py``) still rounds for FULL
decode on model runner v1, and v2 sizes its graphs in ``cudagraph_utils``. The sequence-
parallelism filter P66's Genesis anchor sat on is gone from this method. ``Patch.
upstream_fix`` recognises the ``uniform_decode_sizes`` shape.

Verdicts across releases (``patchsets/release-train.toml``, reviewed on every release
0.20.1-0.33.0):
- 0.20.1-0.28.0: APPLIES. Capture sizes are rounded for spec decode only when the decode mode
  is FULL (``CompilationConfig``; from 0.28.0 only for model runner v1, v2 sizes its own
  graphs, vllm#45953, and hybrids like Qwen3.6 default to v1).
- 0.29.0 on: UPSTREAM. ``_set_cudagraph_sizes`` builds ``uniform_decode_sizes``
  (``config/vllm.py:2002`` on 0.29.0) in every mode: most likely vllm#50488, whose review
  discusses the 581-versus-100 sizes trade-off the 0.29.0 comment records. Partly: upstream
  fills them in only when it computes the default list; an explicit ``cudagraph_capture_sizes``
  stays exactly as configured, by design, where P66 would have rounded it.
"""

import libcst.matchers as m

from kiln.patch.model import Codemod, Patch
from kiln.patch.shapes import (
    assign_to,
    cls,
    func,
    insert_after,
    marked,
    place_of,
    statements,
    with_marker,
)

TARGET = "config/vllm.py"
SET_SIZES = (cls("VllmConfig"), func("_set_cudagraph_sizes"))
WHY = "round capture sizes to multiples of 1 + num_speculative_tokens in every cudagraph mode"

# `self.compilation_config.cudagraph_capture_sizes = cudagraph_capture_sizes`: the write-back of
# the final sizes (max_cudagraph_capture_size is already set just before it).
WRITE_BACK = m.SimpleStatementLine(
    body=[
        m.Assign(
            targets=[
                m.AssignTarget(
                    target=m.Attribute(
                        value=m.Attribute(value=m.Name("self"), attr=m.Name("compilation_config")),
                        attr=m.Name("cudagraph_capture_sizes"),
                    )
                )
            ],
            value=m.Name("cudagraph_capture_sizes"),
        )
    ]
)


class RoundCaptureSizesForSpecDecode(Codemod):
    """Call vLLM's spec-decode rounding right after the sizes are written back."""

    target = TARGET
    anchor = (*SET_SIZES, WRITE_BACK)
    patched = (*SET_SIZES, m.If(leading_lines=marked("P66")))

    def rewrite(self, node):
        (rounding,) = statements(
            """
            if (
                self.speculative_config is not None
                and self.speculative_config.num_speculative_tokens
                and not (
                    self.parallel_config.tensor_parallel_size > 1
                    and self.compilation_config.pass_config.enable_sp
                )
            ):
                self.compilation_config.adjust_cudagraph_sizes_for_spec_decode(
                    1 + self.speculative_config.num_speculative_tokens,
                    self.parallel_config.tensor_parallel_size,
                )
            """
        )
        return insert_after(node, with_marker(rounding, "P66", WHY))


class P66(Patch):
    id = "P66"
    family = "compile_safety"
    title = "Spec decode: cudagraph capture sizes rounded to multiples of 1 + num_speculative_tokens in every mode"
    why = (
        "With spec decode and a PIECEWISE decode mode (e.g. FULL_AND_PIECEWISE downgraded by the "
        "attention backend), vLLM leaves the capture sizes on the token grid: graphs no verify "
        "batch (B*(1+K) tokens) uses, gaps where it needs one. Round them as vLLM does for FULL."
    )
    upstream_refs = ("vllm#28015", "vllm#28207", "vllm#23679")
    written_for = ">=0.20.1"
    edits = (RoundCaptureSizesForSpecDecode,)

    def upstream_fix(self, module_of):
        where = place_of(TARGET, module_of(TARGET), (*SET_SIZES, assign_to("uniform_decode_sizes")))
        if where:
            return (
                f"{where}: VllmConfig._set_cudagraph_sizes appends uniform_decode_sizes (multiples of "
                "1 + num_speculative_tokens) to the default sizes in every cudagraph mode; FULL decode "
                "sizes are still rounded by CompilationConfig.adjust_cudagraph_sizes_for_spec_decode"
            )
        return None
