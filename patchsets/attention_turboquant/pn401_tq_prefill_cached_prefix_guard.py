"""PN401: TurboQuant's flash-attention prefill fast path no longer drops a co-batched request's cached prefix.

``TurboQuantAttentionImpl._prefill_attention`` takes one ``flash_attn_varlen`` call over the
whole (sub-)batch when ``max_query_len == max_seq_len``, passing the *query* offsets as
``cu_seqlens_k``: every request attends to the K/V of its own new tokens only. The equality
was meant to say "no request has cached KV", but it only says that the longest request is a
fresh prompt. A batch holding a fresh prompt of L tokens (``q_len == seq_len == L``) and any
other request with ``seq_len <= L`` and a cached prefix (``q_len < seq_len``) passes the test:

- a chunked-prefill continuation (the second chunk of a long prompt);
- a prefix-cache hit (the first scheduled chunk starts after the cached blocks);
- a spec-decode verify request: with ``reorder_batch_threshold = 1`` and no spec-as-decode
  (both releases), the K+1 tokens of an MTP verify step are a *prefill* row. So on the kiln
  preset (MTP K=3, ``--max-num-seqs 4``) it is enough that a new prompt arrives that is at
  least as long as a request that is generating: in that step the generating request's
  verify tokens see only themselves, its target logits are garbage and whatever they accept
  is emitted (vllm#46461 reports 47-75 hallucinations over the 52 C-Eval subjects with
  Qwen3-8B, ``turboquant_4bit_nc`` and prefix caching).

The mixed decode+prefill branch of ``forward`` builds the prefill sub-batch with its own
``max_seq_len`` so it reaches the same test with the same flaw.

The patch decides on the host, once per step, whether any prefill row (``index >=
num_decodes``) has ``q_len != seq_len``: ``TurboQuantMetadataBuilder.build`` compares
``query_start_loc_cpu`` with ``seq_lens_cpu_upper_bound`` (CPU tensors of the common metadata
on both releases: no device sync; the bound is exact for prefill rows, and an optimistic
verify row still has ``seq_len > q_len``) and stores ``prefill_has_cached_prefix`` in
``TurboQuantMetadata`` (default True: lengths unknown means take the path that reads the
cache). ``forward`` hands it to the prefill sub-batch of a mixed batch, and the fast path
requires it to be False. Batches of fresh prompts keep the single flash-attention call; any
batch with a cached prefix goes to the per-request loop, which already attends to the cache
(the decode kernel for short continuations, ``_continuation_prefill`` for long ones).

Upstream: vllm#46461 (open, unmerged) guards the same test with a ``_has_continuation``
computed in ``_prefill_attention``. ``upstream_fix`` recognises vLLM's fix wherever it lands
as the fast-path ``if`` (the one returning ``_flash_attn_varlen`` with ``cu_seqlens_k =
attn_metadata.query_start_loc``) carrying a guard beyond ``_HAS_FLASH_ATTN`` and the length
equality, and names its file:line.

Verdicts: 0.20.1 APPLIES (``v1/attention/backends/turboquant_attn.py:546`` is the bare
test; builder at :203, mixed-branch prefill metadata at :469). 0.33.0 APPLIES
(``turboquant_attn.py:740``, unchanged; builder at :273, prefill metadata at :638); no release
from 0.20.1 to 0.33.0 carries a guard.

Verdicts across releases (``patchsets/release-train.toml``, reviewed on every release
0.20.1-0.33.0):
- 0.20.1-0.33.0: APPLIES: the fast path's test is the bare ``max_query_len == max_seq_len`` on
  every release (``v1/attention/backends/turboquant_attn.py:546`` on 0.20.1, ``:740`` on
  0.33.0); vllm#46461 is unmerged and no release guards it.
"""

import libcst as cst
import libcst.matchers as m

from kiln.patch.anchor import find, line_of
from kiln.patch.model import Codemod, Gates, Patch
from kiln.patch.shapes import assign_to, cls, func, insert_after, marked, statements, with_marker

TARGET = "v1/attention/backends/turboquant_attn.py"
METADATA = cls("TurboQuantMetadata")
BUILDER = cls("TurboQuantMetadataBuilder")
IMPL = cls("TurboQuantAttentionImpl")
PREFILL = func("_prefill_attention")
FLAG = "prefill_has_cached_prefix"

WHY = "one flash call over new tokens only is wrong once a co-batched row has a cached prefix"


def _metadata_attr(name: str) -> m.Attribute:
    return m.Attribute(value=m.Name("attn_metadata"), attr=m.Name(name))


RETURN_METADATA = m.SimpleStatementLine(body=[m.Return(value=m.Call(func=m.Name("TurboQuantMetadata")))])
PREFILL_META = m.SimpleStatementLine(
    body=[
        m.Assign(
            targets=[m.AssignTarget(target=m.Name("prefill_meta"))],
            value=m.Call(func=m.Name("TurboQuantMetadata")),
        )
    ]
)
# `if _HAS_FLASH_ATTN and attn_metadata.max_query_len == attn_metadata.max_seq_len:`
BARE_FAST_PATH = m.If(
    test=m.BooleanOperation(
        left=m.Name("_HAS_FLASH_ATTN"),
        operator=m.And(),
        right=m.Comparison(
            left=_metadata_attr("max_query_len"),
            comparisons=[m.ComparisonTarget(operator=m.Equal(), comparator=_metadata_attr("max_seq_len"))],
        ),
    )
)
# The fast path in any shape: an `if` whose body returns flash attention over query offsets.
FLASH_OVER_QUERIES = m.If(
    body=m.IndentedBlock(
        body=[
            m.ZeroOrMore(),
            m.SimpleStatementLine(
                body=[
                    m.Return(
                        value=m.Call(
                            func=m.Attribute(value=m.Name("self"), attr=m.Name("_flash_attn_varlen")),
                            args=[
                                m.ZeroOrMore(),
                                m.Arg(keyword=m.Name("cu_seqlens_k"), value=_metadata_attr("query_start_loc")),
                                m.ZeroOrMore(),
                            ],
                        )
                    )
                ]
            ),
            m.ZeroOrMore(),
        ]
    )
)


def _with_keyword(call: cst.Call, keyword: str, value: str) -> cst.Call:
    """``call`` with ``keyword=value`` appended, one argument per line like the others."""
    args = list(call.args)
    new = cst.Arg(
        keyword=cst.Name(keyword),
        value=cst.parse_expression(value),
        equal=cst.AssignEqual(whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace("")),
        comma=args[-1].comma,
    )
    between = args[-2].comma if len(args) > 1 else cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
    return call.with_changes(args=[*args[:-1], args[-1].with_changes(comma=between), new])


class AddCachedPrefixField(Codemod):
    """``TurboQuantMetadata.prefill_has_cached_prefix``, right after ``num_decode_tokens``."""

    target = TARGET
    anchor = (METADATA, assign_to("num_decode_tokens"))
    patched = (METADATA, m.SimpleStatementLine(leading_lines=marked("PN401")))

    def rewrite(self, node):
        # unknown (metadata built elsewhere) reads as True: the path that reads the cache
        (field,) = statements(f"{FLAG}: bool = True  # a prefill row attends to KV cached before this step")
        return insert_after(node, with_marker(field, "PN401", WHY), blank_line=False)


class AddCachedPrefixCheck(Codemod):
    """``TurboQuantMetadataBuilder._prefill_has_cached_prefix``, after ``build``."""

    target = TARGET
    anchor = (BUILDER, func("build"))
    patched = (BUILDER, func("_prefill_has_cached_prefix", leading_lines=marked("PN401")))

    def rewrite(self, node):
        (method,) = statements(
            '''
            @staticmethod
            def _prefill_has_cached_prefix(cam, first_prefill: int) -> bool:
                """Whether a row from ``first_prefill`` on has a query shorter than its sequence."""
                # Host tensors only: nothing waits on the device. The upper bound is exact for
                # prefill rows; an optimistic spec-verify row still has seq_len > q_len.
                seq_lens = cam.seq_lens_cpu_upper_bound
                if seq_lens is None:
                    return True
                num_reqs = cam.num_reqs
                starts = cam.query_start_loc_cpu[first_prefill : num_reqs + 1]
                query_lens = starts[1:] - starts[:-1]
                return bool((query_lens != seq_lens[first_prefill:num_reqs]).any())
            '''
        )
        return insert_after(node, with_marker(method, "PN401", WHY))


class SetFlagInBuild(Codemod):
    """``build`` fills the field for the rows after the decodes."""

    target = TARGET
    anchor = (BUILDER, func("build"), RETURN_METADATA)
    patched = (BUILDER, func("build"), m.SimpleStatementLine(leading_lines=marked("PN401")))

    def rewrite(self, node):
        ret = node.body[0]
        call = _with_keyword(ret.value, FLAG, f"self._{FLAG}(cam, num_decodes)")
        return with_marker(node.with_changes(body=[ret.with_changes(value=call)]), "PN401", WHY)


class PassFlagToPrefillRows(Codemod):
    """The mixed branch of ``forward`` gives its prefill sub-batch the builder's answer."""

    target = TARGET
    anchor = (IMPL, func("forward"), PREFILL_META)
    patched = (IMPL, func("forward"), m.SimpleStatementLine(leading_lines=marked("PN401")))

    def rewrite(self, node):
        assign = node.body[0]
        call = _with_keyword(assign.value, FLAG, f"attn_metadata.{FLAG}")
        return with_marker(node.with_changes(body=[assign.with_changes(value=call)]), "PN401", WHY)


class GuardFastPath(Codemod):
    """The flash-attention fast path requires that no row has a cached prefix."""

    target = TARGET
    anchor = (IMPL, PREFILL, BARE_FAST_PATH)
    patched = (IMPL, PREFILL, m.If(leading_lines=marked("PN401")))

    def rewrite(self, node):
        (template,) = statements(
            f"""
            if (
                _HAS_FLASH_ATTN
                and attn_metadata.max_query_len == attn_metadata.max_seq_len
                and not attn_metadata.{FLAG}
            ):
                pass
            """
        )
        return with_marker(node.with_changes(test=template.test, whitespace_before_test=template.whitespace_before_test), "PN401", WHY)


def _is_kiln(node: cst.CSTNode) -> bool:
    return any(line.comment and line.comment.value.startswith("# kiln PN401:") for line in node.leading_lines)


# What the unguarded test is made of; a fast-path test naming anything else carries a guard.
BARE_TEST_NAMES = {"_HAS_FLASH_ATTN", "attn_metadata", "max_query_len", "max_seq_len"}


def _names_in(test: cst.BaseExpression) -> set[str]:
    found = {n.value for n in m.findall(test, m.Name())}
    return found | {a.attr.value for a in m.findall(test, m.Attribute())}


class PN401(Patch):
    id = "PN401"
    family = "attention_turboquant"
    title = "TurboQuant prefill fast path: not taken when a co-batched request has a cached prefix"
    why = (
        "max_query_len == max_seq_len sends a whole prefill batch to one flash-attention call over "
        "its new tokens; a co-batched continuation, prefix-cache hit or MTP verify row then loses "
        "its cached prefix (hallucinated output). Take the fast path only when no row has one."
    )
    upstream_refs = ("vllm#46460", "vllm#46461")
    written_for = ">=0.20.1"
    gates = Gates(kv_cache_dtypes=("turboquant_*",))
    edits = (AddCachedPrefixField, AddCachedPrefixCheck, SetFlagInBuild, PassFlagToPrefillRows, GuardFastPath)

    def upstream_fix(self, module_of):
        module = module_of(TARGET)
        if module is None:
            return None
        for impl in find(module, IMPL):
            for method in find(impl, PREFILL):
                for fast_path in find(method, FLASH_OVER_QUERIES):
                    if _is_kiln(fast_path) or not _names_in(fast_path.test) - BARE_TEST_NAMES:
                        continue
                    return (
                        f"{TARGET}:{line_of(module, fast_path)}: the flash-attention fast path of "
                        "_prefill_attention is guarded beyond the max_query_len == max_seq_len test"
                    )
        return None
