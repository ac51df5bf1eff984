#!/usr/bin/env python3
"""Benchmark: the ahead-of-time Triton kernel cache of an image, for its four SMs.

Issue 5's goals, written to the ``triton`` section of docs/BENCHMARKS.md:
  * compile time for the image's kernel set x 4 SMs (86, 89, 90, 120) with 2 worker processes:
    <= 20 s cold (empty kiln cache: compile + fresh-process self-check per SM), <= 1 s when all
    entries are cached;
  * the cache layer's size per SM (gzip and uncompressed; binaries only: TRITON_STORE_BINARY_ONLY).

Sources: the real vLLM 0.20.1 wheel (kiln's WheelSource), patched with the image's patch
selection exactly as a build does; the toolchain is Triton 3.6.0 (what the pinned base
carries), fetched once into the user's kiln cache as a build fetches it (not timed: "cold"
means an empty kernel cache). First-launch time with and without the cache needs a GPU: not
measured.

    .venv/bin/python ci/bench_triton.py [--image qwen3.6-27b-tq] [--jobs 2]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from benchlib import machine, write_section

from kiln.cache import cache_root
from kiln.oci.layer import LayerBuilder
from kiln.paths import RepoFiles
from kiln.triton.aot import KernelSources, compile_kernel_caches, kernel_cache_files
from kiln.triton.toolchain import toolchain_for
from kiln.verify import patched_source

SMS = [86, 89, 90, 120]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--image", default="qwen3.6-27b-tq")
    parser.add_argument("--jobs", type=int, default=2, help="worker processes (the goal is stated for 2 cores)")
    args = parser.parse_args()

    # the image's first pin (ImageDefinition.pins_of), its selection as a build applies it
    patched = patched_source(RepoFiles(), args.image, SMS[-1])
    definition, pin, tree = patched.inputs.definition, patched.inputs.pin, patched.tree
    preset = definition.model.kernels
    if preset is None:
        sys.exit(f"{definition.path}: declares no [model.kernels]")
    sources = KernelSources(patched.changed, tree.root)

    toolchain = toolchain_for("3.6.0", definition.name, cache_root())  # fetched once, kept
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="kiln-bench-triton-") as tmp:
        cache = Path(tmp) / "cache"
        start = time.perf_counter()
        cold = compile_kernel_caches(preset, SMS, sources, toolchain, cache, jobs=args.jobs)
        cold_s = time.perf_counter() - start
        start = time.perf_counter()
        warm = compile_kernel_caches(preset, SMS, sources, toolchain, cache, jobs=args.jobs)
        warm_s = time.perf_counter() - start
        assert all(warm[sm].cached for sm in SMS)
        rows = []
        for sm in SMS:
            files = kernel_cache_files(cold[sm], toolchain, preset)
            builder = LayerBuilder()
            for path, data in files.items():
                builder.add_file(path, data)
            layer = builder.write(Path(tmp) / f"layer-{sm}")
            kernels = len({k["hash"] for launch in cold[sm].launches for k in launch["kernels"]})
            missing = ", ".join(f["kernel"] for f in cold[sm].failures) or "-"
            rows.append(f"| sm_{sm} | {kernels} | {cold[sm].seconds:.1f} | {layer.size / 1024:.0f} KiB | "
                        f"{layer.uncompressed_size / 1024:.0f} KiB | {missing} |")

    verdict = lambda ok: "met" if ok else "NOT met"  # noqa: E731
    load = os.getloadavg()
    loads = f"{'/'.join(f'{x:.2f}' for x in load_before)} before, {'/'.join(f'{x:.2f}' for x in load)} after"
    body = f"""
## triton (issue 5)

`ci/bench_triton.py` — the `{definition.name}` image's Triton kernel set ({", ".join(preset.launchers)};
head dim {preset.head_dim}, {preset.num_heads}/{preset.num_kv_heads} heads, {preset.dtype}, block
size(s) {", ".join(map(str, preset.block_sizes))}, {", ".join(preset.kv_cache_presets)}) for SMs
{", ".join(map(str, SMS))}, Triton {toolchain.version}, patched vLLM {pin.vllm} source, {args.jobs}
worker processes. Machine: {machine()}; load averages (1/5/15 min) {loads} (this
benchmark's own processes count in them; above ~2 other jobs were competing and the timings
are upper bounds). Cold = empty kernel cache (the toolchain, {toolchain.wheel}, already
fetched): per SM one compile process and one fresh self-check process, each importing Triton
and kiln's stand-in torch (no real torch: `kiln/triton/standin_torch.py`).

| measure | value | goal |
|---|---|---|
| cold, 4 SMs | {cold_s:.1f} s | <= 20 s: {verdict(cold_s <= 20)} |
| all cached, 4 SMs | {warm_s:.3f} s | <= 1 s: {verdict(warm_s <= 1)} |

| SM | kernels | seconds (compile + check) | layer (gzip) | layer (tar) | not built |
|---|---|---|---|---|---|
{chr(10).join(rows)}

Layer = the cache at `/opt/kiln/triton-cache` (cubin, metadata JSON, Triton's `.source` IR
and the group file per kernel) plus `/opt/kiln/triton-kernels.json`. First-launch time with
and without the cache needs a GPU and has not been measured (see docs/TRITON.md).

Reproduce: `.venv/bin/python ci/bench_triton.py --image {definition.name} --jobs {args.jobs}`
"""
    write_section("triton", body)
    print(body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
