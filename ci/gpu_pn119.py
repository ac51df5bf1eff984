"""PN119 on a GPU: vLLM's TurboQuant decode, stock against PN119's grouped stage 1, compiled by Triton.

Run by ``ci/gpu_check.py --run-bundle`` (``ci/gpu_bundle.py``) in a fresh process; the CPU proof
is ``tests/patchsets/attention_turboquant/test_pn119.py`` (63 shapes under Triton's interpreter,
with error bounds derived per case). Here both launchers are loaded from the bundle (``stock/``
and ``src/``: the same files with and without the image's patches) and, for every case:

1. a TurboQuant cache is filled by vLLM's own store kernel from random keys and values (random
   block order, random rotation ``Pi`` and sorted centroids for the MSE presets);
2. stock and patched decode the same queries; the comparison is the largest absolute difference
   of the outputs (``TOLERANCE``; a query head reading the wrong KV head moves the output by O(1));
   which stage-1 kernel ran on each side is counted (grouped for groups > 1, upstream's for 1);
3. k8v4 cases are also compared with ``gpu_check``'s PyTorch reference (reported);
4. ``bench`` cases (the shipped images' attention shapes) are timed with ``triton.testing.do_bench``
   (median), stock and patched interleaved over ``ROUNDS`` rounds; the median of the rounds and
   the ratio are reported.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DECODE = "vllm.v1.attention.ops.triton_turboquant_decode"
STORE = "vllm.v1.attention.ops.triton_turboquant_store"
TOLERANCE = 2e-2
ROUNDS = 5


def cases(preset: dict, kernel_block_sizes: list[int], grid: bool = True) -> list[dict]:
    """A grid over the presets' key/value formats, GQA groups and head dims (``grid``), and the bench shapes."""
    seed = 0
    chosen = []
    for kv_preset in ("turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc") if grid else ():
        for hq, hk in ((8, 8), (8, 4), (16, 4), (24, 4), (16, 2), (40, 2)):
            for d in (128, 256):
                if kv_preset == "turboquant_k3v4_nc" and d == 128:
                    continue
                chosen.append(dict(kv_preset=kv_preset, hq=hq, hk=hk, d=d, block_size=(16, 32)[seed % 2],
                                 seq_lens=[1, 37, 517, 2050][: 2 + seed % 3], splits=(8, 32, 3)[seed % 3],
                                 dtype=("float16", "bfloat16")[seed % 4 == 3], seed=seed))
                seed += 1
    # the image's own attention shape at each kernel block size the runtime uses: numerics at long
    # contexts, and the timings
    for kernel_block_size in kernel_block_sizes:
        for batch, context in ((b, c) for b in (1, 4) for c in (4096, 32768, 131072)):
            chosen.append(dict(kv_preset=preset["kv_cache_dtype"], hq=preset["num_heads"], hk=preset["num_kv_heads"],
                               d=preset["head_dim"], block_size=kernel_block_size, seq_lens=[context] * batch,
                               splits=preset["max_num_kv_splits"], dtype=preset["dtype"], seed=seed, bench=True))
            seed += 1
    return chosen


def kernel_block_sizes(job: dict) -> list[int]:
    """The block sizes the decode kernel sees at run time (the plan's, ``kiln/triton/runtime_layout.py``)."""
    return sorted({launch["params"]["kernel_block_size"] for launch in job["launches"] if launch["builder"] == "decode"})


def compare(bundle: Path, job: dict, work: Path, grid: bool = True) -> dict:
    """Run the child on the GPU (its files in ``work``); its report (``ok``, ``summary``, per-case results)."""
    preset = dict(job["preset"], kv_cache_dtype=job["kv_cache_dtype"])
    spec = {"stock": str(bundle / "stock"), "patched": str(bundle / "src"), "sm": job["sm"],
            "cases": cases(preset, kernel_block_sizes(job), grid)}
    spec_path = work / "pn119.json"
    spec_path.write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_CACHE_DIR"}
    env["TRITON_CACHE_DIR"] = str(work / "pn119-triton")  # its own, never the image's
    from kiln import lifeline

    proc = lifeline.run([sys.executable, __file__, str(spec_path)], env=env)  # dies with us, SIGKILL too
    if proc.returncode != 0:
        return {"ok": False, "summary": f"the comparison failed: {proc.stderr.strip()[-2000:]}"}
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    numerics = [r for r in results if "error" not in r]
    broken = [r for r in results if "error" in r or not r["ok"]]
    worst = max((r["max_abs_diff"] for r in numerics), default=float("nan"))
    timed = [r for r in numerics if "stock_ms" in r]
    speed = ", ".join(f"{r['hq']}/{r['hk']}x{r['d']} b{len(r['seq_lens'])} ctx {r['seq_lens'][0]}: "
                      f"{r['stock_ms']:.3f} -> {r['patched_ms']:.3f} ms ({r['speedup']:.2f}x)" for r in timed)
    summary = (f"{len(numerics) - len([r for r in numerics if not r['ok']])}/{len(results)} cases within "
               f"{TOLERANCE} (largest difference {worst:.2e}); {speed}")
    return {"ok": not broken, "summary": summary, "cases": results}


# -- the child (on the GPU) ------------------------------------------------------------------------


class Counted:
    """A kernel (``kernel[grid](...)``) or a launcher, counting its calls under ``name`` in ``counts``
    (also PN119's CPU test's: ``tests/patchsets/attention_turboquant/test_pn119.py``)."""

    def __init__(self, real, name: str, counts: dict):
        self.real, self.name, self.counts = real, name, counts

    def __getitem__(self, grid):
        self.counts[self.name] = self.counts.get(self.name, 0) + 1
        return self.real[grid]

    def __call__(self, *args, **kwargs):
        self.counts[self.name] = self.counts.get(self.name, 0) + 1
        return self.real(*args, **kwargs)


def _load(root: str, sm: int):
    import importlib
    import types

    from kiln.triton import worker

    for name in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]:
        del sys.modules[name]
    worker.install_vllm([root], [DECODE, STORE, worker.TQ_CONFIG])
    decode = importlib.import_module(DECODE)
    worker.force_fp8_flavour(sm)
    counts: dict = {}
    for name in ("_tq_decode_stage1", "tq_grouped_decode_stage1"):
        if name in decode.__dict__:
            decode.__dict__[name] = Counted(decode.__dict__[name], name, counts)
    return types.SimpleNamespace(
        decode=decode.triton_turboquant_decode_attention, counts=counts,
        store=importlib.import_module(STORE).triton_turboquant_store,
        config=importlib.import_module(worker.TQ_CONFIG).TurboQuantConfig)


def _run_case(case: dict, stock, patched, device: str = "cuda") -> dict:
    """One case on ``device`` ("cpu" only under ``TRITON_INTERPRET=1``: the machinery's own test)."""
    import torch
    from gpu_reference import dequantise_k8v4, reference_decode

    cfg = stock.config.from_cache_dtype(case["kv_preset"], case["d"])
    d, hq, hk, bs = case["d"], case["hq"], case["hk"], case["block_size"]
    dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16}[case["dtype"]]
    gen = torch.Generator(device=device).manual_seed(case["seed"])
    seq_lens = case["seq_lens"]
    per_seq = max(1, math.ceil(max(seq_lens) / bs))
    blocks = 1 + per_seq * len(seq_lens)
    table = (torch.randperm(blocks - 1, device=device, generator=gen) + 1).reshape(len(seq_lens), per_seq).int()
    cache = torch.zeros(blocks, bs, hk, cfg.slot_size_aligned, dtype=torch.uint8, device=device)
    pi = torch.linalg.qr(torch.randn(d, d, device=device, generator=gen))[0].float().contiguous()
    centroids = (torch.randn(cfg.n_centroids, device=device, generator=gen) / math.sqrt(d)).sort().values
    for row, length in enumerate(seq_lens):
        t = torch.arange(length, device=device)
        slots = (table[row, t // bs].long() * bs + t % bs)
        keys = torch.randn(length, hk, d, device=device, dtype=dtype, generator=gen)
        values = torch.randn(length, hk, d, device=device, dtype=dtype, generator=gen)
        stock.store(keys, values, cache, slots, pi, (centroids[:-1] + centroids[1:]) / 2,
                    mse_bits=cfg.key_mse_bits, key_packed_size=cfg.key_packed_size,
                    value_quant_bits=cfg.effective_value_quant_bits, key_fp8=cfg.key_fp8)
    query = torch.randn(len(seq_lens), hq, d, device=device, dtype=dtype, generator=gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    splits, rows = case["splits"], len(seq_lens)

    def launcher(side):
        buffers = dict(mid_o_buf=torch.empty(rows, hq, splits, d + 1, device=device),
                       output_buf=torch.empty(rows, hq, d, device=device), lse_buf=torch.empty(rows, hq, device=device))
        return lambda: side.decode(
            query=query, kv_cache=cache, block_table=table, seq_lens=lens, Pi=pi, centroids=centroids,
            scale=1.0 / math.sqrt(d), mse_bits=cfg.key_mse_bits, key_packed_size=cfg.key_packed_size,
            value_quant_bits=cfg.effective_value_quant_bits, key_fp8=cfg.key_fp8,
            norm_correction=cfg.norm_correction, PiT=pi.T.contiguous(), max_num_kv_splits=splits, **buffers)

    runs = {"stock": launcher(stock), "patched": launcher(patched)}
    stock.counts.clear()
    patched.counts.clear()
    out = {name: run().float().clone() for name, run in runs.items()}
    if device == "cuda":
        torch.cuda.synchronize()
    result = {k: case[k] for k in ("kv_preset", "hq", "hk", "d", "block_size", "seq_lens", "splits", "dtype")}
    result.update(stock_launched=dict(stock.counts), patched_launched=dict(patched.counts))
    finite = torch.isfinite(out["stock"]) & torch.isfinite(out["patched"])
    result["max_abs_diff"] = float((out["stock"] - out["patched"])[finite].abs().max())
    result["max_abs_out"] = float(out["stock"][finite].abs().max())
    result["same_nonfinite"] = bool(torch.equal(torch.isfinite(out["stock"]), torch.isfinite(out["patched"])))
    grouped = hq // hk > 1
    want = {"tq_grouped_decode_stage1": 1} if grouped else {"_tq_decode_stage1": 1}
    result["ok"] = (result["max_abs_diff"] <= TOLERANCE and result["same_nonfinite"]
                    and result["stock_launched"] == {"_tq_decode_stage1": 1} and result["patched_launched"] == want)
    if cfg.key_fp8 and max(seq_lens) <= 4096:  # the independent reference (gpu_check's), k8v4 only
        errors = []
        for row, length in enumerate(seq_lens):
            t = torch.arange(length, device=device)
            slots = cache[table[row, t // bs].long(), t % bs]  # [T, Hk, slot]
            k_ref, v_ref = dequantise_k8v4(slots.unsqueeze(0), d)
            want_out = reference_decode(query[row:row + 1], k_ref, v_ref, 1.0 / math.sqrt(d))[0]
            errors.append(max(float((out[s][row] - want_out).abs().max()) for s in out))
        result["max_abs_vs_reference"] = max(errors)
    if case.get("bench") and device == "cuda":
        from triton.testing import do_bench

        times = {"stock": [], "patched": []}
        for r in range(ROUNDS):
            for name in (("stock", "patched") if r % 2 == 0 else ("patched", "stock")):
                times[name].append(do_bench(runs[name], warmup=10, rep=60, return_mode="median"))
        result["stock_ms"] = statistics.median(times["stock"])
        result["patched_ms"] = statistics.median(times["patched"])
        result["speedup"] = result["stock_ms"] / result["patched_ms"]
        result["rounds_ms"] = times
    return result


def child_main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    stock = _load(spec["stock"], spec["sm"])
    patched = _load(spec["patched"], spec["sm"])
    results = []
    for case in spec["cases"]:
        try:
            results.append(_run_case(case, stock, patched, spec.get("device", "cuda")))
        except Exception as err:  # a case that cannot run is a failed case, named
            results.append({**case, "error": f"{type(err).__name__}: {str(err)[:500]}"})
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1]))
