"""PN378 on real 0.20.1 and 0.33.0 source: an all-NaN row no longer yields an out-of-vocabulary token.

What runs, under Triton's interpreter (``TRITON_INTERPRET=1``, CPU torch) in a fresh process:
- the whole ``v1/sample/rejection_sampler.py`` of 0.20.1, pristine and patched by PN378, imported
  with stand-ins for the vLLM modules it imports (the names ``rejection_sample`` and
  ``parse_output`` never call: sampler, logits processors, output classes; ``vllm.triton_utils``
  is the real ``triton``/``tl``). Its real ``rejection_sample`` (greedy and random kernels,
  ``sample_recovered_tokens`` with its 8192-lane tiles, the uniform draws) runs a step of
  random-sampling requests with MTP-style drafts (no draft probabilities, as the V1 runner
  passes), one of them with all-NaN target logits, and its real ``RejectionSampler.parse_output``
  turns the step into the token lists the scheduler receives;
- ``sample_recovered_tokens_kernel`` launched directly with small tiles, pristine, patched, and
  vLLM 0.33.0's own (upstream's fix, vllm#44744), on all-NaN, healthy and zero-tail rows.

Why a second reduction mode: the interpreter evaluates ``tl.max(..., return_indices=True)`` with
``np.max``/``np.argmax``, which treat NaN as the largest value, so on an all-NaN row it picks a
real lane and hides the failure. Compiled kernels evaluate Triton's argmax combine function
(``_argmax_combine_tie_break_left``: keep the left value when ``left > right`` or on a tie to the
left index), under which a NaN accumulator gives way to the next value. ``combine`` mode makes
the interpreter reduce with that same function (its own generic path, a left fold); the test
checks first that the two modes differ exactly there. Every expectation is asserted in the mode
it holds for; healthy rows agree in both.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tests.patchsets.support.interpreted_child import load_module, run_child
from tests.patchsets.support.patchlib import (
    assert_applies_once,
    assert_upstream,
    extract,
    patched_files,
)

TARGET = "v1/sample/rejection_sampler.py"
KERNEL = "sample_recovered_tokens_kernel"
VOCAB = 100  # one 8192-lane tile of the real wrapper, mostly padding, like the last tile of any vocab
DRAFTS = 1  # per request; the recovered-token kernel runs one program per draft position
KERNEL_HEADER = "import torch\nimport triton\nimport triton.language as tl\n\n\n"


# -- verdicts ------------------------------------------------------------------------------------


def test_verdicts(catalogue, sessions):
    old = sessions("v0.20.1")
    assert_applies_once(catalogue, old, "PN378")

    new = sessions("v0.33.0")
    detail = assert_upstream(catalogue, new, "PN378")
    assert f"{TARGET}:1143" in detail and f"{TARGET}:1150" in detail


# -- the interpreter run -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def results(catalogue, sessions, tmp_path_factory):
    where = tmp_path_factory.mktemp("pn378")
    old, new = sessions("v0.20.1"), sessions("v0.33.0")
    files = {
        "pristine": old.tree.read(TARGET),
        "patched": patched_files(catalogue, old, "PN378")[TARGET],
        "upstream": KERNEL_HEADER + extract(new.tree.read(TARGET), KERNEL),
    }
    for name, text in files.items():
        (where / f"{name}.py").write_text(text)  # real files: Triton reads kernel source through inspect
    return run_child(__name__, where, timeout=900)


def test_combine_mode_is_what_differs_on_nan(results):
    """[nan, nan, nan, 0, 0, 0, 0, 0]: numpy's argmax picks lane 0, Triton's combine lane 3."""
    assert results["probe"] == {"interpreter": 0, "combine": 3}


def test_pristine_step_loses_the_nan_requests_token(results):
    pristine = results["step"]["combine"]["pristine"]
    assert pristine["recovered"][DRAFTS] == VOCAB  # the NaN request's first position: out of vocabulary
    assert pristine["output"][1][0] == VOCAB  # its draft rejected, that id is the step's first token
    assert pristine["parsed"][1] == []  # parse_output drops it: an empty step for a request with drafts


def test_patched_step_commits_a_token_for_every_request(results):
    pristine, patched = results["step"]["combine"]["pristine"], results["step"]["combine"]["patched"]
    assert patched["recovered"][DRAFTS] == 0  # the kernel's initial id, what vLLM's other samplers give
    assert patched["parsed"][1] == [0]
    assert all(row for row in patched["parsed"])
    # the healthy requests are untouched: same recovered ids, same tokens
    for request in (0, 2):
        assert patched["parsed"][request] == pristine["parsed"][request]
        rows = slice(request * DRAFTS, (request + 1) * DRAFTS)
        assert patched["recovered"][rows] == pristine["recovered"][rows]


def test_interpreter_mode_hides_it_and_the_patch_changes_nothing_there(results):
    step = results["step"]["interpreter"]
    assert step["pristine"]["parsed"] == step["patched"]["parsed"]
    assert step["pristine"]["recovered"] == step["patched"]["recovered"]
    assert all(0 <= t < VOCAB for row in step["patched"]["parsed"] for t in row)


@pytest.mark.parametrize("mode", ["interpreter", "combine"])
def test_kernel_matches_upstreams_fix(results, mode):
    """Patched 0.20.1 kernel == 0.33.0's kernel (vllm#44744) on every row, in range on every row."""
    cases = results["kernel"][mode]
    assert len(cases) >= 6
    for case in cases:
        vocab = case["vocab"]
        assert case["patched"] == case["upstream"], case
        assert all(0 <= t < vocab for t in case["patched"]), case
        if case["rows"] == "healthy":
            assert case["pristine"] == case["patched"], case
        if case["rows"] == "nan" and not case["draft_probs"]:
            assert case["patched"] == [0] * len(case["patched"]), case


def test_pristine_kernel_returns_vocab_size_on_nan_rows(results):
    nan_cases = [c for c in results["kernel"]["combine"] if c["rows"] == "nan" and not c["draft_probs"]]
    assert len(nan_cases) >= 2
    for case in nan_cases:
        assert case["pristine"] == [case["vocab"]] * len(case["pristine"]), case


# -- the child process ----------------------------------------------------------------------------


def _set_mode(mode: str) -> None:
    """``combine``: the interpreter reduces argmax with Triton's combine function, as compiled code."""
    import triton.language as tl
    from triton.runtime import interpreter

    ops = interpreter.ReduceOps
    if not hasattr(ops, "_pn378_numpy"):
        ops._pn378_numpy = ops.apply_impl

    def apply_impl(self, input):
        if mode == "combine" and self.combine_fn == tl.standard._argmax_combine_tie_break_left:
            return self.generic_reduce(input)
        return ops._pn378_numpy(self, input)

    ops.apply_impl = apply_impl


def _probe() -> int:
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def argmax_kernel(x_ptr, out_ptr, N: tl.constexpr):
        value, index = tl.max(tl.load(x_ptr + tl.arange(0, N)), axis=0, return_indices=True)
        tl.store(out_ptr, index)

    nan = float("nan")
    out = torch.zeros(1, dtype=torch.int32)
    argmax_kernel[(1,)](torch.tensor([nan, nan, nan, 0, 0, 0, 0, 0]), out, N=8)
    return int(out[0])


def _step(module, torch) -> dict:
    """One spec-decode step of three random-sampling requests; the second one's logits are NaN."""
    import types

    gen = torch.Generator().manual_seed(7)
    batch = 3
    logits = torch.randn(batch * DRAFTS, VOCAB, generator=gen) * 3
    logits[DRAFTS : 2 * DRAFTS] = float("nan")
    drafts = torch.randint(0, VOCAB, (batch * DRAFTS,), generator=gen, dtype=torch.int32)
    drafts[0] = int(logits[0].argmax())  # a likely draft, so the step also accepts something
    bonus = torch.randint(0, VOCAB, (batch, 1), generator=gen, dtype=torch.int32)
    metadata = types.SimpleNamespace(
        all_greedy=False, all_random=True, generators={}, temperature=torch.ones(batch)
    )
    cu = torch.arange(1, batch + 1, dtype=torch.int32) * DRAFTS
    captured = {}
    real = module.sample_recovered_tokens

    def capture(*args, **kwargs):
        captured["ids"] = real(*args, **kwargs)
        return captured["ids"]

    module.sample_recovered_tokens = capture
    torch.manual_seed(11)  # the same uniform and exponential draws for every module
    try:
        output = module.rejection_sample(
            drafts, [DRAFTS] * batch, DRAFTS, cu, None, logits.clone(), bonus, metadata
        )
    finally:
        module.sample_recovered_tokens = real
    parsed, _ = module.RejectionSampler.parse_output(output, VOCAB)
    return {"recovered": captured["ids"].tolist(), "output": output.tolist(), "parsed": parsed}


def _kernel_cases(torch) -> list[dict]:
    cases = []
    for vocab, block, draft_probs, rows in [
        (40, 32, False, "nan"), (100, 32, False, "nan"), (100, 64, True, "nan"),
        (40, 32, False, "healthy"), (100, 32, True, "healthy"), (70, 64, False, "healthy"),
        (100, 32, False, "zero-tail"), (100, 32, True, "zero-tail"),
    ]:
        gen = torch.Generator().manual_seed(vocab + block)
        batch, spec = 2, 2
        target = torch.rand(batch * spec, vocab, generator=gen).softmax(-1)
        if rows == "nan":
            target[:] = float("nan")
        elif rows == "zero-tail":  # every real lane of the last tile scores 0 (vllm#44744's case)
            target[:, (vocab // block) * block :] = 0
        draft = torch.rand(batch * spec, vocab, generator=gen).softmax(-1) if draft_probs else None
        cases.append(dict(vocab=vocab, block=block, draft_probs=draft_probs, rows=rows, target=target,
                          draft=draft, inv_q=torch.empty(batch, vocab).exponential_(generator=gen).reciprocal(),
                          drafts=torch.randint(0, vocab, (batch * spec,), generator=gen, dtype=torch.int32),
                          cu=torch.tensor([spec, 2 * spec], dtype=torch.int32), spec=spec, batch=batch))
    return cases


def _launch(kernel, case: dict, torch, upstream: bool) -> list[int]:
    out = torch.full((case["batch"] * case["spec"],), -7, dtype=torch.int32)
    extra = {"USE_FP64_GUMBEL": False} if upstream else {}
    kernel[(case["batch"], case["spec"])](
        out, case["cu"], case["drafts"], case["draft"], case["target"], case["inv_q"], case["vocab"],
        case["block"], NO_DRAFT_PROBS=case["draft"] is None, **extra,
    )
    return out.tolist()


def child_main() -> None:
    """Entry of the interpreter subprocess: ``TRITON_INTERPRET=1`` is set in its environment."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    import torch

    where = Path(sys.argv[1])
    modules = {name: load_module(where / f"{name}.py", f"pn378_{name}") for name in ("pristine", "patched")}
    upstream = load_module(where / "upstream.py", "pn378_upstream")
    results = {"probe": {}, "step": {}, "kernel": {}}
    for mode in ("interpreter", "combine"):
        _set_mode(mode)
        results["probe"][mode] = _probe()
        results["step"][mode] = {name: _step(module, torch) for name, module in modules.items()}
        results["kernel"][mode] = [
            {
                "vocab": case["vocab"], "rows": case["rows"], "draft_probs": case["draft_probs"],
                "pristine": _launch(modules["pristine"].sample_recovered_tokens_kernel, case, torch, False),
                "patched": _launch(modules["patched"].sample_recovered_tokens_kernel, case, torch, False),
                "upstream": _launch(upstream.sample_recovered_tokens_kernel, case, torch, True),
            }
            for case in _kernel_cases(torch)
        ]
    print(json.dumps(results))
