"""P81 on real 0.20.1 and 0.33.0 source: M <= 8 takes 16-row tiles, and the product is unchanged.

What runs, under Triton's interpreter (``TRITON_INTERPRET=1``, CPU torch) in a fresh process:
``w8a8_triton_block_scaled_mm`` and its kernel ``_w8a8_triton_block_scaled_mm``, extracted from
the pristine and the P81-patched ``fp8_utils.py`` of each pin, executed with stand-ins for the
names they take from the rest of the module (``get_w8a8_block_fp8_configs``: no tuned file, or a
given table; ``current_platform.is_rocm``; ``envs.VLLM_BATCH_INVARIANT`` False). The kernel
launch is wrapped to record the config and grid the wrapper chose, then runs the real kernel on
float8_e4m3fn inputs (the interpreter takes them: ``tl.dot`` of two fp8 tiles). Over a grid of
shapes (M 1-9, 16, 33; N and K multiples of the 128 block and not; 2-D and 3-D activations;
float16, bfloat16 and float32 output) the patched function's output matches a float64 reference
and equals the pristine one's:

- bit for bit in ``exact`` mode, where the interpreter's ``tl.dot`` sums each tile product in
  float64 and rounds once to the float32 accumulator. A dot of two float8_e4m3fn tiles is exact
  in float64 (each product has at most 8 significant bits and lies in [2^-18, 2^17.7]; 128 of
  them need under 44 bits), so each row's result cannot depend on how many rows the tile has:
  this is the kernel's arithmetic with one well-defined rounding per K block, the same in both
  configs;
- within a few float32 units in the last place of the accumulator in the interpreter's own mode
  (``tl.dot`` is ``np.matmul`` in float32, whose BLAS sums a 16-row and a 64-row tile's rows
  in different orders: the difference is that library's, not the kernel's).

Not proven here: that a GPU's tensor-core instructions round the same for 16- and 64-row
tiles (Triton may pick other MMA shapes per tile height); that needs a GPU run.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import libcst as cst
import pytest

from kiln.patch.engine import isolated_run
from kiln.patch.model import BuildTarget, Verdict
from tests.patchsets.support.interpreted_child import run_child
from tests.patchsets.support.patchlib import extract_all, patched_files

TARGET = "model_executor/layers/quantization/utils/fp8_utils.py"
NAMES = ["_w8a8_triton_block_scaled_mm", "w8a8_triton_block_scaled_mm"]
PINS = ("v0.20.1", "v0.33.0")
HEADER = '''\
import types

import torch
import triton
import triton.language as tl

envs = types.SimpleNamespace(VLLM_BATCH_INVARIANT=False)
current_platform = types.SimpleNamespace(is_rocm=lambda: ROCM)
ROCM = False
TUNED = None


def get_w8a8_block_fp8_configs(N, K, block_n, block_k):
    return TUNED


def _upcast_e8m0_to_fp32(scale):
    raise AssertionError("no e8m0 scales in this test")


'''
# (M, N, K, leading dims of A or None for 2-D)
SHAPES = [(m, 256, 256, None) for m in range(1, 10)] + [
    (16, 256, 256, None), (33, 256, 256, None),
    (1, 320, 384, None), (6, 320, 384, None), (8, 384, 200, None), (12, 384, 200, None),
    (6, 256, 512, (2, 3)), (4, 128, 128, (1, 4)),
]
DTYPES = ["float16", "bfloat16", "float32"]


def test_verdicts(catalogue, sessions):
    old = sessions("v0.20.1")
    first = isolated_run(catalogue, old, BuildTarget(old.tree.vllm_version), "P81")
    assert first.outcomes["P81"].verdict is Verdict.APPLIES, first.outcomes["P81"].detail
    again = isolated_run(catalogue, old.overlay(first.state.changed), BuildTarget(old.tree.vllm_version), "P81")
    assert again.outcomes["P81"].verdict is Verdict.ALREADY_PATCHED  # its own branch is not "upstream"
    new = sessions("v0.33.0")
    outcome = isolated_run(catalogue, new, BuildTarget(new.tree.vllm_version), "P81").outcomes["P81"]
    assert outcome.verdict is Verdict.APPLIES, outcome.detail


def test_upstream_shape_is_recognised(catalogue, sessions):
    """A fallback whose BLOCK_SIZE_M is computed from M (vllm#40925's own form) reads UPSTREAM."""
    new = sessions("v0.33.0")
    text = new.tree.read(TARGET)
    assert text.count('"BLOCK_SIZE_M": 64,') == 1
    upstream = text.replace('"BLOCK_SIZE_M": 64,', '"BLOCK_SIZE_M": 16 if M <= 8 else 64,')
    session = new.overlay({TARGET: cst.parse_module(upstream)})
    outcome = isolated_run(catalogue, session, BuildTarget(new.tree.vllm_version), "P81").outcomes["P81"]
    assert outcome.verdict is Verdict.UPSTREAM, outcome.detail
    assert "BLOCK_SIZE_M depends on M" in outcome.detail


@pytest.fixture(scope="module")
def results(catalogue, sessions, tmp_path_factory):
    where = tmp_path_factory.mktemp("p81")
    for pin in PINS:
        session = sessions(pin)
        texts = {"pristine": session.tree.read(TARGET), "patched": patched_files(catalogue, session, "P81")[TARGET]}
        for kind, text in texts.items():
            parts = extract_all(text, NAMES)
            # real files: Triton reads the kernel's source through inspect
            (where / f"{kind}_{pin.replace('.', '_')}.py").write_text(HEADER + "\n\n".join(parts[n] for n in NAMES))
    return run_child(__name__, where, timeout=1200)


@pytest.mark.parametrize("pin", PINS)
def test_config_choice(results, pin):
    """Pristine: 64-row tiles, 2 stages for every M. Patched: 16 rows, 3 stages for M <= 8 only."""
    for case in results[pin]["cases"]:
        m = case["M"]
        assert case["pristine"]["config"]["BLOCK_SIZE_M"] == 64, case
        assert case["pristine"]["config"]["num_stages"] == 2, case
        want = (16, 3) if m <= 8 else (64, 2)
        got = case["patched"]["config"]
        assert (got["BLOCK_SIZE_M"], got["num_stages"]) == want, case
        # everything else as before: N/K tiles are the quant block, the same group and warps
        for key in ("BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "num_warps"):
            assert got[key] == case["pristine"]["config"][key], (key, case)
        assert case["patched"]["programs"] == case["pristine"]["programs"]  # one M tile either way
    assert sum(c["M"] <= 8 for c in results[pin]["cases"]) >= 12


@pytest.mark.parametrize("pin", PINS)
def test_patched_output_is_bitwise_the_pristine_one_with_an_exact_dot(results, pin):
    cases = results[pin]["cases"]
    assert len(cases) == len(SHAPES) * len(DTYPES)
    for case in cases:
        assert case["exact"]["bitwise_equal"], case
        assert case["exact"]["rel_err_vs_reference"] < case["tolerance"], case


@pytest.mark.parametrize("pin", PINS)
def test_interpreters_float32_dot_differs_by_summation_order_only(results, pin):
    """np.matmul's order: at most a few float32 ulps of the accumulator, and equal where M is 1."""
    cases = results[pin]["cases"]
    for case in cases:
        assert case["interpreter"]["rel_err_vs_reference"] < case["tolerance"], case
        assert case["interpreter"]["max_ulps_float32"] <= 8, case
        if case["dtype"] != "float32":  # one rounding to 16 bits hides most ulp differences
            continue
        if case["M"] == 1 and case["lead"] is None:
            assert case["interpreter"]["bitwise_equal"], case


@pytest.mark.parametrize("pin", PINS)
def test_rocm_and_tuned_configs(results, pin):
    """ROCm keeps 2 stages with 16-row tiles; a tuned config file still wins for M <= 8."""
    extra = results[pin]["extra"]
    assert extra["rocm"]["patched"] == {"BLOCK_SIZE_M": 16, "num_stages": 2}
    assert extra["rocm"]["pristine"] == {"BLOCK_SIZE_M": 64, "num_stages": 2}
    assert extra["tuned"]["patched"] == extra["tuned"]["pristine"] == {"BLOCK_SIZE_M": 32, "num_stages": 4}


# -- the child process ----------------------------------------------------------------------------


def _load(path: Path):
    import importlib.util

    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module


class _Recording:
    """Stands in for the module's kernel global: records the launch, then launches the real one."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **config):
            self.launches.append({"config": dict(config), "programs": grid(config)[0]})
            return self.kernel[grid](*args, **config)

        return launch


def _run(module, A, B, As, Bs, dtype):
    recorder = _Recording(module._w8a8_triton_block_scaled_mm)
    module._w8a8_triton_block_scaled_mm = recorder
    try:
        out = module.w8a8_triton_block_scaled_mm(A, B, As, Bs, [128, 128], dtype)
    finally:
        module._w8a8_triton_block_scaled_mm = recorder.kernel
    (launch,) = recorder.launches
    return out, launch


def _inputs(torch, M, N, K, lead, seed):
    gen = torch.Generator().manual_seed(seed)
    kb, nb = -(-K // 128), -(-N // 128)
    shape = (*lead, K) if lead else (M, K)
    A = (torch.randn(shape, generator=gen) * 4).to(torch.float8_e4m3fn)
    As = torch.rand((*shape[:-1], kb), generator=gen) * 0.02 + 0.001
    B = (torch.randn(N, K, generator=gen) * 4).to(torch.float8_e4m3fn)
    Bs = torch.rand(nb, kb, generator=gen) * 0.02 + 0.001
    return A, B, As, Bs


def _reference(torch, A, B, As, Bs):
    K, N = A.shape[-1], B.shape[0]
    a = A.to(torch.float64).reshape(-1, K) * As.to(torch.float64).reshape(-1, As.shape[-1]).repeat_interleave(128, 1)[:, :K]
    b = B.to(torch.float64) * Bs.to(torch.float64).repeat_interleave(128, 0)[:N].repeat_interleave(128, 1)[:, :K]
    return (a @ b.T).reshape(*A.shape[:-1], N)


def _set_dot(mode: str) -> None:
    """``exact``: tl.dot sums in float64 and rounds once to the accumulator's dtype."""
    import numpy as np
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if not hasattr(builder, "_p81_stock_dot"):
        builder._p81_stock_dot = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if mode != "exact":
            return builder._p81_stock_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        wide = [interpreter._convert_float(x.data, x.dtype, interpreter.tl.float32, None).view(np.float32)
                if x.dtype.primitive_bitwidth == 8 else x.data for x in (a, b)]
        tile = np.matmul(wide[0].astype(np.float64), wide[1].astype(np.float64)).astype(d.data.dtype)
        return interpreter.TensorHandle(tile + d.data, d.dtype.scalar)

    builder.create_dot = create_dot


def _ulps(torch, x, y) -> int:
    """Largest distance in float32 units in the last place between two float32 tensors."""
    xi, yi = x.contiguous().view(torch.int32).to(torch.int64), y.contiguous().view(torch.int32).to(torch.int64)
    return int((xi - yi).abs().max()) if x.numel() else 0


def child_main() -> None:
    import types

    import torch

    # 0.33.0's wrapper asks ROCm whether it is a gfx1250 (a torch fallback there) before the
    # Triton path; the ROCm case below runs the Triton path.
    rocm = types.ModuleType("vllm.platforms.rocm")
    rocm.on_gfx1250 = lambda: False
    sys.modules["vllm.platforms.rocm"] = rocm
    where = Path(sys.argv[1])
    out: dict = {}
    for pin in PINS:
        tag = pin.replace(".", "_")
        modules = {kind: _load(where / f"{kind}_{tag}.py") for kind in ("pristine", "patched")}
        cases = []
        for i, (M, N, K, lead) in enumerate(SHAPES):
            A, B, As, Bs = _inputs(torch, M, N, K, lead, seed=i)
            ref = _reference(torch, A, B, As, Bs)
            for name in DTYPES:
                dtype = getattr(torch, name)
                case = {"M": M, "N": N, "K": K, "lead": lead, "dtype": name,
                        "tolerance": {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}[name]}
                for mode in ("exact", "interpreter"):
                    _set_dot(mode)
                    results = {}
                    for kind, module in modules.items():
                        results[kind], case[kind] = _run(module, A, B, As, Bs, dtype)
                    err = (results["patched"].to(torch.float64) - ref).abs().max() / ref.abs().max()
                    case[mode] = {"bitwise_equal": bool(torch.equal(results["pristine"], results["patched"])),
                                  "rel_err_vs_reference": float(err)}
                    if name == "float32":
                        case[mode]["max_ulps_float32"] = _ulps(torch, results["pristine"], results["patched"])
                    else:
                        case[mode]["max_ulps_float32"] = 0  # measured on the float32 output only
                cases.append(case)
        A, B, As, Bs = _inputs(torch, 4, 256, 256, None, seed=99)
        extra = {"rocm": {}, "tuned": {}}
        for kind, module in modules.items():
            module.ROCM = True
            _, launch = _run(module, A, B, As, Bs, torch.float16)
            module.ROCM = False
            extra["rocm"][kind] = {k: launch["config"][k] for k in ("BLOCK_SIZE_M", "num_stages")}
            tuned = {"BLOCK_SIZE_M": 32, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1,
                     "num_warps": 4, "num_stages": 4}
            module.TUNED = {1: tuned, 64: {**tuned, "BLOCK_SIZE_M": 64}}
            _, launch = _run(module, A, B, As, Bs, torch.float16)
            module.TUNED = None
            extra["tuned"][kind] = {k: launch["config"][k] for k in ("BLOCK_SIZE_M", "num_stages")}
        out[pin] = {"cases": cases, "extra": extra}
    print(json.dumps(out))
