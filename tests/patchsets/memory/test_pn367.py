"""PN367 on real 0.20.1 and 0.33.0 source: a capture that frees memory no longer makes the CUDA
graph estimate negative.

What runs: the V1 runner's real ``GPUModelRunner.profile_cudagraph_memory`` of each pin, pristine
and patched by PN367, extracted from ``v1/worker/gpu_model_runner.py`` and executed on CPU. What is
stood in: the GPU's free memory (``torch.cuda.mem_get_info`` on 0.20.1,
``torch.accelerator.get_memory_info`` on 0.33.0), which each stand-in capture moves by a cost the
test chooses (negative: the capture left more memory free than before); the capture itself
(``_warmup_and_capture``); and the bookkeeping around it (graph pools, wrappers, the dispatcher's
keys, LoRA, the profiling KV cache), which the function only sets and clears. The worker's use of
the estimate is checked on its real source: ``determine_available_memory`` subtracts it from the
KV cache budget.
"""

from __future__ import annotations

import contextlib
import enum
import types

import libcst as cst
import libcst.matchers as m
import pytest

from kiln.patch.model import Verdict
from kiln.patch.testing import assert_codemod
from tests.patchsets.support.patchlib import assert_applies_once, extract, patched_files

RUNNER = "v1/worker/gpu_model_runner.py"
WORKER = "v1/worker/gpu_worker.py"
PINS = ("v0.20.1", "v0.33.0")
MiB = 1 << 20
GiB = 1 << 30


class CUDAGraphMode(enum.Enum):
    """vLLM's capture modes the profile loops over (``config/compilation.py``); only names are read."""

    FULL = 2
    PIECEWISE = 1


class Gpu:
    """Free memory as the driver reports it: each capture moves it by that graph's cost."""

    def __init__(self, costs: dict[int, int]):
        self.free = 20 * GiB
        self.costs = costs  # num_tokens of a capture -> bytes it takes (negative: it frees)

    def mem_get_info(self, *_device) -> tuple[int, int]:
        return self.free, 24 * GiB

    def capture(self, desc, cudagraph_runtime_mode, profile_seq_lens=None) -> None:
        self.free -= self.costs[desc.num_tokens]


class GraphWrappers:
    """``CUDAGraphWrapper`` / ``BreakableCUDAGraphWrapper``: no wrapped model here."""

    _all_instances: list = []

    @staticmethod
    def clear_all_graphs() -> None:
        pass


def _noop(*_args, **_kwargs) -> None:
    return None


def _profile(text: str, capture_descs, costs: dict[int, int]) -> int:
    """Run ``text``'s real ``GPUModelRunner.profile_cudagraph_memory`` on a stand-in runner and GPU."""
    gpu = Gpu(costs)
    torch = types.SimpleNamespace(
        inference_mode=lambda: (lambda fn: fn),
        cuda=types.SimpleNamespace(mem_get_info=gpu.mem_get_info),
        accelerator=types.SimpleNamespace(synchronize=_noop, empty_cache=_noop, get_memory_info=gpu.mem_get_info),
    )
    namespace = {
        "torch": torch, "Any": object, "CUDAGraphMode": CUDAGraphMode,
        "set_current_vllm_config": lambda config: contextlib.nullcontext(),
        "compilation_counter": types.SimpleNamespace(num_cudagraph_captured=0),
        "logger": types.SimpleNamespace(info=_noop, debug=_noop),
        "current_platform": types.SimpleNamespace(graph_pool_handle=object),
        "CUDAGraphWrapper": GraphWrappers, "BreakableCUDAGraphWrapper": GraphWrappers,
        "set_cudagraph_capturing_enabled": _noop,
        "graph_capture": lambda device: contextlib.nullcontext(),
    }
    code = extract(text, "GPUModelRunner.profile_cudagraph_memory")
    exec(compile("from __future__ import annotations\n" + code, f"vllm/{RUNNER}", "exec"), namespace)
    runner = types.SimpleNamespace(
        vllm_config=None, lora_config=None, device="cuda:0", max_model_len=4096, max_num_tokens=4096,
        cudagraph_dispatcher=types.SimpleNamespace(get_capture_descs=lambda: capture_descs,
                                                   cudagraph_keys={}, keys_initialized=True),
        _init_minimal_kv_cache_for_profiling=_noop, _cleanup_profiling_kv_cache=_noop,
        _freeze_gc=contextlib.nullcontext, _warmup_and_capture=gpu.capture, maybe_remove_all_loras=_noop,
        _create_encoder_cudagraph_manager=lambda: None,  # 0.33.0: no encoder graphs for a text batch
    )
    return namespace["profile_cudagraph_memory"](runner)


def _descs(*sizes: int) -> list:
    return [types.SimpleNamespace(num_tokens=n) for n in sizes]


# MTP with FULL_AND_PIECEWISE graphs: 4 FULL decode graphs, 5 PIECEWISE ones (largest first, as the
# dispatcher lists them). Only the first two of each mode are captured and measured.
CAPTURES = [(CUDAGraphMode.FULL, _descs(16, 12, 8, 4)), (CUDAGraphMode.PIECEWISE, _descs(4096, 2048, 1024, 512, 256))]
# Both first captures leave more memory free than before (vllm#44740: the allocator releasing
# blocks, lazy buffers collected between the readings); the second ones allocate a little.
FREEING = {16: -640 * MiB, 12: 3 * MiB, 4096: -900 * MiB, 2048: 2 * MiB}
ALLOCATING = {16: 640 * MiB, 12: 3 * MiB, 4096: 300 * MiB, 2048: 2 * MiB}


@pytest.fixture(scope="module")
def runners(catalogue, sessions) -> dict[tuple[str, str], str]:
    """(pin, "pristine" | "patched") -> the runner file's text."""
    out = {}
    for pin in PINS:
        session = sessions(pin)
        out[pin, "pristine"] = session.tree.read(RUNNER)
        out[pin, "patched"] = patched_files(catalogue, session, "PN367")[RUNNER]
    return out


def test_verdicts(catalogue, sessions):
    for pin in PINS:
        assert_applies_once(catalogue, sessions(pin), "PN367")


@pytest.mark.parametrize("pin", PINS)
def test_pristine_estimate_goes_negative_when_captures_free_memory(runners, pin):
    estimate = _profile(runners[pin, "pristine"], CAPTURES, FREEING)
    assert estimate < 0, estimate


@pytest.mark.parametrize("pin", PINS)
def test_patched_estimate_counts_a_freeing_capture_as_zero(runners, pin):
    patched = _profile(runners[pin, "patched"], CAPTURES, FREEING)
    assert patched >= 0
    # exactly what stock computes when the freeing captures are measured as costing nothing
    floored = {n: max(cost, 0) for n, cost in FREEING.items()}
    assert patched == _profile(runners[pin, "pristine"], CAPTURES, floored)


@pytest.mark.parametrize("pin", PINS)
def test_captures_that_allocate_are_estimated_as_before(runners, pin):
    stock = _profile(runners[pin, "pristine"], CAPTURES, ALLOCATING)
    assert stock > 0
    assert _profile(runners[pin, "patched"], CAPTURES, ALLOCATING) == stock


def test_worker_takes_the_estimate_off_the_kv_budget(sessions):
    """0.20.1's ``Worker.determine_available_memory`` (gpu_worker.py:421-425) subtracts the estimate
    (``cudagraph_memory_estimate_applied``, the estimate itself with the env flag on, :399-403): a
    negative estimate adds its size to the KV cache."""
    module = cst.parse_module(sessions("v0.20.1").tree.read(WORKER))
    budget = m.Assign(
        targets=[m.AssignTarget(m.Attribute(value=m.Name("self"), attr=m.Name("available_kv_cache_memory_bytes")))],
        value=m.BinaryOperation(operator=m.Subtract(), right=m.Name("cudagraph_memory_estimate_applied")),
    )
    applied = m.Assign(
        targets=[m.AssignTarget(m.Name("cudagraph_memory_estimate_applied"))],
        value=m.IfExp(body=m.Name("cudagraph_memory_estimate"), test=m.Attribute(attr=m.Name("VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS")),
                      orelse=m.Integer("0")),
    )
    assert len(m.findall(module, budget)) == 1
    assert len(m.findall(module, applied)) == 1


# -- inline before/after ---------------------------------------------------------------------------

SAMPLE = """
    class GPUModelRunner:
        def profile_cudagraph_memory(self) -> int:
            for i, desc in enumerate(profile_descs):
                mem_before = torch.cuda.mem_get_info()[0]
                self._warmup_and_capture(desc)
                free_after = torch.cuda.mem_get_info()[0]
                mem_samples.append(mem_before - free_after)
            encoder_memory_estimate = max(mem_before - free_after, 0)
    """

CLAMPED = SAMPLE.replace(
    "                mem_samples.append(mem_before - free_after)\n",
    "                # kiln PN367: a capture that frees memory counts as 0, so the graph estimate never enlarges the KV cache\n"
    "                mem_samples.append(max(mem_before - free_after, 0))\n",
)

# vllm#44745's form (open): the delta named, then clamped
UPSTREAM = SAMPLE.replace(
    "                mem_samples.append(mem_before - free_after)\n",
    "                delta = mem_before - free_after\n"
    "                mem_samples.append(max(delta, 0))\n",
)


@pytest.fixture(scope="module")
def pn367(catalogue):
    return catalogue.get("PN367")


def test_inline_applies_and_leaves_the_encoder_sample_alone(pn367):
    outcome = assert_codemod(SAMPLE, pn367, Verdict.APPLIES, CLAMPED)
    assert set(outcome.files) == {RUNNER}


def test_inline_already_patched_and_upstream(pn367):
    assert_codemod(CLAMPED, pn367, Verdict.ALREADY_PATCHED, CLAMPED)
    assert_codemod(UPSTREAM, pn367, Verdict.UPSTREAM, UPSTREAM)


def test_inline_a_sample_measured_otherwise_is_drifted(pn367):
    moved = SAMPLE.replace("mem_samples.append(mem_before - free_after)", "mem_samples.append(free_after)")
    assert_codemod(moved, pn367, Verdict.DRIFTED)
