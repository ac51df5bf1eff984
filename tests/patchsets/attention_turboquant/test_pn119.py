"""PN119 on real 0.20.1 and 0.33.0 source: TurboQuant decode stage 1 grouped per KV head.

What runs:
- Verdicts on both pins; vLLM's own grouped stage 1 (vllm#40792's shape) reads UPSTREAM; a
  stage-1 launch without an argument the grouped launch reuses is DRIFTED, naming it.
- Numerics under Triton's interpreter (``TRITON_INTERPRET=1``, CPU torch), in a fresh process:
  the *stock* ``triton_turboquant_decode_attention`` of the tree and the *patched* one (the
  decode module PN119 rewrites plus the kernel file it adds, loaded as vLLM imports them)
  decode the same TurboQuant cache. The cache bytes are built directly (FP8 or packed MSE
  keys with fp16 norms, packed 3/4-bit values with fp16 scale/zero, in random block order,
  on 0.33.0 through the transposed view that pin's backend passes). Over the shapes of
  ``CASES`` (63: GQA groups 1/2/3/4/6/8/20, head dims 64/80/96/128/256, block sizes 16-2080,
  1-32 splits, lengths with partial pages, empty splits and a seq_len-0 padding row, all four
  presets, fp16 and bf16 queries, e4nv and e4b15 FP8 keys) the test compares:
  * which stage-1 kernel ran (grouped for groups > 1, upstream's for a group of one);
  * stage 1's ``mid_o`` (through ``mid_o_buf``, pre-filled with NaN): the same entries written,
    the split outputs and log-sum-exps within the bound below;
  * the decode output (stage 2 unchanged) within the bound below.
- Sensitivity: a kernel file whose head mapping is the classic GQA slip (query head h reads
  KV head h % Hk instead of h // group) must fail the same comparison.
- Ahead-of-time compile: the 27B image's selection on 0.33.0 compiles, with Triton 3.6 and
  its decode preset, ``_tq_grouped_decode_stage1`` (not ``_tq_decode_stage1``) for sm_86
  (e4b15 keys) and sm_90 (e4nv), and the build's self-check finds every launch.

Error bound, computed per case from its data (float64) rather than a fixed tolerance:
- scores: FP8 keys are exact in the query's 16-bit dtype, so only float32 summation order
  differs (``2 D 2**-24 sum|q k|``); MSE keys round the rotated query and the centroids to fp16
  (``(2**-10 + D 2**-23) norm scale sum|q c|``). Call the largest ``ds``.
- split outputs: ``p * v_scale`` rounded to fp16 (``2**-11 max(v_scale) (2**bits - 1)``, plus
  fp16 underflow ``seq_len (2**bits - 1) 2**-25``), plus the softmax weights moved by at most
  ``exp(2 ds) - 1`` of the value range; log-sum-exp: ``ds`` plus float32 rounding.
- decode output: the split-output bound, the merge weights moved by the LSE bound, plus one
  ulp of the output dtype at the output's magnitude (both round to fp16/bf16).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
import time
import types
from pathlib import Path

import libcst as cst
import pytest
import torch
from gpu_pn119 import (
    Counted,  # ci/gpu_pn119.py: the same counter on the GPU (ci/ is on the path: tests/__init__.py)
)
from packaging.version import Version

from kiln import paths
from kiln.definitions import load_definitions
from kiln.patch.engine import isolated_run, run_selection
from kiln.patch.model import BuildTarget, Verdict
from kiln.pins import load_pins
from kiln.triton.aot import KernelSources, compile_kernel_caches
from kiln.triton.toolchain import toolchain_for
from tests.patchsets.support import tq_interpret as tq
from tests.patchsets.support.patchlib import patched_files
from tests.support.registry import TOOLCHAIN_CACHE

TARGET = "v1/attention/ops/triton_turboquant_decode.py"
KERNEL = "v1/attention/ops/triton_turboquant_grouped_decode.py"
LABELS = ["v0.20.1", "v0.33.0"]
PRESET_BITS = {  # key bits (8 = FP8), value bits, norm correction: TurboQuantConfig's presets
    "turboquant_k8v4": (8, 4, False),
    "turboquant_4bit_nc": (4, 4, True),
    "turboquant_k3v4_nc": (3, 4, True),
    "turboquant_3bit_nc": (3, 3, True),
}


@pytest.mark.parametrize("label", LABELS)
def test_verdict_applies_and_adds_the_kernel_file(catalogue, sessions, label):
    session = sessions(label)
    outcome = isolated_run(catalogue, session, BuildTarget(session.tree.vllm_version), "PN119").outcomes["PN119"]
    assert outcome.verdict is Verdict.APPLIES, outcome.detail
    assert set(outcome.files) == {TARGET, KERNEL}
    assert outcome.files[KERNEL][0] is None and not session.tree.exists(KERNEL)


def test_upstream_grouped_stage1_retires_it(catalogue, sessions):
    session = sessions("v0.33.0")
    text = session.tree.read(TARGET)
    assert text.count("    _tq_decode_stage1[grid](") == 1
    grouped = text.replace("    _tq_decode_stage1[grid](", "    _tq_grouped_decode_stage1[grid](") + (
        "\n\n@triton.jit\ndef _tq_grouped_decode_stage1(Q_rot_ptr):\n    pass\n"
    )
    overlay = session.overlay({TARGET: cst.parse_module(grouped)})
    outcome = isolated_run(catalogue, overlay, BuildTarget(Version("0.33.0")), "PN119").outcomes["PN119"]
    assert outcome.verdict is Verdict.UPSTREAM
    assert "_tq_grouped_decode_stage1" in outcome.detail and "vllm#40792" in outcome.detail


def test_a_launch_without_a_reused_argument_is_drift(catalogue, sessions):
    session = sessions("v0.20.1")
    text = session.tree.read(TARGET)
    assert text.count("        KPS=key_packed_size,\n") == 1
    overlay = session.overlay({TARGET: cst.parse_module(text.replace("        KPS=key_packed_size,\n", ""))})
    outcome = isolated_run(catalogue, overlay, BuildTarget(Version("0.20.1")), "PN119").outcomes["PN119"]
    assert outcome.verdict is Verdict.DRIFTED
    assert "passes no KPS" in outcome.detail


# -- numerics: stock vs patched under the interpreter ------------------------------------------


def _cases() -> list[dict]:
    """72 shapes; each small enough for the interpreter (a few thousand programs at most)."""
    presets = list(PRESET_BITS)
    groups = (1, 2, 4, 6, 8)
    head_dims = (64, 128, 256)
    seqs = ([23, 5], [16, 1], [26, 0, 9], [9], [19, 12])
    blocks = (16, 32, 16, 64, 16)
    splits = (1, 2, 3, 4, 8)
    cases = []
    i = 0
    for preset in presets:
        for g, group in enumerate(groups):
            for d, head_dim in enumerate(head_dims[: 3 if group in (2, 6) or preset == presets[0] else 2]):
                k = (g + d + presets.index(preset)) % 5
                cases.append(dict(preset=preset, group=group, num_kv_heads=2 if group == 2 or (i % 3 == 0 and group < 8) else 1,
                                  head_dim=head_dim if group != 8 or head_dim != 256 else 128,
                                  block_size=blocks[k], splits=splits[k], seq_lens=seqs[(k + d) % 5],
                                  dtype="float16", e4b15=False, seed=i))
                i += 1
    extras = [  # shapes the grid above does not reach
        dict(preset="turboquant_k8v4", group=20, num_kv_heads=1, head_dim=64, block_size=16, splits=2,
             seq_lens=[21, 6]),  # two programs per KV head (16 + 4 query heads)
        dict(preset="turboquant_4bit_nc", group=20, num_kv_heads=1, head_dim=64, block_size=32, splits=2,
             seq_lens=[21]),
        dict(preset="turboquant_k8v4", group=4, num_kv_heads=2, head_dim=96, block_size=16, splits=2,
             seq_lens=[30, 3]),  # head dim below its power of two
        dict(preset="turboquant_k3v4_nc", group=2, num_kv_heads=2, head_dim=80, block_size=16, splits=4,
             seq_lens=[25]),
        dict(preset="turboquant_k8v4", group=6, num_kv_heads=2, head_dim=256, block_size=2080, splits=4,
             seq_lens=[30, 7]),  # the 27B's 0.33.0 block size: one partial page
        dict(preset="turboquant_k8v4", group=4, num_kv_heads=1, head_dim=128, block_size=16, splits=32,
             seq_lens=[40, 2]),  # vLLM's default split count: most splits empty for row 2
        dict(preset="turboquant_k8v4", group=3, num_kv_heads=2, head_dim=128, block_size=16, splits=2,
             seq_lens=[33, 8]),
        dict(preset="turboquant_4bit_nc", group=6, num_kv_heads=1, head_dim=256, block_size=16, splits=2,
             seq_lens=[19, 40], dtype="bfloat16"),
        dict(preset="turboquant_k8v4", group=4, num_kv_heads=2, head_dim=128, block_size=32, splits=3,
             seq_lens=[35, 7], dtype="bfloat16"),
        dict(preset="turboquant_k8v4", group=8, num_kv_heads=2, head_dim=256, block_size=16, splits=2,
             seq_lens=[17], dtype="bfloat16"),
        dict(preset="turboquant_k8v4", group=6, num_kv_heads=1, head_dim=128, block_size=16, splits=2,
             seq_lens=[26, 11], e4b15=True),  # the fp8 flavour below sm_89
        dict(preset="turboquant_k8v4", group=2, num_kv_heads=2, head_dim=64, block_size=32, splits=4,
             seq_lens=[40], e4b15=True),
    ]
    for extra in extras:
        cases.append({"dtype": "float16", "e4b15": False, "seed": i, **extra})
        i += 1
    for n, case in enumerate(cases):
        case["id"] = f"{n:02d}-{case['preset'][11:]}-g{case['group']}x{case['num_kv_heads']}-d{case['head_dim']}-" \
                     f"b{case['block_size']}-s{case['splits']}-{case['dtype'][:4]}{'-e4b15' if case['e4b15'] else ''}"
    return cases


CASES = _cases()
# Cases where a head mapping slip shows: groups of two or more over two or more KV heads.
MUTATED = [c for c in CASES if c["group"] > 1 and c["num_kv_heads"] > 1][:2]


def _mutated(kernel_text: str) -> str:
    """The kernel file with query head h reading KV head h % Hk (vLLM maps it to h // group)."""
    slip = "    head = in_group * (tl.num_programs(1) // HEAD_TILES) + kv_head\n"
    right = "    head = kv_head * KV_GROUP_SIZE + in_group\n"
    assert kernel_text.count(right) == 1
    return kernel_text.replace(right, slip)


@pytest.fixture(scope="module")
def numerics(catalogue, sessions, tmp_path_factory):
    """Every case under the interpreter (one subprocess per pin): stock and patched on the same cache."""
    where = tmp_path_factory.mktemp("pn119")
    jobs = []
    for n, label in enumerate(LABELS):
        session = sessions(label)
        changed = patched_files(catalogue, session, "PN119")
        stock = tq.write_root(session.tree, {}, where / label / "stock")
        patched = tq.write_root(session.tree, changed, where / label / "patched")
        # the cases alternate between the pins (stage 1 is the same on both; stage 2 differs)
        jobs += [dict(case, stock=stock, patched=patched, transposed=label == "v0.33.0", label=label)
                 for case in CASES[n::2]]
        if label == "v0.20.1":
            broken = tq.write_root(session.tree, {**changed, KERNEL: _mutated(changed[KERNEL])}, where / "broken")
            jobs += [dict(case, id="mutated-" + case["id"], stock=stock, patched=broken, transposed=False,
                          label=label) for case in MUTATED]
    repo = Path(__file__).resolve().parents[3]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    procs = []
    for label in LABELS:  # one interpreter process per pin, side by side (two cores)
        spec = where / f"{label}.json"
        spec.write_text(json.dumps([job for job in jobs if job["label"] == label]))
        with open(where / f"{label}.out", "w") as out, open(where / f"{label}.err", "w") as err:
            procs.append((label, subprocess.Popen(
                [sys.executable, "-c", f"from {__name__} import child_main; child_main()", str(spec)],
                cwd=repo, stdout=out, stderr=err, env=env)))
    results = {}
    for label, proc in procs:
        assert proc.wait(timeout=1200) == 0, (where / f"{label}.err").read_text()[-6000:]
        results.update(json.loads((where / f"{label}.out").read_text().strip().splitlines()[-1]))
    return results


def test_cases_cover_the_grid():
    assert len(CASES) >= 50
    assert {c["group"] for c in CASES} >= {1, 2, 4, 6, 8}
    assert {c["head_dim"] for c in CASES} >= {64, 128, 256}
    assert {c["preset"] for c in CASES} == set(PRESET_BITS)
    assert len({c["block_size"] for c in CASES}) >= 4 and len({c["splits"] for c in CASES}) >= 5
    assert any(c["seq_lens"][-1] % c["block_size"] for c in CASES)  # partial pages


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_patched_decode_matches_stock(numerics, case):
    result = numerics[case["id"]]
    grouped = case["group"] > 1
    assert result["patched_launched"] == ({"grouped": 1} if grouped else {"stock": 1}), result
    assert result["stock_launched"] == {"stock": 1}
    assert result["same_entries_written"] and result["same_nonfinite"], result
    assert result["written"] > 0 and result["max_abs_out"] > 0.1  # a non-trivial result
    for part in ("mid_o", "lse", "out"):
        assert result[f"{part}_err"] <= result[f"{part}_bound"], (part, result)
    if not grouped:  # upstream's kernel on both sides: the same bytes
        assert result["mid_o_err"] == result["lse_err"] == result["out_err"] == 0.0


def test_a_wrong_head_mapping_fails_the_comparison(numerics):
    mutated = {k: v for k, v in numerics.items() if k.startswith("mutated-")}
    assert len(mutated) == 2
    for result in mutated.values():
        assert result["patched_launched"] == {"grouped": 1}
        assert result["out_err"] > 10 * result["out_bound"], result


# -- ahead-of-time kernels ---------------------------------------------------------------------


@pytest.mark.parametrize("sm", [86, 90])
def test_images_selecting_it_compile_the_grouped_kernel_ahead_of_time(catalogue, sessions, tmp_path, sm):
    """The 27B image's selection on 0.33.0, compiled as its build does (Triton 3.6, stand-in driver):
    decode and continuation launches at head dim 256, 24/4 heads, block size 2080.

    sm_86 reads FP8 keys as e4b15, sm_90 as e4nv: both flavours of the grouped kernel compile,
    and the fresh-process self-check inside ``compile_kernel_caches`` finds every launch.
    """
    pins = load_pins(paths.PINS)
    definitions = {d.name: d for d in load_definitions(paths.IMAGES, catalogue, pins)
                   if not any(pin.cpu for pin in d.pins_of(pins))}  # the GPU images
    selecting = sorted(name for name, d in definitions.items() if "PN119" in d.patches)
    assert selecting == sorted(definitions)  # both shipped images: GQA presets (groups 6 and 8)
    image, pin = definitions["qwen3.6-27b-tq"], pins["v0.33.0"]
    session = sessions(pin.name)
    result = run_selection(catalogue, session, image.target(pin, sm), list(image.patches))
    assert result.outcomes["PN119"].verdict is Verdict.APPLIES
    sources = KernelSources(result.changed_text(), session.tree.root)
    toolchain = toolchain_for("3.6.0", "pn119", TOOLCHAIN_CACHE)
    # the decode launcher at the 0.33.0 block size only (the store kernel and 0.20.1's block size
    # do not touch what PN119 changes; tests/triton/test_shipped_presets.py compiles those)
    preset = dataclasses.replace(image.model.kernels, launchers=("turboquant_decode",), block_sizes=(2080,))
    compiled = compile_kernel_caches(preset, [sm], sources, toolchain, tmp_path, jobs=1)[sm]
    assert compiled.failures == []
    decode = {k["name"] for launch in compiled.launches if launch["kernel"] == "turboquant_decode"
              for k in launch["kernels"]}
    assert decode == {"_tq_grouped_decode_stage1", "_fwd_kernel_stage2"}, decode


# -- the child process ----------------------------------------------------------------------------


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Little-endian ``bits``-bit codes [..., n] -> bytes [..., ceil(n * bits / 8)]."""
    as_bits = ((codes.unsqueeze(-1) >> torch.arange(bits)) & 1).flatten(-2)
    pad = (-as_bits.shape[-1]) % 8
    as_bits = torch.nn.functional.pad(as_bits, (0, pad))
    return (as_bits.unflatten(-1, (-1, 8)) << torch.arange(8)).sum(-1).to(torch.uint8)


def _fp16_bytes(values: torch.Tensor) -> torch.Tensor:
    return values.half().unsqueeze(-1).view(torch.uint8)


class _Cache:
    """A TurboQuant cache of random valid slots, its block table, queries, and what bounds need."""

    def __init__(self, case: dict, centroids: torch.Tensor):
        gen = torch.Generator().manual_seed(case["seed"])
        key_bits, value_bits, self.norm_correction = PRESET_BITS[case["preset"]]
        d, hk, bs = case["head_dim"], case["num_kv_heads"], case["block_size"]
        self.key_fp8, self.value_bits = key_bits == 8, value_bits
        self.mse_bits = 0 if self.key_fp8 else key_bits
        mse_bytes = math.ceil(d * self.mse_bits / 8)
        self.key_packed_size = d if self.key_fp8 else mse_bytes + 2
        seq_lens = case["seq_lens"]
        blocks_per_req = max(1, -(-max(seq_lens) // bs))
        num_blocks = 1 + blocks_per_req * len(seq_lens)
        shape = (num_blocks, bs, hk)
        if self.key_fp8:
            if case["e4b15"]:  # no NaN/inf encodings: exponent field below all ones
                raw = torch.randint(0, 0x78, shape + (d,), generator=gen) | (torch.randint(0, 2, shape + (d,),
                                                                                        generator=gen) << 7)
                key = raw.to(torch.uint8)
                self.keys = _e4b15(key)
            else:
                self.keys = torch.randn(shape + (d,), generator=gen).to(torch.float8_e4m3fn)
                key = self.keys.view(torch.uint8)
                self.keys = self.keys.double()
        else:
            codes = torch.randint(0, 2**self.mse_bits, shape + (d,), generator=gen)
            unit = centroids.double()[codes]
            if self.norm_correction:
                unit = unit / unit.norm(dim=-1, keepdim=True)
            norms = (torch.rand(shape, generator=gen) + 0.5).half()
            key = torch.cat([_pack(codes, self.mse_bits), _fp16_bytes(norms)], -1)
            self.keys = unit * norms.double().unsqueeze(-1)  # in the rotated space
        vcodes = torch.randint(0, 2**value_bits, shape + (d,), generator=gen)
        v_scale = (torch.rand(shape, generator=gen) * 0.35 + 0.05).half()
        v_zero = torch.randn(shape, generator=gen).half()
        self.values = vcodes.double() * v_scale.double().unsqueeze(-1) + v_zero.double().unsqueeze(-1)
        self.max_v_scale = float(v_scale.double().max())
        slot = torch.cat([key, _pack(vcodes, value_bits), _fp16_bytes(v_scale), _fp16_bytes(v_zero)], -1)
        slot = torch.nn.functional.pad(slot, (0, slot.shape[-1] % 2))
        if case["transposed"]:  # 0.33.0's backend: allocated (blocks, Hk, block_size, slot), viewed transposed
            self.cache = slot.transpose(1, 2).contiguous().transpose(1, 2)
        else:
            self.cache = slot.contiguous()
        order = torch.randperm(num_blocks - 1, generator=gen) + 1  # block 0 is vLLM's null block
        self.block_table = order.view(len(seq_lens), blocks_per_req).to(torch.int32)
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
        dtype = getattr(torch, case["dtype"])
        self.query = (torch.randn(len(seq_lens), hk * case["group"], d, generator=gen) * 1.5).to(dtype)


def _e4b15(raw: torch.Tensor) -> torch.Tensor:
    """Triton's fp8e4b15 bytes as float64: sign, 4 exponent bits (bias 15), 3 mantissa bits."""
    raw = raw.long()
    sign = 1 - 2 * (raw >> 7)
    exponent, mantissa = (raw >> 3) & 0xF, raw & 0x7
    normal = (1 + mantissa / 8) * torch.pow(2.0, (exponent - 15).double())
    subnormal = (mantissa / 8) * 2.0**-14
    return (sign * torch.where(exponent > 0, normal, subnormal)).double()


def _bounds(case: dict, data: _Cache, q_used: torch.Tensor, out: torch.Tensor) -> dict:
    """The a-priori error bounds of the module docstring, for this case's data."""
    d, group = case["head_dim"], case["group"]
    scale = d**-0.5
    worst = 0.0
    v_lo, v_hi = math.inf, -math.inf
    for b, seq_len in enumerate(data.seq_lens.tolist()):
        if not seq_len:
            continue
        pos = torch.arange(seq_len)
        blocks = data.block_table[b, pos // case["block_size"]].long()
        keys = data.keys[blocks, pos % case["block_size"]].repeat_interleave(group, dim=1)  # [L, Hq, D]
        values = data.values[blocks, pos % case["block_size"]]
        v_lo, v_hi = min(v_lo, float(values.min())), max(v_hi, float(values.max()))
        worst = max(worst, float(torch.einsum("hd,lhd->hl", q_used[b].abs(), keys.abs()).max()) * scale)
    if data.key_fp8:
        ds = 2 * d * 2.0**-24 * worst
    else:
        ds = (2.0**-10 + d * 2.0**-23) * worst
    levels = 2**data.value_bits - 1
    v_range = v_hi - v_lo
    mid_o = 2.0**-11 * data.max_v_scale * levels + max(case["seq_lens"]) * levels * 2.0**-25
    mid_o += math.expm1(2 * ds) * v_range
    lse = ds + 1e-6
    ulp = 2.0**-10 if case["dtype"] == "float16" else 2.0**-7
    finite = out[torch.isfinite(out)]
    out_bound = mid_o + math.expm1(2 * lse) * v_range + ulp * float(finite.abs().max())
    return {"mid_o_bound": mid_o * 1.01 + 1e-6, "lse_bound": lse * 1.01 + 1e-6, "out_bound": out_bound * 1.01 + 1e-6}


def _load(root: str, mp) -> types.ModuleType:
    """The decode module of ``root`` (stock or patched) with its imports, loaded once."""
    files = {p.relative_to(Path(root) / "vllm").as_posix(): p.read_text()
             for p in (Path(root) / "vllm").rglob("*.py")}
    return tq.load_ops(files, Path(root) / "loaded", mp).triton_turboquant_decode


def _run(decode, case: dict, data: _Cache, centroids, pi) -> tuple[dict, torch.Tensor, torch.Tensor]:
    counts: dict = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(decode, "_tq_decode_stage1", Counted(decode._tq_decode_stage1, "stock", counts))
        if hasattr(decode, "tq_grouped_decode_stage1"):
            mp.setattr(decode, "tq_grouped_decode_stage1",
                       Counted(decode.tq_grouped_decode_stage1, "grouped", counts))
        mp.setitem(decode._FP8_E4B15, 0, 1 if case["e4b15"] else 0)
        b, hq, d = data.query.shape
        mid_o = torch.full((b, hq, case["splits"], d + 1), float("nan"))
        out = decode.triton_turboquant_decode_attention(
            query=data.query, kv_cache=data.cache, block_table=data.block_table, seq_lens=data.seq_lens, Pi=pi,
            centroids=centroids, scale=d**-0.5, mse_bits=data.mse_bits, key_packed_size=data.key_packed_size,
            value_quant_bits=data.value_bits, key_fp8=data.key_fp8, norm_correction=data.norm_correction,
            PiT=pi.T.contiguous(), mid_o_buf=mid_o, max_num_kv_splits=case["splits"],
        )
    return counts, mid_o, out


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    both = torch.isfinite(a) & torch.isfinite(b)
    if not bool(both.any()):
        return 0.0
    return float((a[both].double() - b[both].double()).abs().max())


def _centroids(head_dim: int, bits: int) -> torch.Tensor:
    """A sorted table of ``2**bits`` centroids at the scale of a unit vector's coordinates.

    Gaussian quantiles over ``sqrt(head_dim)`` stand in for the tree's Lloyd-Max solve, which
    takes seconds per shape on CPU; both kernels only gather from the table.
    """
    levels = (torch.arange(2**bits, dtype=torch.float64) + 0.5) / 2**bits
    return (torch.distributions.Normal(0.0, 1.0).icdf(levels) / math.sqrt(head_dim)).float()


def _rotation(head_dim: int) -> torch.Tensor:
    """An orthogonal ``Pi``: the Hadamard matrix vLLM builds, or a fixed random one off powers of two."""
    if head_dim & (head_dim - 1) == 0:
        return tq.hadamard(head_dim)
    q, _ = torch.linalg.qr(torch.randn(head_dim, head_dim, generator=torch.Generator().manual_seed(head_dim)))
    return q.float()


def _child_case(case: dict, stock, patched) -> dict:
    d = case["head_dim"]
    key_bits, value_bits, _ = PRESET_BITS[case["preset"]]
    centroids = _centroids(d, value_bits if key_bits == 8 else key_bits)
    data = _Cache(case, centroids)
    pi = _rotation(d)
    stock_counts, stock_mid, stock_out = _run(stock, case, data, centroids, pi)
    patched_counts, patched_mid, patched_out = _run(patched, case, data, centroids, pi)
    written = ~torch.isnan(stock_mid)
    q_used = data.query.double() if data.key_fp8 else data.query.double() @ pi.double().T
    result = {
        "stock_launched": stock_counts,
        "patched_launched": patched_counts,
        "same_entries_written": bool(torch.equal(written, ~torch.isnan(patched_mid))),
        "written": int(written[..., 0].sum()),
        "mid_o_err": _max_diff(stock_mid[..., :d], patched_mid[..., :d]),
        "lse_err": _max_diff(stock_mid[..., d], patched_mid[..., d]),
        "out_err": _max_diff(stock_out, patched_out),
        "same_nonfinite": bool(torch.equal(torch.isfinite(stock_out), torch.isfinite(patched_out))),
        "max_abs_out": float(stock_out[torch.isfinite(stock_out)].abs().max()),
    }
    result.update(_bounds(case, data, q_used, stock_out.double()))
    return result


def child_main() -> None:
    """Entry of the interpreter subprocess: ``TRITON_INTERPRET=1`` is set in its environment."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    jobs = json.loads(Path(sys.argv[1]).read_text())
    modules: dict = {}
    for root in sorted({job[side] for job in jobs for side in ("stock", "patched")}):
        with pytest.MonkeyPatch.context() as mp:  # the loaded modules keep what they imported
            modules[root] = _load(root, mp)
    results = {}
    for job in jobs:
        started = time.process_time()
        results[job["id"]] = _child_case(job, modules[job["stock"]], modules[job["patched"]])
        results[job["id"]]["cpu_s"] = time.process_time() - started
    print(json.dumps(results))
