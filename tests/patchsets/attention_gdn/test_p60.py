"""P60 on real 0.20.1 source: rows decoded without drafts after a spec step resume from the accepted state.

Behaviour tests by extraction: the statements P60 emits (found by their marker) and the
runner's patched ``_build_attn_group_metadata`` are taken from the patched files and executed
against stand-ins (the real modules import CUDA-only kernels; torch is not installed here).
``Rows`` is a pure-Python stand-in for the few torch tensor operations the emitted code uses
(slices are views, fancy indexing copies), so the index logic runs for real.

The scenario: 3 requests with ``num_spec = 2``, so each row of the GDN block table has 3
state blocks. The last spec step accepted 3, 1 and 2 tokens: the SSM states to resume from
are in blocks 13, 21 and 32, and the conv windows start at tokens 2, 0 and 1. The pristine
non-spec path reads column 0 (blocks 11, 21, 31) at offset 0.
"""

from __future__ import annotations

import types

import libcst as cst
import pytest
from packaging.version import Version

from kiln.patch.engine import isolated_run
from kiln.patch.model import BuildTarget, Verdict
from tests.patchsets.support.patchlib import extract, patched_files

GDN_ATTN = "v1/attention/backends/gdn_attn.py"
GDN_LAYER = "model_executor/layers/mamba/gdn_linear_attn.py"
RUNNER = "v1/worker/gpu_model_runner.py"
NULL_BLOCK_ID = 0


class Rows:
    """A 1-D stand-in tensor whose items are ints, bools or lists (rows); slices are views."""

    def __init__(self, items, index=None):
        self.buf = items if index is not None else list(items)
        self.index = index if index is not None else list(range(len(self.buf)))

    def values(self):
        return [self.buf[i] for i in self.index]

    def size(self, dim=0):
        return len(self.index) if dim == 0 else len(self.values()[0])

    def __getitem__(self, key):
        if isinstance(key, slice):
            return Rows(self.buf, self.index[key])
        if isinstance(key, tuple):  # [:, j]
            rows, col = key
            return Rows([row[col] for row in self[rows].values()])
        picks = key.values()
        if picks and isinstance(picks[0], bool):
            return Rows([v for v, keep in zip(self.values(), picks, strict=True) if keep])
        return Rows([self.values()[i] for i in picks])

    def __setitem__(self, key, value):
        for where, item in zip(key.values(), value.values(), strict=True):
            self.buf[where] = item

    def __invert__(self):
        return Rows([not v for v in self.values()])

    def __sub__(self, k):
        return Rows([v - k for v in self.values()])

    def clamp(self, min):  # noqa: A002 - torch's keyword
        return Rows([max(v, min) for v in self.values()])

    def long(self):
        return self

    def unsqueeze(self, dim):
        assert dim == 1
        return Rows([[v] for v in self.values()])

    def squeeze(self, dim):
        assert dim == 1
        return Rows([v[0] for v in self.values()])

    def gather(self, dim, index):
        assert dim == 1
        return Rows([[row[j] for j in picks] for row, picks in zip(self.values(), index.values(), strict=True)])

    def copy_(self, other, non_blocking=False):
        for where, item in zip(self.index, other.values(), strict=True):
            self.buf[where] = item

    def fill_(self, value):
        for where in self.index:
            self.buf[where] = value


BLOCKS = [[11, 12, 13], [21, 22, 23], [31, 32, 33]]
ACCEPTED = [3, 1, 2]


def _marked_blocks(source: str, dotted: str, patch_id: str = "P60") -> list[list[str]]:
    """Each run of statements in ``dotted`` that starts at a marker and ends at a blank line."""
    module = cst.parse_module(extract(source, dotted))
    prefix = f"# kiln {patch_id}:"
    blocks: list[list[cst.CSTNode]] = []

    class Collect(cst.CSTVisitor):
        def visit_IndentedBlock(self, node):
            current = None
            for statement in node.body:
                lines = statement.leading_lines
                if any(line.comment and line.comment.value.startswith(prefix) for line in lines):
                    current = [statement]
                    blocks.append(current)
                elif current is not None and not any(line.comment is None for line in lines):
                    current.append(statement)
                else:
                    current = None

    module.visit(Collect())
    return [[module.code_for_node(s.with_changes(leading_lines=[])) for s in block] for block in blocks]


def _run(code: str, **names) -> dict:
    import textwrap

    namespace = dict(names)
    exec(compile(textwrap.dedent(code), "patched", "exec"), namespace)
    return namespace


@pytest.fixture(scope="module")
def patched(catalogue, sessions):
    return patched_files(catalogue, sessions("v0.20.1"), "P60")


@pytest.fixture(scope="module")
def builder_blocks(patched):
    blocks = _marked_blocks(patched[GDN_ATTN], "GDNAttentionMetadataBuilder.build")
    assert len(blocks) == 4  # + the metadata constructor

    def starting(text):
        (block,) = [b for b in blocks if b[0].startswith(text)]
        return "".join(block)

    return (
        next(b[0] for b in blocks if b[0].startswith("accepted_last_step =")),  # the split follows
        starting("spec_decode_src_indices = None"),
        starting("if spec_decode_src_indices is not None:"),
    )


def _build_rows(builder_blocks, *, accepted, masks=None, use_spec_decode=True):
    """Run P60's two blocks of ``build`` around the pristine split's non-spec state indices."""
    keep, derive, _ = builder_blocks
    block_table = Rows(BLOCKS + [[NULL_BLOCK_ID] * 3])  # + one padding row
    self = types.SimpleNamespace(use_spec_decode=use_spec_decode)
    names = _run(keep, self=self, num_accepted_tokens=Rows(accepted) if accepted is not None else None)
    if masks is None:  # pristine non-spec branch
        non_spec_state_indices_tensor = block_table[:, 0]
    else:  # pristine mixed branch
        masks = Rows(masks)
        non_spec_state_indices_tensor = block_table[~masks, 0]
    names = _run(
        derive,
        accepted_last_step=names["accepted_last_step"],
        non_spec_state_indices_tensor=non_spec_state_indices_tensor,
        block_table_tensor=block_table,
        spec_sequence_masks_cpu=masks,
    )
    return non_spec_state_indices_tensor, names["spec_decode_src_indices"], names["non_spec_num_accepted"]


def test_draftless_step_points_each_row_at_its_accepted_block(builder_blocks):
    read, src, counts = _build_rows(builder_blocks, accepted=ACCEPTED + [1])
    assert read.values() == [11, 21, 31, 0]  # what the pristine kernels read: column 0
    assert src.values() == [13, 21, 32, 0]  # where the accepted states are
    assert counts.values() == [3, 1, 2, 1]  # conv windows start at count - 1


def test_mixed_step_recovers_only_the_rows_without_drafts(builder_blocks):
    # row 0 drafted again (spec path, which applies its own offset); rows 1, 2 and padding did not
    read, src, counts = _build_rows(builder_blocks, accepted=ACCEPTED + [1], masks=[True, False, False, False])
    assert read.values() == [21, 31, 0]
    assert src.values() == [21, 32, 0]
    assert counts.values() == [1, 2, 1]


def test_discarded_sample_counts_as_one_accepted_token(builder_blocks):
    # a partial prefill chunk's sample is discarded: the runner reports 0 accepted tokens
    _, src, counts = _build_rows(builder_blocks, accepted=[0, 1, 2, 1])
    assert src.values() == [11, 21, 32, 0]
    assert counts.values() == [1, 1, 2, 1]


def test_nothing_changes_without_spec_decode(builder_blocks):
    _, src, counts = _build_rows(builder_blocks, accepted=[1, 1, 1, 1], use_spec_decode=False)
    assert src is None and counts is None
    _, src, counts = _build_rows(builder_blocks, accepted=None)
    assert src is None and counts is None


def test_decode_only_batch_goes_through_the_persistent_buffers(builder_blocks):
    read, src, counts = _build_rows(builder_blocks, accepted=ACCEPTED + [1])
    self = types.SimpleNamespace(spec_decode_src_indices=Rows([-7] * 8), non_spec_num_accepted=Rows([-7] * 8))
    names = _run(
        builder_blocks[2],
        self=self,
        spec_decode_src_indices=src,
        non_spec_num_accepted=counts,
        num_decodes=3,
        batch_size=5,  # cudagraph-padded
        NULL_BLOCK_ID=NULL_BLOCK_ID,
    )
    assert names["spec_decode_src_indices"].values() == [13, 21, 32, 0, 0]
    assert names["non_spec_num_accepted"].values() == [3, 1, 2, 1, 1]
    # the metadata now holds views of the builder's buffers (stable addresses for replays)
    assert names["spec_decode_src_indices"].buf is self.spec_decode_src_indices.buf
    assert self.spec_decode_src_indices.values()[:5] == [13, 21, 32, 0, 0]


@pytest.mark.parametrize("method", ["_forward_core", "_forward_core_decode_non_spec"])
def test_layer_copies_the_accepted_ssm_state_into_the_block_the_kernels_read(patched, builder_blocks, method):
    blocks = _marked_blocks(patched[GDN_LAYER], f"GatedDeltaNetAttention.{method}")
    (pre_copy,) = ["".join(b) for b in blocks if b[0].startswith("spec_decode_src_indices =")]
    read, src, _ = _build_rows(builder_blocks, accepted=ACCEPTED + [1])
    # the SSM pool after the spec step: block b holds "state in b"
    pool = Rows([f"state in {b}" for b in range(40)])
    pristine_reads = [pool.values()[b] for b in read.values()]
    assert pristine_reads[:3] == ["state in 11", "state in 21", "state in 31"]  # stale for rows 0 and 2
    metadata = types.SimpleNamespace(spec_decode_src_indices=src)
    _run(pre_copy, attn_metadata=metadata, non_spec_state_indices_tensor=read, ssm_state=pool)
    assert [pool.values()[b] for b in read.values()][:3] == ["state in 13", "state in 21", "state in 32"]


@pytest.mark.parametrize("method", ["_forward_core", "_forward_core_decode_non_spec"])
def test_layer_conv_update_reads_the_accepted_window(patched, method):
    blocks = _marked_blocks(patched[GDN_LAYER], f"GatedDeltaNetAttention.{method}")
    (conv,) = [b[0] for b in blocks if "causal_conv1d_update(" in b[0]]
    seen = {}

    def causal_conv1d_update(*args, **kwargs):
        seen.update(kwargs)
        return "out"

    names = dict(
        causal_conv1d_update=causal_conv1d_update,
        attn_metadata=types.SimpleNamespace(non_spec_num_accepted="counts", num_actual_tokens=3),
        mixed_qkv="x", mixed_qkv_non_spec="x", conv_state="c", conv_weights="w", num_actual_tokens=3,
        non_spec_state_indices_tensor=[11, 21, 31],
        self=types.SimpleNamespace(conv1d=types.SimpleNamespace(bias=None), activation="silu"),
    )
    _run(conv, **names)
    assert seen["num_accepted_tokens"] == "counts"  # the kernel's IS_SPEC_DECODING offset path


class _Builder:
    supports_update_block_table = False

    def __init__(self):
        self.calls = []

    def build(self, **kwargs):
        self.calls.append(kwargs)
        return "metadata"


@pytest.mark.parametrize(("label", "expected"), [("patched", True), ("pristine", False)])
def test_runner_hands_the_counts_to_gdn_on_a_step_without_drafts(patched, sessions, label, expected):
    source = patched[RUNNER] if label == "patched" else sessions("v0.20.1").tree.read(RUNNER)
    code = extract(source, "GPUModelRunner._build_attention_metadata._build_attn_group_metadata")

    class GDNAttentionMetadataBuilder(_Builder):
        pass

    builder = GDNAttentionMetadataBuilder()
    group = types.SimpleNamespace(get_metadata_builder=lambda ubid: builder, layer_names=["gdn.0"])
    self = types.SimpleNamespace(
        attn_groups=[[group]],
        speculative_config=types.SimpleNamespace(method="ngram"),
        num_accepted_tokens=types.SimpleNamespace(gpu=[3, 1, 2, 1, 1, 1]),
    )
    attn_metadata: dict = {}
    names = _run(
        code,
        self=self,
        use_spec_decode=False,  # no request has drafts this step
        num_reqs_padded=4,
        kv_cache_groups=[types.SimpleNamespace(kv_cache_spec="mamba")],
        cascade_attn_prefix_lens=None,
        cached_attn_metadata={},
        for_cudagraph_capture=False,
        attn_metadata=attn_metadata,
        GDNAttentionMetadataBuilder=GDNAttentionMetadataBuilder,
        Mamba2AttentionMetadataBuilder=type("Mamba2AttentionMetadataBuilder", (_Builder,), {}),
        UniformTypeKVCacheSpecs=type("UniformTypeKVCacheSpecs", (), {}),
        CommonAttentionMetadata=object,
    )
    names["_build_attn_group_metadata"](0, 0, types.SimpleNamespace())
    (call,) = builder.calls
    assert ("num_accepted_tokens" in call) is expected
    if expected:
        assert call["num_accepted_tokens"] == [3, 1, 2, 1]
        assert "num_decode_draft_tokens_cpu" not in call  # stays on the builder's non-spec branch
    assert attn_metadata == {"gdn.0": "metadata"}


def test_verdict_on_0201_applies(catalogue, sessions):
    session = sessions("v0.20.1")
    outcome = isolated_run(catalogue, session, BuildTarget(session.tree.vllm_version), "P60").outcomes["P60"]
    assert outcome.verdict is Verdict.APPLIES
    assert set(outcome.files) == {GDN_ATTN, GDN_LAYER, RUNNER}


def test_verdict_on_0330_is_upstream_in_another_shape(catalogue, sessions):
    session = sessions("v0.33.0")
    outcome = isolated_run(catalogue, session, BuildTarget(Version("0.33.0")), "P60").outcomes["P60"]
    assert outcome.verdict is Verdict.UPSTREAM, outcome.detail
    assert RUNNER in outcome.detail and GDN_ATTN in outcome.detail


def test_upstream_shape_is_not_found_in_0201(catalogue, sessions):
    session = sessions("v0.20.1")
    assert catalogue.get("P60").upstream_fix(session.module) is None
