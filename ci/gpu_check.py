#!/usr/bin/env python3
"""On a GPU: does the ahead-of-time kernel cache kiln built load, with 0 compiles, and compute right?
And (``--step serve``) how fast and how clean is kiln's patched vLLM when it serves a model?

Not run by CI (CI has no GPU). The kernel step ran on an H200 on 2026-11-26 through a bundle
(``--bundle`` here, ``--run-bundle`` there: ``ci/gpu_bundle.py``); the served-model step has not
run on a GPU. See docs/TRITON.md, docs/BENCH.md and docs/BENCHMARKS.md (section ``gpu``).

    .venv/bin/python ci/gpu_check.py [--image qwen3.6-27b-tq] [--sm 90] [--cache DIR] [--json]
    .venv/bin/python ci/gpu_check.py --step serve [--model DIR] [--overlay DIR --against-stock]
    .venv/bin/python ci/gpu_check.py --step all ...      # the kernels, then the served model

The served-model step is ``ci/gpu_serve.py`` (its docstring says what it does). The kernel
steps (``--step kernels``, the default):
1. Build (or reuse from the kiln cache) the SM's kernel cache on this machine with the
   stand-in driver, exactly as ``build.py build`` does — or take ``--cache DIR``, a cache as
   an image holds it (e.g. ``opt/kiln/triton-cache`` extracted from the image's top layer).
2. In a fresh process on the real GPU (torch + Triton's own CUDA driver): point
   ``TRITON_CACHE_DIR`` at a copy of that cache (group files mapped to the copy), load the same
   patched vLLM kernel files, and run the same launches with CUDA tensors; count compiles
   with ``triton.knobs.compilation.listener`` (must be 0).
3. Numerics (k8v4 presets): store random keys/values with vLLM's ``triton_turboquant_store``,
   decode with ``triton_turboquant_decode_attention``, and compare with a PyTorch reference
   that dequantises the cache bytes itself (fp8 e4m3 keys, 4-bit values with fp16 scale/zero)
   and runs grouped-query attention. Exit 0 only when there were 0 compiles and every
   comparison is within tolerance; 1 otherwise; 2 when the machine cannot run the check.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path

from gpu_reference import (  # ci/, beside this script
    dequantise_k8v4,
    print_kernel_report,
    reference_decode,
)

REPO = Path(__file__).resolve().parent.parent

TOLERANCE = 2e-2  # fp8 keys and 4-bit values are quantised identically on both sides


# -- the GPU side (a fresh process) --------------------------------------------------------------


def gpu_main(job_path: str) -> int:
    job = json.loads(Path(job_path).read_text())
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible to torch", file=sys.stderr)
        return 2
    major, minor = torch.cuda.get_device_capability(0)
    if major * 10 + minor != job["sm"]:
        print(f"gpu_check: this GPU is sm_{major}{minor}, the cache was built for sm_{job['sm']}", file=sys.stderr)
        return 2
    import triton

    from kiln.triton import worker  # stand-in vLLM modules and the launch builders

    compiles, hits = [], []
    triton.knobs.compilation.listener = lambda *, src, metadata, metadata_group, times, cache_hit: (
        hits if cache_hit else compiles).append(metadata["name"])
    worker.install_vllm(job["roots"], [launch["module"] for launch in job["launches"]] + [worker.TQ_CONFIG])
    worker.use_device("cuda")
    import importlib

    for launch in job["launches"]:
        module = importlib.import_module(launch["module"])
        worker.force_fp8_flavour(job["sm"])
        try:
            worker.BUILDERS[launch["builder"]](getattr(module, launch["function"]), job["preset"], launch["params"])
        except Exception as err:  # the known sm_86 bf16 limitation fails here as at build time
            print(f"launch {launch['kernel']} {launch['params']}: {type(err).__name__}")
    torch.cuda.synchronize()
    report = {"gpu": torch.cuda.get_device_name(0), "compiles": compiles, "hits": len(hits), "numerics": []}
    preset = job["preset"]
    for kv_preset in preset["kv_cache_presets"]:
        if kv_preset != "turboquant_k8v4":
            report["numerics"].append({"kv_preset": kv_preset, "skipped": "reference covers k8v4 only"})
            continue
        # the kernel block sizes the runtime cuts from the manager's (the plan's decode launches)
        for block_size in sorted({launch["params"]["kernel_block_size"] for launch in job["launches"]
                                  if launch["builder"] == "decode"}):
            report["numerics"].append(_numerics(preset, kv_preset, block_size))
    Path(job["report"]).write_text(json.dumps(report))
    return 0


def _numerics(preset: dict, kv_preset: str, block_size: int) -> dict:
    import importlib

    import torch

    store = importlib.import_module("vllm.v1.attention.ops.triton_turboquant_store").triton_turboquant_store
    decode = importlib.import_module(
        "vllm.v1.attention.ops.triton_turboquant_decode").triton_turboquant_decode_attention
    cfg = importlib.import_module("vllm.model_executor.layers.quantization.turboquant.config") \
        .TurboQuantConfig.from_cache_dtype(kv_preset, preset["head_dim"])
    d, hq, hk = preset["head_dim"], preset["num_heads"], preset["num_kv_heads"]
    dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16}[preset["dtype"]]
    torch.manual_seed(0)
    seqs, tokens = preset["max_num_seqs"], min(block_size, 200)
    cache = torch.zeros(seqs, block_size, hk, cfg.slot_size_aligned, dtype=torch.uint8, device="cuda")
    keys = torch.randn(seqs, tokens, hk, d, device="cuda", dtype=dtype)
    values = torch.randn(seqs, tokens, hk, d, device="cuda", dtype=dtype)
    slots = (torch.arange(seqs, device="cuda")[:, None] * block_size + torch.arange(tokens, device="cuda")).reshape(-1)
    eye = torch.eye(d, device="cuda")
    store(keys.reshape(-1, hk, d), values.reshape(-1, hk, d), cache, slots.to(torch.int64), eye,
          torch.zeros(cfg.n_centroids - 1, device="cuda"), mse_bits=cfg.key_mse_bits,
          key_packed_size=cfg.key_packed_size, value_quant_bits=cfg.effective_value_quant_bits, key_fp8=cfg.key_fp8)
    blocks_per_req = math.ceil(preset["max_model_len"] / block_size)
    table = torch.zeros(seqs, blocks_per_req, dtype=torch.int32, device="cuda")
    table[:, 0] = torch.arange(seqs, dtype=torch.int32, device="cuda")
    query = torch.randn(seqs, hq, d, device="cuda", dtype=dtype)
    splits = preset["max_num_kv_splits"]
    out = decode(query=query, kv_cache=cache, block_table=table,
                 seq_lens=torch.full((seqs,), tokens, dtype=torch.int32, device="cuda"), Pi=eye,
                 centroids=torch.zeros(cfg.n_centroids, device="cuda"), scale=1.0 / math.sqrt(d),
                 mse_bits=cfg.key_mse_bits, key_packed_size=cfg.key_packed_size,
                 value_quant_bits=cfg.effective_value_quant_bits, key_fp8=cfg.key_fp8,
                 norm_correction=cfg.norm_correction, PiT=eye,
                 mid_o_buf=torch.empty(seqs, hq, splits, d + 1, device="cuda"),
                 output_buf=torch.empty(seqs, hq, d, device="cuda"), lse_buf=torch.empty(seqs, hq, device="cuda"),
                 max_num_kv_splits=splits)
    k_ref, v_ref = dequantise_k8v4(cache[:, :tokens], d)
    want = reference_decode(query, k_ref, v_ref, 1.0 / math.sqrt(d))
    error = (out.float() - want).abs().max().item()
    return {"kv_preset": kv_preset, "block_size": block_size, "max_abs_error": error, "ok": error <= TOLERANCE}


# -- the driver (this machine) -------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    import gpu_serve

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--step", choices=("kernels", "serve", "all"), default="kernels",
                        help="the kernel cache check, the served-model bench, or both (default: %(default)s)")
    parser.add_argument("--image", default="qwen3.6-27b-tq", help="image definition whose [model.kernels] to check")
    parser.add_argument("--sm", type=int, default=90, help="the GPU's SM (H100: 90)")
    parser.add_argument("--cache", type=Path, help="a built cache (as in the image) instead of building it here")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--pin", help="with --bundle: the pin whose source is built (default: the image's first)")
    parser.add_argument("--bundle", type=Path, metavar="DIR",
                        help="build here a self-contained kernel check for a GPU machine with no network, into DIR "
                             "(new or empty); run it there with --run-bundle DIR")
    parser.add_argument("--gpu-triton-record", type=Path, metavar="RECORD",
                        help="with --bundle: the dist-info RECORD of the GPU machine's Triton (its version and "
                             "libtriton.so key the cache, as the image's RECORD does in a build)")
    parser.add_argument("--gpu-python", default="3.12", help="with --bundle: the GPU machine's Python (default: %(default)s)")
    parser.add_argument("--run-bundle", type=Path, metavar="DIR", help="on the GPU machine: run a --bundle DIR")
    parser.add_argument("--pn119", choices=("all", "bench", "none"), default="all",
                        help="with --run-bundle: PN119's stock-against-grouped grid and timings, the timings "
                             "alone, or neither (default: %(default)s)")
    parser.add_argument("--p103", choices=("run", "none"), default="run",
                        help="with --run-bundle: P103's stock-against-windowed GDN prefill when the selection carries "
                             "it, or not (default: %(default)s)")
    parser.add_argument("--bench-doc", type=Path, nargs="+", metavar="REPORT",
                        help="write docs/BENCHMARKS.md's gpu section from --run-bundle --json reports")
    parser.add_argument("--gpu-job", help=argparse.SUPPRESS)  # the fresh GPU process
    gpu_serve.add_arguments(parser)
    args = parser.parse_args(argv)
    if args.gpu_job:
        return gpu_main(args.gpu_job)
    if args.bench_doc:
        import gpu_bundle

        return gpu_bundle.write_bench_doc(args.bench_doc)
    if args.bundle:
        import gpu_bundle

        return gpu_bundle.write_bundle(args)
    if args.run_bundle:
        import gpu_bundle

        return gpu_bundle.run_bundle(args)
    if args.step == "serve":
        return gpu_serve.run_step(args)
    code = kernel_check(args)
    if args.step == "all" and code != 2:
        code = max(code, gpu_serve.run_step(args))
    return code


def kernel_check(args) -> int:
    from kiln.cache import cache_root
    from kiln.paths import RepoFiles
    from kiln.triton import aot
    from kiln.triton.kernels import RUNTIME_CACHE_DIR, launch_plan
    from kiln.triton.toolchain import toolchain_for
    from kiln.verify import patched_source

    # the image's first pin (ImageDefinition.pins_of), its selection as a build applies it
    patched = patched_source(RepoFiles(), args.image, args.sm)
    definition, tree = patched.inputs.definition, patched.tree
    preset = definition.model.kernels
    if preset is None:
        print(f"gpu_check: {definition.path} declares no [model.kernels]", file=sys.stderr)
        return 2
    sources = aot.KernelSources(patched.changed, tree.root)
    import triton

    toolchain = toolchain_for(triton.__version__, definition.name, cache_root())
    if args.cache:
        built_root = args.cache
    else:
        built_root = aot.compile_kernel_caches(preset, [args.sm], sources, toolchain, cache_root())[args.sm].root
    staged, _ = aot.stage_sources(preset, sources)
    with tempfile.TemporaryDirectory(prefix="kiln-gpu-check-") as tmp:
        copy = Path(tmp) / "cache"
        shutil.copytree(built_root, copy)
        aot.rewrite_group_prefix(copy, RUNTIME_CACHE_DIR, str(copy))
        job = {"sm": args.sm, "roots": [str(staged)], "preset": preset.to_json(), "launches": launch_plan(preset, sources.runtime_layout()),
               "report": str(Path(tmp) / "report.json")}
        (Path(tmp) / "job.json").write_text(json.dumps(job))
        env = {**os.environ, "TRITON_CACHE_DIR": str(copy)}
        env.pop("TRITON_STORE_BINARY_ONLY", None)
        from kiln import lifeline  # the child dies with this process, SIGKILL too

        proc = lifeline.run([sys.executable, __file__, "--gpu-job", str(Path(tmp) / "job.json")], env=env)
        sys.stderr.write(proc.stdout + proc.stderr)  # stdout may be --json
        if proc.returncode != 0:
            return proc.returncode
        report = json.loads((Path(tmp) / "report.json").read_text())
    ok = not report["compiles"] and all(n.get("ok", True) for n in report["numerics"])
    report["ok"] = ok
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_kernel_report(report, f"sm_{args.sm}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
