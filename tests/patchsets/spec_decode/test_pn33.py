"""PN33 on real 0.20.1 and 0.33.0 source: the profile's rejection sampler sees a real step's shapes.

Behaviour test by extraction (``gpu_model_runner.py`` imports the whole engine). What runs is
real vLLM code of each tree, on CPU torch:
- ``GPUModelRunner._dummy_sampler_run``, pristine and patched: the profile run's sampler
  warm-up, whose allocations are part of the peak the KV cache is sized from;
- ``GPUModelRunner._calc_spec_decode_metadata`` and ``_get_cumsum_and_arange``: how a real
  step lays out the logits the rejection sampler gets (one row per draft plus the bonus row);
- ``SpecDecodeMetadata`` (``v1/spec_decode/metadata.py``, executed whole) and the
  ``SamplingMetadata`` dataclass (``v1/sample/metadata.py``).
Stood in: the model's ``compute_logits`` (a linear map to a small vocabulary), the sampler and
the rejection sampler (they record what they are given and index the logits the way vLLM's
rejection sampler does: target rows, bonus rows), the speculative config (K, and on 0.33.0
the sampling methods that decide whether draft probabilities are profiled), the host-to-device
copy and the accelerator sync (no device on CPU), and ``LogitsProcessors``.
"""

from __future__ import annotations

import dataclasses
import types

import numpy as np
import pytest
import torch

from tests.patchsets.support.patchlib import extract, extract_all, patched_files

RUNNER = "v1/worker/gpu_model_runner.py"
SPEC_METADATA = "v1/spec_decode/metadata.py"
SAMPLING_METADATA = "v1/sample/metadata.py"
LABELS = ["v0.20.1", "v0.33.0"]
VOCAB = 64
HIDDEN = 8


class _Torch:
    """Real torch, except the accelerator sync (there is no device on CPU)."""

    accelerator = types.SimpleNamespace(synchronize=lambda *args: None)

    def __getattr__(self, name):
        return getattr(torch, name)


class RecordingRejectionSampler:
    """Indexes the logits as vLLM's rejection sampler does and records the shapes it saw."""

    def __init__(self):
        self.calls = []

    def __call__(self, metadata, draft_probs, logits, sampling_metadata):
        target = logits[metadata.target_logits_indices].to(torch.float32).softmax(dim=-1)
        bonus = logits[metadata.bonus_logits_indices]
        self.calls.append(
            types.SimpleNamespace(
                logits_rows=logits.shape[0],
                target_rows=target.shape[0],
                bonus_rows=bonus.shape[0],
                draft_prob_rows=None if draft_probs is None else draft_probs.shape[0],
                num_draft_tokens=list(metadata.num_draft_tokens),
                all_greedy=sampling_metadata.all_greedy,
            )
        )


def _exec(source: str, names: list[str], namespace: dict) -> dict:
    for name, code in extract_all(source, names).items():
        exec(compile(code, f"<{name}>", "exec"), namespace)
    return namespace


def _runner_cls(tree, runner_text: str) -> type:
    spec_ns: dict = {}
    exec(compile(tree.read(SPEC_METADATA), SPEC_METADATA, "exec"), spec_ns)
    sampling_ns: dict = {"dataclass": dataclasses.dataclass, "torch": torch}
    sampling_src = "from __future__ import annotations\n" + extract(tree.read(SAMPLING_METADATA), "SamplingMetadata")
    exec(compile(sampling_src, SAMPLING_METADATA, "exec"), sampling_ns)
    ns = _exec(
        runner_text,
        [
            "GPUModelRunner._dummy_sampler_run",
            "GPUModelRunner._calc_spec_decode_metadata",
            "GPUModelRunner._get_cumsum_and_arange",
        ],
        {
            "torch": _Torch(),
            "np": np,
            "replace": dataclasses.replace,
            "SpecDecodeMetadata": spec_ns["SpecDecodeMetadata"],
            "SamplingMetadata": sampling_ns["SamplingMetadata"],
            "LogitsProcessors": lambda *args: None,
            "PROCESSED_LOGPROBS_MODES": ("processed_logits", "processed_logprobs"),
            "async_tensor_h2d": lambda data, device, **kw: torch.as_tensor(data, device=device),
        },
    )
    methods = {name: ns[name] for name in ("_dummy_sampler_run", "_calc_spec_decode_metadata", "_get_cumsum_and_arange")}
    return type("GPUModelRunner", (), methods)


def _runner(cls, k: int | None, *, draft_sample_method: str = "probabilistic"):
    runner = cls()
    weight = torch.randn(HIDDEN, VOCAB)
    runner.model = types.SimpleNamespace(compute_logits=lambda hidden: (hidden @ weight).to(torch.float16))
    runner.vllm_config = types.SimpleNamespace(model_config=types.SimpleNamespace(multimodal_config=None))
    runner.device = torch.device("cpu")
    runner.sampler = lambda logits, sampling_metadata: ("sampled", logits.shape[0])
    runner.sampler.logprobs_mode = "raw_logprobs"
    runner.rejection_sampler = RecordingRejectionSampler()
    runner.speculative_config = (
        None
        if k is None
        else types.SimpleNamespace(
            num_speculative_tokens=k,
            rejection_sample_method="standard",
            draft_sample_method=draft_sample_method,
        )
    )
    runner.arange_np = np.arange(4096, dtype=np.int64)
    runner._arange_scratch = np.zeros(4096, dtype=np.int64)
    runner.input_ids = types.SimpleNamespace(gpu=torch.zeros(4096, dtype=torch.int32))
    return runner


def _runtime_step(runner, num_reqs: int, k: int):
    """A real spec-decode step's layout: every request decodes 1 + K tokens (K drafts)."""
    num_draft = np.full(num_reqs, k, dtype=np.int32)
    cu_scheduled = np.cumsum(num_draft + 1, dtype=np.int32)
    return runner._calc_spec_decode_metadata(num_draft, cu_scheduled)


@pytest.fixture(scope="module")
def runner_classes(catalogue, sessions):
    classes = {}
    for label in LABELS:
        session = sessions(label)
        patched = patched_files(catalogue, session, "PN33")[RUNNER]
        classes[label] = {
            "patched": _runner_cls(session.tree, patched),
            "pristine": _runner_cls(session.tree, session.tree.read(RUNNER)),
        }
    return classes


@pytest.mark.parametrize("label", LABELS)
@pytest.mark.parametrize(("num_reqs", "k"), [(4, 3), (4, 5), (256, 3)])
def test_profile_sees_the_logits_of_a_full_spec_decode_step(runner_classes, label, num_reqs, k):
    hidden = torch.randn(num_reqs, HIDDEN)  # the profile run: one hidden row per request
    patched = _runner(runner_classes[label]["patched"], k)
    patched._dummy_sampler_run(hidden)
    step = _runtime_step(patched, num_reqs, k)
    assert patched.rejection_sampler.calls, "the profile did not run the rejection sampler"
    for call in patched.rejection_sampler.calls:
        assert call.logits_rows == len(step.logits_indices) == (k + 1) * num_reqs
        assert call.target_rows == len(step.target_logits_indices) == k * num_reqs
        assert call.bonus_rows == len(step.bonus_logits_indices) == num_reqs
        assert call.num_draft_tokens == step.num_draft_tokens
    if label == "v0.33.0":  # 0.33.0 also profiles a probabilistic drafter's probabilities
        assert patched.rejection_sampler.calls[0].draft_prob_rows == k * num_reqs
        assert [c.all_greedy for c in patched.rejection_sampler.calls] == [False, True]

    pristine = _runner(runner_classes[label]["pristine"], k)
    pristine._dummy_sampler_run(hidden)
    # the failure on this source: one draft per request, (K - 1) * num_reqs logit rows unprofiled
    assert {c.logits_rows for c in pristine.rejection_sampler.calls} == {2 * num_reqs}
    assert 2 * num_reqs < len(step.logits_indices)


@pytest.mark.parametrize("label", LABELS)
def test_one_draft_token_profiles_as_before(runner_classes, label):
    hidden = torch.randn(4, HIDDEN)
    seen = {}
    for kind in ("patched", "pristine"):
        runner = _runner(runner_classes[label][kind], 1)
        runner._dummy_sampler_run(hidden)
        seen[kind] = [vars(c) for c in runner.rejection_sampler.calls]
    assert seen["patched"] == seen["pristine"]
    assert seen["patched"][0]["logits_rows"] == 8


@pytest.mark.parametrize("label", LABELS)
def test_a_speculative_config_that_gives_no_k_profiles_as_before(runner_classes, label):
    """vLLM's own runner test (``test_dummy_sampler_run_warms_all_greedy_rejection_sampler``)
    passes a config with the sampling methods and no ``num_speculative_tokens``: one draft, as stock."""
    hidden = torch.randn(4, HIDDEN)
    seen = {}
    for kind in ("patched", "pristine"):
        runner = _runner(runner_classes[label][kind], 1)
        del runner.speculative_config.num_speculative_tokens
        runner._dummy_sampler_run(hidden)
        seen[kind] = [vars(c) for c in runner.rejection_sampler.calls]
    assert seen["patched"] == seen["pristine"] and seen["patched"][0]["logits_rows"] == 8


@pytest.mark.parametrize("label", LABELS)
def test_without_spec_decode_only_the_sampler_runs(runner_classes, label):
    runner = _runner(runner_classes[label]["patched"], None)
    assert runner._dummy_sampler_run(torch.randn(4, HIDDEN)) == ("sampled", 4)
    assert runner.rejection_sampler.calls == []


@pytest.mark.parametrize("label", ["v0.33.0"])
def test_greedy_drafter_profiles_no_draft_probabilities(runner_classes, label):
    runner = _runner(runner_classes[label]["patched"], 3, draft_sample_method="greedy")
    runner._dummy_sampler_run(torch.randn(4, HIDDEN))
    assert {c.draft_prob_rows for c in runner.rejection_sampler.calls} == {None}
    assert {c.logits_rows for c in runner.rejection_sampler.calls} == {16}


def test_verdicts_and_upstream_shape(catalogue, sessions):
    import libcst as cst

    from kiln.patch.engine import isolated_run
    from kiln.patch.model import BuildTarget, Verdict

    for label in LABELS:
        session = sessions(label)
        target = BuildTarget(session.tree.vllm_version)
        first = isolated_run(catalogue, session, target, "PN33")
        assert first.outcomes["PN33"].verdict is Verdict.APPLIES, label
        again = isolated_run(catalogue, session.overlay(first.state.changed), target, "PN33")
        assert again.outcomes["PN33"].verdict is Verdict.ALREADY_PATCHED, label

    # vLLM's own fix (vllm#37521's shape, any method) retires the patch
    session = sessions("v0.33.0")
    text = session.tree.read(RUNNER)
    one = "draft_token_ids = [[0] for _ in range(num_reqs)]"
    assert text.count(one) == 1
    own = (
        "draft_token_ids = [\n"
        "                list(range(self.speculative_config.num_speculative_tokens))\n"
        "                for _ in range(num_reqs)\n"
        "            ]"
    )
    fixed = session.overlay({RUNNER: cst.parse_module(text.replace(one, own))})
    outcome = isolated_run(catalogue, fixed, BuildTarget(session.tree.vllm_version), "PN33").outcomes["PN33"]
    assert outcome.verdict is Verdict.UPSTREAM
