"""P67 on real 0.20.1 and 0.33.0 source: a new spec-verify kernel file, tried before P67b's launch.

What runs:
- Dispatch: ``forward``/``_is_uniform_spec_verify``/``_spec_verify_attention`` extracted from
  the backend patched by P67b + P67, on ``meta`` tensors (no host read possible) with
  recording launchers: supported shapes call the new kernel, unsupported ones (head dim 96,
  more than 64 query rows per KV head) fall through to P67b's decode launch.
- Numerics under Triton's interpreter, in a fresh process (``tests/patchsets/support/tq_numerics.py``):
  the real upstream store kernel fills the cache (turboquant_k8v4 / turboquant_4bit_nc, real
  centroids), the patched ``forward`` runs the *new* kernel file as P67 writes it into the
  tree (both its kernels, interpreted), and the output is compared with a float64 PyTorch
  decoder of the cache bytes doing causal attention, for GQA groups 4 (power of two) and 3, 6
  (not), with a FULL-graph padding request (seq_len 0) in the batch; on 0.33.0 through the
  transposed cache view that pin's ``forward`` builds.
"""

from __future__ import annotations

import types

import libcst as cst
import pytest
import torch
from packaging.version import Version

from kiln.patch.engine import isolated_run
from kiln.patch.model import BuildTarget, Verdict
from tests.patchsets.support import tq_interpret as tq
from tests.patchsets.support.patchlib import patched_files

BACKEND = "v1/attention/backends/turboquant_attn.py"
KERNEL = "v1/attention/ops/triton_turboquant_spec_verify.py"
LABELS = ["v0.20.1", "v0.33.0"]


@pytest.mark.parametrize("label", LABELS)
def test_verdict_applies_with_p67b_and_adds_the_kernel_file(catalogue, sessions, label):
    session = sessions(label)
    result = isolated_run(catalogue, session, BuildTarget(session.tree.vllm_version), "P67")
    assert {pid: o.verdict for pid, o in result.outcomes.items()} == {"P67b": Verdict.APPLIES, "P67": Verdict.APPLIES}
    files = result.outcomes["P67"].files
    assert set(files) == {BACKEND, KERNEL}
    assert files[KERNEL][0] is None and not session.tree.exists(KERNEL)


def test_a_foreign_file_at_the_kernel_path_is_drift(catalogue, sessions):
    session = sessions("v0.20.1")
    foreign = session.overlay({KERNEL: cst.parse_module("def something_else():\n    pass\n")})
    outcome = isolated_run(catalogue, foreign, BuildTarget(Version("0.20.1")), "P67").outcomes["P67"]
    assert outcome.verdict is Verdict.DRIFTED
    assert f"{KERNEL} already exists and is not this patch's file" in outcome.detail


class Recorder:
    def __init__(self, name, calls):
        self.name, self.calls = name, calls

    def __call__(self, *args, **kwargs):
        self.calls.append(self.name)
        query = kwargs.get("query", args[0] if args else None)
        return torch.empty_like(query)


def _support_check(kernel_text: str):
    """``spec_verify_kernel_supports`` of the kernel file with its constants (host-side Python)."""
    module = cst.parse_module(kernel_text)
    keep = [
        stmt
        for stmt in module.body
        if (isinstance(stmt, cst.SimpleStatementLine) and isinstance(stmt.body[0], cst.Assign))
        or (isinstance(stmt, cst.FunctionDef) and stmt.name.value == "spec_verify_kernel_supports")
    ]
    namespace: dict = {}
    exec(compile("\n".join(module.code_for_node(s) for s in keep), "spec_verify", "exec"), namespace)
    return namespace["spec_verify_kernel_supports"]


def _dispatch(changed, head_dim, q_len, num_heads, num_kv_heads):
    calls: list[str] = []
    namespace = {
        "spec_verify_kernel_supports": _support_check(changed[KERNEL]),
        "triton_turboquant_spec_verify_attention": Recorder("p67", calls),
        "triton_turboquant_decode_attention": Recorder("p67b", calls),
    }
    layout = tq.TQLayout("turboquant_4bit_nc", head_dim)
    impl = tq.make_impl(tq.impl_class(changed[BACKEND], namespace), layout, num_heads, num_kv_heads, splits=4)
    metadata = tq.verify_metadata([40, 33], torch.zeros(2, 4, dtype=torch.int32), q_len, device="meta")
    n = 2 * q_len
    query = torch.empty(n, num_heads * head_dim, dtype=torch.bfloat16, device="meta")
    kv = torch.empty(n, num_kv_heads * head_dim, dtype=torch.bfloat16, device="meta")
    cache = torch.empty(8, 16, num_kv_heads, 100, dtype=torch.uint8, device="meta")
    pi = torch.empty(head_dim, head_dim, device="meta")
    impl.forward(types.SimpleNamespace(_tq_Pi=pi, _tq_PiT=pi, _tq_centroids=None), query, kv, kv, cache, metadata)
    assert impl.paths == []
    return calls


@pytest.mark.parametrize("label", LABELS)
def test_supported_shapes_take_the_kernel_others_fall_through(catalogue, sessions, label):
    changed = patched_files(catalogue, sessions(label), "P67")
    assert _dispatch(changed, head_dim=128, q_len=4, num_heads=24, num_kv_heads=4) == ["p67"]  # group 6
    assert _dispatch(changed, head_dim=256, q_len=4, num_heads=16, num_kv_heads=1) == ["p67"]  # 64 rows
    assert _dispatch(changed, head_dim=96, q_len=4, num_heads=8, num_kv_heads=2) == ["p67b"]  # head dim
    assert _dispatch(changed, head_dim=128, q_len=16, num_heads=32, num_kv_heads=4) == ["p67b"]  # 128 rows


CASES = [
    ("v0.20.1", "turboquant_k8v4", 4),
    ("v0.20.1", "turboquant_4bit_nc", 4),
    ("v0.20.1", "turboquant_k8v4", 3),
    ("v0.20.1", "turboquant_4bit_nc", 6),
    ("v0.33.0", "turboquant_4bit_nc", 3),
    ("v0.33.0", "turboquant_k8v4", 6),
]


@pytest.fixture(scope="module")
def numerics(catalogue, sessions, tmp_path_factory):
    """Every case of this module in one interpreter subprocess (``tq_numerics``)."""
    where = tmp_path_factory.mktemp("p67")
    cases = []
    for label in LABELS:
        session = sessions(label)
        changed = patched_files(catalogue, session, "P67")
        root = tq.write_root(session.tree, changed, where / label)
        for lab, preset, group in CASES:
            if lab == label:
                cases.append(dict(id=f"{label}-{preset}-{group}", root=root, backend=changed[BACKEND],
                                  preset=preset, group=group, transposed=label == "v0.33.0"))
    return tq.interpret(cases, where)


@pytest.mark.parametrize(("label", "preset", "group"), CASES)
def test_kernel_matches_attention_over_the_dequantised_cache(numerics, label, preset, group):
    result = numerics[f"{label}-{preset}-{group}"]
    assert result["paths"] == []
    assert result["launched"] == {"spec_verify_kernel_supports": 1, "triton_turboquant_spec_verify_attention": 1}
    assert result["max_abs_ref"] > 0.05
    assert result["max_abs_err"] < 2e-3, result  # fp16 output rounding
