"""K4: TurboQuant's per-request prefill loop attends over device lengths, not the host's optimistic ones.

Genesis has no such fix, so the id is from kiln's own sequence (``K<n>``, a prefix Genesis
never uses); it was PN401b until the ids were aligned, and records written then still read
(``kiln.patch.catalog.RENAMED``).

Since vllm#41434 (0.21.0) ``TurboQuantAttentionImpl._prefill_attention`` reads request lengths
from ``attn_metadata.seq_lens_cpu``, which ``TurboQuantMetadataBuilder.build`` fills with
``cam.seq_lens_cpu_upper_bound``. ``CommonAttentionMetadata`` documents that bound as "precise
for prefill rows ... optimistic for async-spec decode rows (assumes every draft was
accepted)": under async scheduling, which ``VllmConfig`` turns on by default for MTP
(``config/vllm.py``: EagleModelTypes include the MTP methods), the runner builds it from
``num_computed_tokens_cpu`` before the previous step's rejections are known
(``v1/worker/gpu_model_runner.py``: "Optimistically assume all accepted ... Corrected on GPU
in _prepare_inputs"); only the device ``seq_lens`` are corrected.

TurboQuant treats an MTP verify row (K+1 tokens) as a *prefill* row (``reorder_batch_threshold
= 1``, no spec-as-decode), so every verify step that is not a FULL-graph uniform batch (with
P65, the kiln preset's choice: all of them) runs this loop. For a short continuation it builds
``synth_seq_lens = _arange_cache[cached_len + 1 : seq_len + 1]`` from the host ``seq_len``:
after a step in which r drafts were rejected, every query of that request attends r positions
too far, over the later draft tokens of its own step (future tokens) and stale slots past
them. The target logits that decide acceptance are wrong in every step that follows a partial
acceptance (with K=3: whenever fewer than 3 drafts were accepted).

The patch builds the per-query lengths on the device from the device ``seq_lens``, exactly
as the decode batch does: ``attn_metadata.seq_lens[i] - q_len + _arange_cache[1 : q_len +
1]`` (the slice of the existing arange; no host sync, no new allocation beyond the result).
The host ``seq_len`` still decides the route (fresh prompt, short or long continuation), which
it does correctly: prefill rows are exact, and an over-stated verify row is still a short
continuation. P67b (variant) sends uniform verify batches to its own launch that already uses
the device lengths; mixed batches still come here, so the two compose (no conflict).

Gate ``vllm>=0.21.0``: before vllm#41434 the loop reads ``attn_metadata.seq_lens.tolist()``, the
device's corrected values (0.20.1 ``v1/attention/backends/turboquant_attn.py:570-571``), and
builds ``torch.arange(cached_len + 1, seq_len + 1)`` from them (:625), so the failure cannot
exist there (GATED, not TARGET_GONE: the file and method are there, the failure is not).

Verdicts: 0.20.1 GATED. 0.33.0 APPLIES (``turboquant_attn.py:297`` fills ``seq_lens_cpu`` from
the upper bound, :769 reads it, :837 builds the lengths). The same statement is in every
release from 0.21.0 to 0.33.0. vLLM's own fix, where it lands in this loop, would build the
lengths from ``attn_metadata.seq_lens``: the ``upstream`` matcher looks for that.

Verdicts across releases (``patchsets/release-train.toml``, reviewed on every release
0.20.1-0.33.0):
- 0.20.1, 0.20.2: GATED (``vllm>=0.21.0``): the per-request loop reads the device's corrected
  lengths (``attn_metadata.seq_lens.tolist()``, ``turboquant_attn.py:571`` on 0.20.2), so the
  failure cannot happen.
- 0.21.0 on: APPLIES: vllm#41434 made the loop read ``attn_metadata.seq_lens_cpu``, which the
  builder fills from ``cam.seq_lens_cpu_upper_bound`` (``turboquant_attn.py:238`` and ``:608`` on
  0.21.0; ``:297`` and ``:769`` on 0.33.0); no release builds the lengths from the device
  ``seq_lens`` instead.
"""

import libcst.matchers as m

from kiln.patch.model import Codemod, Gates, Patch
from kiln.patch.shapes import cls, func, marked, statements, with_marker

TARGET = "v1/attention/backends/turboquant_attn.py"
IMPL = cls("TurboQuantAttentionImpl")
PREFILL = func("_prefill_attention")
WHY = "lengths from the device seq_lens: the host bound over-states async spec-verify rows"


def _assigns_synth_seq_lens(value: m.BaseExpression) -> m.SimpleStatementLine:
    return m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(target=m.Name("synth_seq_lens"))], value=value)])


# `synth_seq_lens = _arange_cache[cached_len + 1 : seq_len + 1]` (0.21.0 ... 0.33.0)
HOST_LENGTHS = _assigns_synth_seq_lens(m.Subscript(value=m.Name("_arange_cache")))
# vLLM's fix in this loop would derive the lengths from the device tensor.
DEVICE_LENGTHS = _assigns_synth_seq_lens(
    m.MatchIfTrue(
        lambda expr: bool(
            m.findall(expr, m.Attribute(value=m.Name("attn_metadata"), attr=m.Name("seq_lens")))
        )
    )
)


class LengthsFromDevice(Codemod):
    """Replace the host-length slice by lengths computed from ``attn_metadata.seq_lens[i]``."""

    target = TARGET
    anchor = (IMPL, PREFILL, HOST_LENGTHS)
    patched = (IMPL, PREFILL, m.SimpleStatementLine(leading_lines=marked("K4")))
    upstream = (IMPL, PREFILL, DEVICE_LENGTHS)

    def rewrite(self, node):
        (device,) = statements("synth_seq_lens = attn_metadata.seq_lens[i] - q_len + _arange_cache[1 : q_len + 1]")
        return with_marker(device.with_changes(leading_lines=node.leading_lines), "K4", WHY)


class K4(Patch):
    id = "K4"
    family = "attention_turboquant"
    title = "TurboQuant prefill loop: per-query lengths from the device seq_lens, not the host upper bound"
    why = (
        "Since 0.21.0 the per-request prefill loop takes lengths from seq_lens_cpu_upper_bound, "
        "which async spec decode over-states for MTP verify rows after a rejection: their queries "
        "attend to later drafts and stale slots. Build the lengths from the device seq_lens."
    )
    upstream_refs = ("vllm#41434",)
    written_for = ">=0.20.1"
    gates = Gates(vllm=">=0.21.0", kv_cache_dtypes=("turboquant_*",))
    edits = (LengthsFromDevice,)
