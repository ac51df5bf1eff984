"""P81: the FP8 block-scaled Triton matmul's fallback config uses 16-row tiles for M <= 8.

What it changes: ``w8a8_triton_block_scaled_mm`` (``model_executor/layers/quantization/utils/
fp8_utils.py``) looks for a tuned config file for its (N, K, device, block shape); where none
exists it launches ``_w8a8_triton_block_scaled_mm`` with one default config for every M,
``BLOCK_SIZE_M`` 64, ``num_stages`` 2 (``fp8_utils.py:1052-1062`` on 0.33.0, ``:864-874`` on
0.20.1). A decode step of one request with MTP verifies 1 + K tokens (M = 6 for K = 5, 8 once
CUDA graphs pad it), so 56 or more of the 64 rows each program loads and multiplies are
padding (the kernel wraps row offsets modulo M and masks them at the store). The patch keeps
that config for M > 8 and for M <= 8 takes ``BLOCK_SIZE_M`` 16 and ``num_stages`` 3 (2 on
ROCm), as vllm#40925 proposes (open, unmerged). A tuned config file still wins: the branch is
only the fallback. Speed only; the result is unchanged: each output row is the same fp32
accumulation over the same K blocks in the same order, whatever the tile height (the test
proves it under Triton's interpreter on a grid of shapes, bit for bit).

Which images reach it (the kernel list ``_POSSIBLE_FP8_BLOCK_KERNELS`` in
``model_executor/kernels/linear/__init__.py``, first that can implement wins):
- 0.20.1: DeepGEMM (bf16 output only; kiln's 35B-A3B image serves float16), CUTLASS block FP8
  (sm_90 and up), Marlin (refuses compute capability >= 89 without
  ``VLLM_TEST_FORCE_FP8_MARLIN``, ``kernels/linear/scaled_mm/marlin.py:46-55``), then Triton: on
  sm_89 (L40S, RTX 6000 Ada) every FP8 linear layer of the 35B-A3B runs this kernel; vLLM's
  repository has no tuned L40S file for the model's largest shapes (N=9216 and 12288 at
  K=2048, N=2048 at K=4096; hidden size 2048), so they take the fallback.
- 0.33.0: Marlin accepts every compute capability from 7.5 (``marlin.py:35-45``) and stands
  before Triton in the list (``__init__.py:494-506``), so on CUDA the Triton kernel is reached
  only with ``--linear-backend``/``VLLM_DISABLED_KERNELS``; the patch is harmless there.

Verdicts across releases (``patchsets/release-train.toml``, every release 0.20.1-0.33.0): APPLIES
everywhere; the fallback dict is the same on each (vllm#40925 is not merged). Recognised as
UPSTREAM when vLLM's own fallback makes ``BLOCK_SIZE_M`` depend on M.
"""

import libcst.matchers as m

from kiln.patch.anchor import find, line_of
from kiln.patch.model import Codemod, Patch
from kiln.patch.shapes import func, insert_after, kiln_marked, marked, statements, with_marker

TARGET = "model_executor/layers/quantization/utils/fp8_utils.py"
WRAPPER = func("w8a8_triton_block_scaled_mm")


def _config_dict(block_m: m.BaseMatcherNode) -> m.SimpleStatementLine:
    """``config = {..., "BLOCK_SIZE_M": <block_m>, ...}``: the fallback config literal."""
    entry = m.DictElement(key=m.SimpleString('"BLOCK_SIZE_M"'), value=block_m)
    value = m.Dict(elements=[m.ZeroOrMore(), entry, m.ZeroOrMore()])
    return m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(m.Name("config"))], value=value)])


# The stock fallback: one 64-row tile height for every M.
DEFAULT_CONFIG = _config_dict(m.Integer("64"))
# kiln's small-M branch, right after it.
SMALL_M_BRANCH = m.If(
    test=m.Comparison(left=m.Name("M"), comparisons=[m.ComparisonTarget(m.LessThanEqual(), m.Integer("8"))]),
    leading_lines=marked("P81"),
)


class SmallMFallbackConfig(Codemod):
    """After the fallback dict: for M <= 8, 16-row tiles and a three-stage pipeline."""

    target = TARGET
    anchor = (WRAPPER, DEFAULT_CONFIG)
    patched = (WRAPPER, SMALL_M_BRANCH)

    def rewrite(self, node):
        (branch,) = statements(
            """
            if M <= 8:
                config = {
                    **config,
                    "BLOCK_SIZE_M": 16,
                    "num_stages": 2 if current_platform.is_rocm() else 3,
                }
            """
        )
        why = "64-row tiles leave 56+ of 64 rows padding for a decode step (M <= 8); vllm#40925"
        return insert_after(node, with_marker(branch, "P81", why), blank_line=False)


class P81(Patch):
    id = "P81"
    family = "quantization"
    title = "FP8 block-scaled Triton matmul: 16-row tiles in the fallback config for M <= 8"
    why = (
        "Without a tuned config file, w8a8_triton_block_scaled_mm launches 64-row tiles for "
        "every M, so a decode step (M <= 8) computes mostly padding. Take BLOCK_SIZE_M 16 and "
        "num_stages 3 for M <= 8 (vllm#40925); larger M and tuned configs are unchanged."
    )
    upstream_refs = ("vllm#40925",)
    written_for = ">=0.20.1"
    edits = (SmallMFallbackConfig,)

    def upstream_fix(self, module_of) -> str | None:
        module = module_of(TARGET)
        if module is None:
            return None
        for wrapper in find(module, WRAPPER):
            for line in find(wrapper, _config_dict(~m.Integer())):
                if not kiln_marked(line):
                    return f"{TARGET}:{line_of(module, line)}: the fallback config's BLOCK_SIZE_M depends on M"
        return None

