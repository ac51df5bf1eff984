"""PN12 on real 0.20.1 and 0.33.0 source: SiluAndMul's CUDA path reuses one output buffer.

What runs: the whole ``SiluAndMul`` class of each pin, pristine and patched by PN12, extracted
from the real ``model_executor/layers/activation.py`` and executed on CPU torch: its real
``forward_cuda``, ``forward_native`` and (patched) ``_pooled_output``. What is stood in:
``CustomOp`` (the base class: ``register`` names the class, and ``forward`` dispatches to
``forward_cuda``, as ``custom_op.py`` does on a CUDA platform with the op enabled),
``current_platform`` (reports no CUDA, so ``__init__`` does not look up
``torch.ops._C.silu_and_mul``), and the kernel ``self.op``: a torch library op with vLLM's
schema, ``silu_and_mul(Tensor! result, Tensor input) -> ()``, whose CPU implementation writes
``forward_native``'s math into ``result``. The reference for every output is the real
``forward_native`` of the same class.

On CPU the patched code takes the same branches as on CUDA except the stream key (``None``
here) and the CUDA-graph-capture check (``x.is_cuda`` is false): those two are not exercised.
Allocations are counted with a dispatch mode that sees every ``aten.empty`` call.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from kiln.patch.engine import isolated_run
from kiln.patch.model import BuildTarget, Verdict
from tests.patchsets.support.patchlib import extract, patched_files

TARGET = "model_executor/layers/activation.py"
PINS = ("v0.20.1", "v0.33.0")


def _define_reference_op():
    try:
        return torch.ops.kiln_pn12.silu_and_mul
    except (AttributeError, RuntimeError):
        pass
    lib = torch.library.Library("kiln_pn12", "FRAGMENT")
    lib.define("silu_and_mul(Tensor! result, Tensor input) -> ()")

    def silu_and_mul(result: torch.Tensor, input: torch.Tensor) -> None:
        d = input.shape[-1] // 2
        result.copy_(F.silu(input[..., :d]) * input[..., d:])

    lib.impl("silu_and_mul", silu_and_mul, "CPU")
    torch.library.register_fake("kiln_pn12::silu_and_mul", lambda result, input: None, lib=lib)
    _define_reference_op.lib = lib  # keep the registration alive
    return torch.ops.kiln_pn12.silu_and_mul


REFERENCE_OP = _define_reference_op()


class CustomOp(torch.nn.Module):
    """Stand-in for vLLM's base: the op enabled on a CUDA platform runs ``forward_cuda``."""

    @classmethod
    def register(cls, name, dynamic_arg_dims=None):
        def decorator(op_cls):
            op_cls.name = name
            return op_cls

        return decorator

    def __init__(self, *, enforce_enable: bool = False, compile_native: bool = False):
        super().__init__()

    def forward(self, x):
        return self.forward_cuda(x)


PLATFORM = types.SimpleNamespace(
    is_cuda_alike=lambda: False, is_xpu=lambda: False, is_cpu=lambda: False, get_cpu_architecture=lambda: None
)


def _silu_and_mul_class(source: str) -> type:
    namespace = {
        "torch": torch, "nn": torch.nn, "F": F, "CustomOp": CustomOp,
        "current_platform": PLATFORM, "CpuArchEnum": types.SimpleNamespace(POWERPC="ppc"),
    }
    exec(compile(extract(source, "SiluAndMul"), "<SiluAndMul>", "exec"), namespace)
    return namespace["SiluAndMul"]


@pytest.fixture(scope="module", params=PINS)
def classes(request, catalogue, sessions):
    session = sessions(request.param)
    pristine = _silu_and_mul_class(session.tree.read(TARGET))
    patched = _silu_and_mul_class(patched_files(catalogue, session, "PN12")[TARGET])
    return pristine, patched


@pytest.fixture
def patched(classes):
    cls = classes[1]
    cls._output_pools.clear()  # every test starts with no buffer
    yield cls
    cls._output_pools.clear()


def _layer(cls):
    layer = cls()
    layer.op = REFERENCE_OP
    return layer


class CountEmpty(TorchDispatchMode):
    """Counts ``aten.empty`` allocations (the rows of each) while active."""

    def __init__(self):
        super().__init__()
        self.rows: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.empty.memory_format:
            self.rows.append(int(args[0][0]) if len(args[0]) > 1 else 1)
        return func(*args, **(kwargs or {}))


def _input(rows, d, dtype, seed, batch=None):
    gen = torch.Generator().manual_seed(seed)
    shape = (rows, 2 * d) if batch is None else (batch, rows, 2 * d)
    return (torch.randn(shape, generator=gen) * 3).to(dtype)


# -- verdicts ------------------------------------------------------------------------------------


@pytest.mark.parametrize("pin", PINS)
def test_applies_and_reapplies_as_already_patched(catalogue, sessions, pin):
    session = sessions(pin)
    target = BuildTarget(session.tree.vllm_version)
    first = isolated_run(catalogue, session, target, "PN12")
    assert first.outcomes["PN12"].verdict is Verdict.APPLIES, first.outcomes["PN12"].detail
    again = isolated_run(catalogue, session.overlay(first.state.changed), target, "PN12")
    assert again.outcomes["PN12"].verdict is Verdict.ALREADY_PATCHED


# -- numerics ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_outputs_equal_the_stock_op_over_a_grid_of_shapes(classes, patched, dtype):
    """Calls growing and shrinking through two layers per width: every output equals
    ``forward_native`` and the pristine ``forward_cuda`` bit for bit, read as down_proj would."""
    pristine_layer = _layer(classes[0])
    layers = [_layer(patched), _layer(patched)]
    seed = 0
    for d in (8, 96, 136):
        for rows, batch in ((5, None), (64, None), (1, None), (17, None), (64, None), (3, 4), (40, None), (2, 8)):
            seed += 1
            x = _input(rows, d, dtype, seed, batch)
            out = layers[seed % 2](x)
            assert out.shape == x.shape[:-1] + (d,) and out.dtype == dtype and out.is_contiguous()
            assert torch.equal(out, classes[1].forward_native(x)), (d, rows, batch)
            assert torch.equal(out, pristine_layer(x)), (d, rows, batch)
            del out  # consumed, as down_proj consumes it before the next layer runs


# -- the pool ------------------------------------------------------------------------------------


def test_a_call_of_the_same_or_fewer_rows_allocates_nothing(classes, patched):
    """Pristine allocates once per call; patched once per width and dtype, then reuses it."""
    counts = {}
    for name, cls in (("pristine", classes[0]), ("patched", patched)):
        layers = [_layer(cls) for _ in range(4)]
        with CountEmpty() as mode:
            for step, rows in enumerate((32, 32, 7, 1, 32, 20)):
                for i, layer in enumerate(layers):
                    out = layer(_input(rows, 64, torch.float16, step * 10 + i))
                    del out
        counts[name] = mode.rows
    assert counts["pristine"] == [r for r in (32, 32, 7, 1, 32, 20) for _ in range(4)]
    assert counts["patched"] == [32]


def test_reuse_hands_out_the_same_memory(patched):
    layer_a, layer_b = _layer(patched), _layer(patched)
    first = layer_a(_input(16, 32, torch.float32, 1))
    pointer = first.data_ptr()
    del first
    second = layer_b(_input(9, 32, torch.float32, 2))
    assert second.data_ptr() == pointer  # the first rows of the same buffer
    (buffer, _), = patched._output_pools.values()
    assert buffer.shape == (16, 32) and second.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()


def test_a_larger_call_grows_the_buffer_once(patched):
    layer = _layer(patched)
    with CountEmpty() as mode:
        for rows, seed in ((8, 1), (32, 2), (32, 3), (16, 4), (33, 5), (33, 6), (2, 7)):
            x = _input(rows, 48, torch.bfloat16, seed)
            out = layer(x)
            assert torch.equal(out, patched.forward_native(x)), rows
            del out
    assert mode.rows == [8, 32, 33]  # one allocation per new maximum, none otherwise
    (buffer, _), = patched._output_pools.values()
    assert buffer.shape == (33, 48)  # the smaller buffers were dropped, not kept beside it


def test_widths_dtypes_and_devices_get_their_own_buffers(patched):
    layer = _layer(patched)
    for d, dtype in ((16, torch.float32), (24, torch.float32), (16, torch.float16)):
        out = layer(_input(4, d, dtype, d))
        del out
    keys = sorted((k[0], str(k[1]), str(k[2]), k[3]) for k in patched._output_pools)
    assert keys == [(16, "torch.float16", "cpu", None), (16, "torch.float32", "cpu", None), (24, "torch.float32", "cpu", None)]


# -- safety --------------------------------------------------------------------------------------


@pytest.mark.parametrize("keep", ["output", "derived view"])
def test_an_output_still_referenced_is_never_overwritten(patched, keep):
    """A caller holding an earlier output (or a view of it) gets fresh memory for the next call."""
    layer = _layer(patched)
    x1, x2 = _input(8, 32, torch.float32, 1), _input(8, 32, torch.float32, 2)
    first = layer(x1)
    held = first if keep == "output" else first.reshape(-1)[4:]
    expected = held.clone()
    del first
    with CountEmpty() as mode:
        second = layer(x2)
    assert mode.rows == [8]  # a fresh tensor, as on the stock path
    assert torch.equal(held, expected)
    assert torch.equal(second, patched.forward_native(x2))
    assert second.untyped_storage().data_ptr() != held.untyped_storage().data_ptr()
    del held, second
    with CountEmpty() as mode:
        third = layer(x1)
    assert mode.rows == [] and torch.equal(third, patched.forward_native(x1))  # released: reused again


def test_inference_mode_and_normal_mode_share_the_buffer(patched):
    """The buffer is made outside inference mode, so a call outside it can still write it."""
    layer = _layer(patched)
    x = _input(6, 32, torch.float16, 3)
    with torch.inference_mode():
        out = layer(x)
        assert torch.equal(out, patched.forward_native(x))
        del out
    with torch.no_grad():
        out = layer(x)  # an in-place write into an inference tensor would raise here
        assert torch.equal(out, patched.forward_native(x))


def test_a_traced_call_allocates_its_own_output_and_leaves_the_pool_alone(patched):
    """Under Dynamo (vLLM drops the compiled graph's guards) the patched path is the stock one."""
    layer = _layer(patched)
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True, dynamic=True)
    for rows, seed in ((4, 1), (12, 2), (3, 3)):
        x = _input(rows, 32, torch.float32, seed)
        assert torch.equal(compiled(x), patched.forward_native(x)), rows
    assert patched._output_pools == {}
    torch._dynamo.reset()


def test_layers_of_an_mlp_stack_give_the_stock_results(classes, patched):
    """gate_up -> SiluAndMul -> down_proj per layer, two widths, prefill-like and decode-like
    steps: the patched stack's outputs equal the pristine stack's, with one buffer per width."""
    torch.manual_seed(0)
    hidden = 32
    widths = (48, 80, 48, 80, 48)
    gate_up = [torch.nn.Linear(hidden, 2 * w, bias=False) for w in widths]
    down = [torch.nn.Linear(w, hidden, bias=False) for w in widths]

    def run(cls, x):
        acts = [_layer(cls) for _ in widths]
        for g, act, dn in zip(gate_up, acts, down, strict=True):
            x = x + dn(act(g(x)))
        return x

    with torch.inference_mode():
        for tokens in (64, 3, 64, 17, 1):
            x = torch.randn(tokens, hidden)
            expected = run(classes[0], x)
            with CountEmpty() as mode:
                got = run(patched, x)
            assert torch.equal(got, expected), tokens
            if tokens == 64:
                assert len(mode.rows) <= len(set(widths))
            else:
                assert mode.rows == []
    assert sorted(k[0] for k in patched._output_pools) == [48, 80]
