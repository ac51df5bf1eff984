"""PN390 on real 0.20.1 source: the same tokens as stock, without the num_tokens x vocab softmax.

What runs, under Triton's interpreter (``TRITON_INTERPRET=1``, CPU torch) in a fresh process:
the whole ``v1/sample/rejection_sampler.py`` of 0.20.1 four times, pristine, patched by PN390,
patched by PN378, and patched by both in catalogue order (PN378, then PN390), each imported with
stand-ins for the vLLM modules it imports (the names ``rejection_sample`` never calls: sampler,
logits processors, output classes; ``vllm.triton_utils`` is the real ``triton``/``tl``). Its
real ``rejection_sample`` (the greedy and random kernels, ``sample_recovered_tokens`` with its
8192-lane tiles and its exponential draws, the uniform draws, and PN390's logsumexp kernel)
runs one spec-decode step per case of a grid, with the same seeds for every module:
- batch sizes 1-8, draft lengths 1-5 (uneven per request, one request without drafts), vocabularies
  of 100, 1000, 8193, 20000 and Qwen3.6's 248320 (non-powers of two, one or many tiles);
- temperatures 0 (greedy rows in a mixed batch), 0.3-1.5, rows masked to -inf outside their
  top 20 (what top-k leaves), a seeded per-request generator;
- with draft probabilities (the acceptance ratio p/q, recovery from max(p - q, 0)) and without
  (MTP and n-gram on the V1 runner: the draft token is excluded from recovery).
The token ids every request gets (accepted drafts, the recovered token, the bonus token) and the
recovered ids of every position must be those of stock; PN378 with PN390 must give PN378's.
An allocation probe (``TorchDispatchMode``) records every float32 tensor of shape
``(num_tokens, vocab)`` an aten op creates inside ``rejection_sample``: the softmax on stock, none
once patched.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from kiln.patch.engine import isolated_run, run_selection
from kiln.patch.model import BuildTarget, Verdict
from tests.patchsets.support.interpreted_child import load_module, run_child
from tests.patchsets.support.patchlib import assert_applies_once, patched_files

TARGET = "v1/sample/rejection_sampler.py"
MODULES = ("pristine", "pn390", "pn378", "both")

# (name, batch, drafts per request, vocab, temperatures per request, draft probs, top-k rows)
CASES = [
    ("one-request", 1, [3], 100, [1.0], False, False),
    ("k1-batch3", 3, [1, 1, 1], 1000, [0.7, 1.0, 1.5], False, False),
    ("uneven-mixed-greedy", 4, [3, 0, 2, 3], 8193, [0.0, 1.0, 0.6, 0.0], False, True),
    ("draft-probs", 3, [2, 3, 1], 1000, [1.0, 0.8, 1.2], True, False),
    ("draft-probs-topk", 5, [5, 4, 5, 1, 3], 8193, [0.3, 1.0, 0.0, 1.5, 0.9], True, True),
    ("two-tiles-k5", 8, [5] * 8, 20000, [1.0, 0.5, 0.0, 1.2, 0.8, 1.0, 0.3, 1.5], False, True),
    ("two-tiles-draft-probs", 6, [3, 3, 2, 3, 1, 3], 20000, [1.0] * 6, True, False),
    ("qwen-vocab-k5", 4, [5] * 4, 248320, [0.6, 1.0, 0.7, 1.0], False, False),
    ("qwen-vocab-k3-draft-probs", 4, [3] * 4, 248320, [1.0, 0.6, 1.0, 0.8], True, True),
]
SEEDED = {"draft-probs", "two-tiles-k5"}  # request 1 samples with its own torch.Generator
NAN_ROW = {"k1-batch3", "draft-probs"}  # request 0's logits all NaN: PN378 with PN390 == PN378


# -- verdicts and composition ---------------------------------------------------------------------


def test_verdicts(catalogue, sessions):
    old = sessions("v0.20.1")
    assert_applies_once(catalogue, old, "PN390")

    new = sessions("v0.33.0")
    outcome = isolated_run(catalogue, new, BuildTarget(new.tree.vllm_version), "PN390").outcomes["PN390"]
    assert outcome.verdict is Verdict.OUT_OF_RANGE, outcome.detail


def _both(catalogue, session) -> str:
    target = BuildTarget(session.tree.vllm_version)
    result = run_selection(catalogue, session, target, ["PN378", "PN390"])
    assert {pid: o.verdict for pid, o in result.outcomes.items()} == {"PN378": Verdict.APPLIES, "PN390": Verdict.APPLIES}
    return result.changed_text()[TARGET]


def test_composes_with_pn378_in_either_order(catalogue, sessions):
    """PN390 on top of PN378 and PN378 on top of PN390 give the same file as the selection."""
    old = sessions("v0.20.1")
    target = BuildTarget(old.tree.vllm_version)
    texts = []
    for first_id, second_id in (("PN378", "PN390"), ("PN390", "PN378")):
        first = isolated_run(catalogue, old, target, first_id)
        second = isolated_run(catalogue, old.overlay(first.state.changed), target, second_id)
        assert second.outcomes[second_id].verdict is Verdict.APPLIES, second.outcomes[second_id].detail
        texts.append(second.changed_text()[TARGET])
    assert texts[0] == texts[1] == _both(catalogue, old)
    assert "score = tl.where(vocab_mask, score" in texts[0] and "target_lse_kernel" in texts[0]


# -- the interpreter run -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def results(catalogue, sessions, tmp_path_factory):
    where = tmp_path_factory.mktemp("pn390")
    old = sessions("v0.20.1")
    files = {
        "pristine": old.tree.read(TARGET),
        "pn390": patched_files(catalogue, old, "PN390")[TARGET],
        "pn378": patched_files(catalogue, old, "PN378")[TARGET],
        "both": _both(catalogue, old),
    }
    for name, text in files.items():
        (where / f"{name}.py").write_text(text)  # real files: Triton reads kernel source through inspect
    return run_child(__name__, where, timeout=1500)


def test_every_case_ran(results):
    assert sorted(results["steps"]) == sorted(c[0] for c in CASES)


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_same_tokens_as_stock(results, case):
    step = results["steps"][case]
    pristine, patched = step["pristine"], step["pn390"]
    assert patched["output"] == pristine["output"]  # accepted, recovered and bonus tokens, per position
    assert patched["recovered"] == pristine["recovered"]
    if case not in NAN_ROW:
        assert step["pn378"] == pristine  # PN378 changes nothing on rows without NaN
    assert step["both"] == step["pn378"]


def test_the_grid_exercises_acceptance_rejection_and_bonus(results):
    """Each kind of outcome occurs, so equality above is not vacuous."""
    accepted = rejected = bonus = 0
    for case in CASES:
        name, drafts = case[0], case[2]
        output = results["steps"][name]["pristine"]["output"]
        for row, n in zip(output, drafts, strict=True):
            produced = [t for t in row if t != -1]
            if len(produced) == n + 1:
                bonus += 1
                accepted += n
            else:
                rejected += 1
                accepted += len(produced) - 1
    assert accepted >= 20 and rejected >= 10 and bonus >= 5, (accepted, rejected, bonus)


def test_logsumexp_matches_float64(results):
    """The probabilities the kernels form are within fp32 rounding of float64's softmax, like stock's.

    exp(logit - lse) carries a few ulps of lse (|lse| <= 40 here, ulp 4e-6) into p; stock's fp32
    softmax has its own error of the same order (2.8e-5 on the 248320-token case, on CPU)."""
    for case, error in results["lse_error"].items():
        assert error["lse"] < 5e-6, case
        assert error["prob"] < 5e-6, case
        assert error["prob"] <= 2 * error["softmax"] + 1e-6, case


def test_no_vocab_wide_fp32_tensor_once_patched(results):
    probe = results["probe"]
    assert probe["pristine"], "the probe sees stock's softmax"
    assert any("softmax" in op for op, _, _ in probe["pristine"])
    assert probe["pn390"] == []
    assert probe["both"] == []


# -- the child process ----------------------------------------------------------------------------


def _inputs(case, torch) -> dict:
    name, batch, drafts, vocab, temperatures, with_draft_probs, topk = case
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    num_tokens = sum(drafts)
    request_of = [r for r, n in enumerate(drafts) for _ in range(n)]
    logits = torch.randn(num_tokens, vocab, generator=gen) * 4
    for row, request in enumerate(request_of):
        if temperatures[request] > 0:  # what apply_sampling_constraints does before rejection_sample
            logits[row] /= temperatures[request]
    if topk:
        for row in range(0, num_tokens, 2):
            kept = logits[row].topk(20).indices
            masked = torch.full_like(logits[row], float("-inf"))
            masked[kept] = logits[row][kept]
            logits[row] = masked
    if name in NAN_ROW:
        logits[: drafts[0]] = float("nan")
    draft_probs = None
    if with_draft_probs:
        draft_probs = (logits.nan_to_num(0.0).clamp(min=-30) + torch.randn(num_tokens, vocab, generator=gen)).softmax(-1)
    # half the drafts are the target's most likely token (likely accepted), half are random
    likely = logits.nan_to_num(0.0).argmax(-1).to(torch.int32)
    random_ids = torch.randint(0, vocab, (num_tokens,), generator=gen, dtype=torch.int32)
    pick = torch.rand(num_tokens, generator=gen) < 0.6
    draft_ids = torch.where(pick, likely, random_ids).contiguous()
    cu = torch.tensor(drafts, dtype=torch.int32).cumsum(0).to(torch.int32)
    bonus = torch.randint(0, vocab, (batch, 1), generator=gen, dtype=torch.int32)
    return dict(logits=logits, draft_probs=draft_probs, draft_ids=draft_ids, cu=cu, bonus=bonus,
                drafts=drafts, temperature=torch.tensor(temperatures, dtype=torch.float32))


def _metadata(case, inputs, torch):
    import types

    temperature = inputs["temperature"]
    generators = {}
    if case[0] in SEEDED:
        generators = {1: torch.Generator().manual_seed(1234)}
    return types.SimpleNamespace(
        all_greedy=bool((temperature == 0).all()), all_random=bool((temperature > 0).all()),
        generators=generators, temperature=temperature,
    )


def _step(module, case, inputs, torch) -> dict:
    captured = {}
    real = module.sample_recovered_tokens

    def capture(*args, **kwargs):
        captured["ids"] = real(*args, **kwargs)
        return captured["ids"]

    module.sample_recovered_tokens = capture
    torch.manual_seed(11)  # the same uniform and exponential draws for every module
    try:
        output = module.rejection_sample(
            inputs["draft_ids"], inputs["drafts"], max(inputs["drafts"]), inputs["cu"],
            inputs["draft_probs"], inputs["logits"].clone(), inputs["bonus"], _metadata(case, inputs, torch),
        )
    finally:
        module.sample_recovered_tokens = real
    return {"output": output.tolist(), "recovered": captured["ids"].tolist()}


def _probe(module, torch) -> list:
    """Every float32 (num_tokens, vocab) tensor an aten op creates during one step."""
    from torch.utils._python_dispatch import TorchDispatchMode

    case = ("probe", 4, [3, 3, 3, 3], 1000, [1.0, 0.7, 1.0, 1.3], False, False)
    inputs = _inputs(case, torch)
    shape = list(inputs["logits"].shape)
    seen = []

    class Allocations(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = str(func)
            creates = not func.is_view and not name.split(".")[1].endswith("_") and "out" not in (kwargs or {})
            for tensor in out if isinstance(out, (tuple, list)) else [out]:
                if creates and isinstance(tensor, torch.Tensor) and list(tensor.shape) == shape \
                        and tensor.dtype == torch.float32:
                    seen.append([name, list(tensor.shape), str(tensor.dtype)])
            return out

    logits = inputs["logits"].clone()
    metadata = _metadata(case, inputs, torch)
    torch.manual_seed(11)
    with Allocations():
        module.rejection_sample(inputs["draft_ids"], inputs["drafts"], 3, inputs["cu"], None, logits,
                                inputs["bonus"], metadata)
    return seen


def _lse_error(module, case, torch) -> dict:
    """Errors against float64 (the reference): the kernel's lse and exp(logit - lse), torch's fp32 softmax."""
    logits = _inputs(case, torch)["logits"]
    finite = ~logits.isnan().any(-1)
    logits = logits[finite].contiguous()
    lse = module.compute_target_lse(logits)
    reference = logits.double().softmax(-1)
    return {
        "lse": float((lse.double() - torch.logsumexp(logits.double(), -1)).abs().max()),
        "prob": float(((logits - lse[:, None]).exp().double() - reference).abs().max()),
        "softmax": float((logits.softmax(-1).double() - reference).abs().max()),
    }


def child_main() -> None:
    """Entry of the interpreter subprocess: ``TRITON_INTERPRET=1`` is set in its environment."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    import torch

    where = Path(sys.argv[1])
    modules = {name: load_module(where / f"{name}.py", f"pn390_{name}") for name in MODULES}
    results = {"steps": {}, "lse_error": {}, "probe": {}}
    for case in CASES:
        inputs = _inputs(case, torch)
        results["steps"][case[0]] = {name: _step(module, case, inputs, torch) for name, module in modules.items()}
        results["lse_error"][case[0]] = _lse_error(modules["pn390"], case, torch)
    results["probe"] = {name: _probe(modules[name], torch) for name in ("pristine", "pn390", "both")}
    print(json.dumps(results))
