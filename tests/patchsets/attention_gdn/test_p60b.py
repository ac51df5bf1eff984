"""P60b on real 0.20.1 source: the prefill conv kernel reads a decode row's window at its offset.

Behaviour test: the patched ``_causal_conv1d_fwd_kernel`` and ``causal_conv1d_fn`` are
extracted from the patched file and run with Triton's interpreter on CPU
(``TRITON_INTERPRET=1``) with the CPU torch and triton 3.6 of the test extras. The
launcher/kernel argument alignment is also checked on the source alone.
"""

from __future__ import annotations

import builtins
import os
import types

import libcst as cst
import libcst.matchers as m
import pytest
from packaging.version import Version

from kiln import paths
from kiln.patch.anchor import resolve
from kiln.patch.catalog import load_catalogue
from kiln.patch.engine import Session, State, evaluate, isolated_run
from kiln.patch.model import BuildTarget, Outcome, Verdict
from tests.patchsets.support.patchlib import extract, patched_files
from tests.support.vllm_modules import in_child

CONV = "model_executor/layers/mamba/ops/causal_conv1d.py"
GDN_LAYER = "model_executor/layers/mamba/gdn_linear_attn.py"


@pytest.fixture(scope="module")
def patched(catalogue, sessions):
    return patched_files(catalogue, sessions("v0.20.1"), "P60b")


def test_verdict_on_0201_applies(catalogue, sessions):
    session = sessions("v0.20.1")
    outcome = isolated_run(catalogue, session, BuildTarget(session.tree.vllm_version), "P60b").outcomes["P60b"]
    assert outcome.verdict is Verdict.APPLIES
    assert set(outcome.files) == {CONV, GDN_LAYER}


def test_verdict_on_0330_follows_p60_upstream(catalogue, sessions):
    session = sessions("v0.33.0")
    outcomes = isolated_run(catalogue, session, BuildTarget(Version("0.33.0")), "P60b").outcomes
    assert outcomes["P60"].verdict is Verdict.UPSTREAM
    assert outcomes["P60b"].verdict is Verdict.GATED
    assert "requires P60" in outcomes["P60b"].detail


def test_on_its_own_0330_lacks_the_layer_file_and_the_kernel_parameters(catalogue, sessions):
    session = sessions("v0.33.0")
    patch = catalogue.get("P60b")
    pretend = {"P60": Outcome("P60", Verdict.APPLIES)}
    outcome = evaluate(patch, State(session), BuildTarget(Version("0.33.0")), pretend)
    assert outcome.verdict is Verdict.TARGET_GONE
    assert GDN_LAYER in outcome.detail
    conv = session.module(CONV)
    missing = {}
    for edit in patch.edits:
        if edit.target == CONV:
            found = resolve(conv, edit.anchor)
            if found.unique is None:
                missing[edit.__name__] = found.explain()
    assert "Param num_computed_tokens" in missing["KernelTakesAcceptedCounts"]
    assert "Param IS_APC_ENABLED" in missing["KernelKnowsSpecDecoding"]
    assert "Param num_computed_tokens" in missing["LauncherTakesAcceptedCounts"]
    assert "LauncherPassesAcceptedCounts" in missing


def test_launch_passes_the_counts_where_the_kernel_expects_them(patched):
    module = cst.parse_module(patched[CONV])
    kernel = next(n for n in module.body if m.matches(n, m.FunctionDef(name=m.Name("_causal_conv1d_fwd_kernel"))))
    names = [p.name.value for p in kernel.params.params]
    (launch,) = m.findall(
        module, m.Call(func=m.Subscript(value=m.Name("_causal_conv1d_fwd_kernel")))
    )
    positional = [a for a in launch.args if a.keyword is None]
    keywords = {a.keyword.value: module.code_for_node(a.value) for a in launch.args if a.keyword is not None}
    at = names.index("num_accepted_tokens_ptr")
    assert module.code_for_node(positional[at].value) == "num_accepted_tokens"
    assert len(positional) == names.index("HAS_BIAS")  # every non-meta parameter is still passed once
    assert keywords["IS_SPEC_DECODING"] == "num_accepted_tokens is not None"
    assert "IS_SPEC_DECODING" in names


# --- Triton interpreter -----------------------------------------------------------------------


def _launcher(text: str):
    """``causal_conv1d_fn`` from ``text``, bound to its kernel compiled for the interpreter."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    import numpy as np
    import torch
    import triton
    import triton.language as tl

    def interpreted_range(*args):  # interpreter scalars do not __index__ (pristine kernel too)
        values = (int(np.asarray(a.handle.data).reshape(-1)[0]) if hasattr(a, "handle") else a for a in args)
        return builtins.range(*values)

    namespace = {"tl": tl, "triton": triton, "torch": torch, "np": np, "PAD_SLOT_ID": -1, "NULL_BLOCK_ID": 0}
    namespace["range"] = interpreted_range
    source = extract(text, "_causal_conv1d_fwd_kernel") + "\n" + extract(text, "causal_conv1d_fn")
    exec(compile(source, "causal_conv1d", "exec"), namespace)
    kernel = namespace["_causal_conv1d_fwd_kernel"]

    class Launch:  # the interpreter lets grid() rebind entries of the launch args; give it a copy
        def __getitem__(self, grid):
            return kernel[lambda meta: grid(dict(meta))]

    namespace["_causal_conv1d_fwd_kernel"] = Launch()
    return namespace["causal_conv1d_fn"], torch


def _programs(torch, seqlens, block_m=8):
    """What ``compute_causal_conv1d_metadata`` hands the launcher: one program per BLOCK_M chunk."""
    seqs, chunks = [], []
    for i, n in enumerate(seqlens):
        for k in range(-(-n // block_m)):
            seqs.append(i)
            chunks.append(k)
    batch_ptr = torch.tensor(seqs, dtype=torch.int32)
    offsets = torch.tensor(chunks, dtype=torch.int32)
    entry = {"tot": len(seqs), "mlist": None, "mlist_len": len(seqs), "offsetlist": None}
    entry.update(batch_ptr=batch_ptr, token_chunk_offset_ptr=offsets)
    return types.SimpleNamespace(nums_dict={block_m: entry}, batch_ptr=batch_ptr, token_chunk_offset_ptr=offsets)


@in_child
def test_interpreted_kernel_reads_and_normalises_the_accepted_window(trees):
    """In a fresh interpreter: Triton reads TRITON_INTERPRET when it decorates a kernel, and a test
    file before this one in the same process may have imported Triton's compiled path (seen under
    pytest-xdist: "Cannot call @triton.jit'd outside of the scope of a kernel")."""
    os.environ["TRITON_INTERPRET"] = "1"
    session = Session(trees("v0.20.1"))
    patched = patched_files(load_catalogue(paths.PATCHSETS), session, "P60b")
    causal_conv1d_fn, torch = _launcher(patched[CONV])
    pristine_fn, _ = _launcher(session.tree.read(CONV))
    torch.manual_seed(0)
    dim, width, num_spec = 4, 4, 2
    state_len = width - 1
    conv_states = torch.randn(4, dim, state_len + num_spec)  # spec decode keeps num_spec extra tokens
    weight, bias = torch.randn(dim, width), torch.randn(dim)
    # a mixed step: row 0 is a fresh 5-token prompt, rows 1 and 2 are decodes run as 1-token
    # prefills; after the last spec step row 1 accepted 3 tokens, row 2 accepted 1
    seqlens, accepted, lines = [5, 1, 1], [1, 3, 1], [1, 2, 3]
    x = torch.randn(sum(seqlens), dim)
    kwargs = dict(
        query_start_loc=torch.tensor([0, 5, 6, 7], dtype=torch.int32),
        cache_indices=torch.tensor(lines, dtype=torch.int32),
        has_initial_state=torch.tensor([False, True, True]),
        activation="silu",
        metadata=_programs(torch, seqlens),
    )

    def run(fn, **extra):
        states = conv_states.clone()
        out = fn(x.t(), weight, bias, conv_states=states, **kwargs, **extra)
        return out.t(), states

    def expected(row, token, count):
        window = conv_states[lines[row], :, count - 1 : count - 1 + state_len]
        full = torch.cat([window, x[token : token + 1].t()], dim=1)
        return torch.nn.functional.silu((full * weight).sum(1) + bias), full[:, 1:]

    out, states = run(causal_conv1d_fn, num_accepted_tokens=torch.tensor(accepted, dtype=torch.int32))
    for row, token in ((1, 5), (2, 6)):
        y, window = expected(row, token, accepted[row])
        torch.testing.assert_close(out[token], y)
        torch.testing.assert_close(states[lines[row], :, :state_len], window)  # written back from token 0

    pristine_out, pristine_states = run(pristine_fn)
    y, _ = expected(1, 5, accepted[1])
    assert not torch.allclose(pristine_out[5], y)  # pristine convolves the stale window
    # rows with one accepted token, the fresh prompt and the untouched tail match the pristine kernel
    torch.testing.assert_close(out[:5], pristine_out[:5])
    torch.testing.assert_close(out[6], pristine_out[6])
    torch.testing.assert_close(states[[1, 3]], pristine_states[[1, 3]])
    # without counts the patched kernel is the pristine one (IS_SPEC_DECODING is False)
    plain_out, plain_states = run(causal_conv1d_fn)
    torch.testing.assert_close(plain_out, pristine_out)
    torch.testing.assert_close(plain_states, pristine_states)
