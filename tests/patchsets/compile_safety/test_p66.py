"""P66 on real 0.20.1 source: with spec decode, capture sizes are multiples of 1 + K in every mode.

Behaviour test by extraction: the patched ``VllmConfig._set_cudagraph_sizes`` is taken from
the patched ``config/vllm.py`` and run against stand-in config objects; the rounding it calls,
``CompilationConfig.adjust_cudagraph_sizes_for_spec_decode``, is vLLM's own, extracted from the
same tree's ``config/compilation.py`` (importing ``vllm.config`` needs the whole of vLLM).
The pristine method runs on the same configs.
"""

import enum
import types

import pytest

from kiln.patch.engine import isolated_run
from kiln.patch.model import BuildTarget, Verdict
from tests.patchsets.support.patchlib import assert_applies_once, extract, patched_files

TARGET = "config/vllm.py"


class CUDAGraphMode(enum.Enum):  # stand-in with vLLM's member names
    NONE = 0
    PIECEWISE = 1
    FULL = 2
    FULL_AND_PIECEWISE = (2, 1)


def _round_up(x: int, y: int) -> int:
    return (x + y - 1) // y * y


@pytest.fixture(scope="module")
def compilation_config_cls(sessions):
    source = sessions("v0.20.1").tree.read("config/compilation.py")
    namespace = {"round_up": _round_up}
    exec(compile(extract(source, "CompilationConfig.adjust_cudagraph_sizes_for_spec_decode"), "compilation", "exec"), namespace)

    class Compilation(types.SimpleNamespace):
        adjust_cudagraph_sizes_for_spec_decode = namespace["adjust_cudagraph_sizes_for_spec_decode"]

        def post_init_cudagraph_sizes(self):  # vLLM's keeps only this invariant for the sizes
            assert not self.cudagraph_capture_sizes or self.cudagraph_capture_sizes[-1] == self.max_cudagraph_capture_size

    return Compilation


def _method(source: str):
    namespace = {"CUDAGraphMode": CUDAGraphMode, "logger": types.SimpleNamespace(warning=lambda *a: None)}
    exec(compile(extract(source, "VllmConfig._set_cudagraph_sizes"), "vllm_config", "exec"), namespace)
    return namespace["_set_cudagraph_sizes"]


@pytest.fixture(scope="module")
def pristine(sessions):
    return _method(sessions("v0.20.1").tree.read(TARGET))


@pytest.fixture(scope="module")
def patched(catalogue, sessions):
    return _method(patched_files(catalogue, sessions("v0.20.1"), "P66")[TARGET])


def _sizes(method, compilation_config_cls, *, k=None, mode=CUDAGraphMode.PIECEWISE, performance_mode="throughput", tp=1, sp=False, sizes=None):
    config = types.SimpleNamespace(
        model_config=types.SimpleNamespace(enforce_eager=False),
        compilation_config=compilation_config_cls(
            cudagraph_mode=mode,
            max_cudagraph_capture_size=None,
            cudagraph_capture_sizes=sizes,
            pass_config=types.SimpleNamespace(enable_sp=sp),
        ),
        speculative_config=None if k is None else types.SimpleNamespace(num_speculative_tokens=k),
        scheduler_config=types.SimpleNamespace(max_num_seqs=128, max_num_batched_tokens=8192),
        parallel_config=types.SimpleNamespace(tensor_parallel_size=tp),
        performance_mode=performance_mode,
    )
    config.update_sizes_for_sequence_parallelism = lambda sizes: [s for s in sizes if s % tp == 0]
    method(config)
    cc = config.compilation_config
    assert cc.cudagraph_capture_sizes[-1] == cc.max_cudagraph_capture_size
    return cc.cudagraph_capture_sizes


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_with_spec_decode_every_size_is_a_multiple_of_the_verify_length(patched, pristine, compilation_config_cls, k):
    sizes = _sizes(patched, compilation_config_cls, k=k)
    assert sizes and all(size % (1 + k) == 0 for size in sizes)
    assert sizes[0] == 1 + k  # a single request's verify batch has its graph
    assert any(size % (1 + k) for size in _sizes(pristine, compilation_config_cls, k=k))  # the grid: 1, 2, 4, 8, ...


def test_rounding_keeps_the_small_verify_batches_where_dropping_would_not(patched, compilation_config_cls):
    # K=2: 3, 6, 9 tokens (1-3 requests) get graphs; dropping non-multiples would keep 3, 24, 48, ...
    assert _sizes(patched, compilation_config_cls, k=2)[:5] == [3, 6, 9, 18, 24]


def test_interactivity_mode_captures_one_graph_per_request_count(patched, pristine, compilation_config_cls):
    assert _sizes(pristine, compilation_config_cls, k=3, performance_mode="interactivity")[:32] == list(range(1, 33))
    assert _sizes(patched, compilation_config_cls, k=3, performance_mode="interactivity")[:8] == list(range(4, 33, 4))


def test_explicit_sizes_are_rounded_too(patched, compilation_config_cls):
    # vLLM's rule: round up, drop what would pass the largest size (30 -> 32 > 30)
    assert _sizes(patched, compilation_config_cls, k=3, sizes=[1, 10, 16, 30]) == [4, 12, 16]


@pytest.mark.parametrize("mode", [CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL_AND_PIECEWISE])
@pytest.mark.parametrize("performance_mode", ["throughput", "interactivity"])
def test_without_spec_decode_nothing_changes(patched, pristine, compilation_config_cls, mode, performance_mode):
    kwargs = {"mode": mode, "performance_mode": performance_mode}
    assert _sizes(patched, compilation_config_cls, **kwargs) == _sizes(pristine, compilation_config_cls, **kwargs)
    kwargs["k"] = 0  # a speculative config without draft tokens
    assert _sizes(patched, compilation_config_cls, **kwargs) == _sizes(pristine, compilation_config_cls, **kwargs)


def test_sequence_parallelism_is_left_to_vllm(patched, pristine, compilation_config_cls):
    kwargs = {"k": 2, "tp": 2, "sp": True}  # K/TP pair vLLM's rounding would reject
    assert _sizes(patched, compilation_config_cls, **kwargs) == _sizes(pristine, compilation_config_cls, **kwargs)


def test_cudagraphs_off_is_untouched(patched, compilation_config_cls):
    config = types.SimpleNamespace(
        model_config=types.SimpleNamespace(enforce_eager=True),
        compilation_config=compilation_config_cls(cudagraph_mode=CUDAGraphMode.PIECEWISE, cudagraph_capture_sizes=None),
        speculative_config=types.SimpleNamespace(num_speculative_tokens=3),
    )
    patched(config)
    assert config.compilation_config.cudagraph_capture_sizes == []


def test_verdicts(catalogue, sessions):
    session = sessions("v0.20.1")
    assert isolated_run(catalogue, session, BuildTarget(session.tree.vllm_version), "P66").outcomes["P66"].verdict is Verdict.APPLIES
    session = sessions("v0.33.0")
    outcome = isolated_run(catalogue, session, BuildTarget(session.tree.vllm_version), "P66").outcomes["P66"]
    assert outcome.verdict is Verdict.UPSTREAM
    assert "uniform_decode_sizes" in outcome.detail


def test_applying_twice_is_already_patched(catalogue, sessions):
    session = sessions("v0.20.1")
    assert_applies_once(catalogue, session, "P66")
