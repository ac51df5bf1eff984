"""The kernel check of ``ci/gpu_check.py`` for a GPU machine that cannot reach the network.

    .venv/bin/python ci/gpu_check.py --bundle DIR --gpu-triton-record RECORD [--image NAME] [--pin PIN] [--sm 90]
    PYTHONPATH=. python3 ci/gpu_check.py --run-bundle DIR [--json]                    # on the GPU machine

``--bundle`` (here, with kiln installed): applies the image's selection to the pin's source, builds
the SM's kernel cache exactly as ``build.py build`` does for an image whose Triton is described by
``RECORD`` (the GPU machine's ``triton-X.dist-info/RECORD``: its version picks the toolchain, its
``libtriton.so`` keys the entries, ``kiln/triton/imagekey.py``), and writes into DIR:
``cache/`` (the cache as the image holds it under ``/opt/kiln/triton-cache``), ``src/`` (the
patched kernel sources the build compiled), ``stock/`` (the same files unpatched) and
``job.json``. Nothing in DIR names a path of this machine.

``--run-bundle`` (on the GPU machine: torch with CUDA and that Triton; kiln's own Python
dependencies are not needed):
1. refuses (exit 2) when the machine's Triton is not the version, or its ``libtriton.so`` not the
   file, the bundle was keyed for, when the GPU is another SM, or when ``/opt/kiln/triton-cache``
   is there and not a dead check's (below);
2. copies ``cache/`` to ``/opt/kiln/triton-cache`` (where the image has it, so the group files'
   paths hold) and runs ``gpu_check``'s GPU step in a fresh process: the build's launches on CUDA
   tensors, compiles counted (0 expected), then the k8v4 numerics against a PyTorch reference;
3. when the selection carries PN119, ``ci/gpu_pn119.py``: stock against grouped decode on the GPU;
   when it carries P103, ``ci/gpu_p103.py``: stock against windowed GDN prefill.
Exit 0 only when every step passed; 1 when one failed; 2 when the machine cannot run the check.

Nothing outlives a killed check: every child process is started through ``kiln/lifeline.py``
(stdlib only; the kernel sends it SIGKILL when this process dies, SIGKILL included), and SIGTERM
or SIGINT remove the cache before exiting (128 + the signal). Only a SIGKILL leaves
``/opt/kiln/triton-cache`` behind, and it carries ``OWNER`` (the pid, its start time and the boot
id of the process that made it; the folder appears whole, with it, by one rename): the next run
removes a dead owner's folder and says so, refuses a live one's, and refuses a folder without
that file (kiln did not make it, so kiln does not remove it). ``KILN_GPU_CHECK_RUNTIME_CACHE``
moves the folder (tests: the group files name ``/opt/kiln/triton-cache``, so only there do the
kernels load without compiling).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RUNTIME_CACHE = Path("/opt/kiln/triton-cache")
OWNER = ".kiln-gpu-check-owner.json"  # in the runtime cache: which process made it
LIBTRITON = "triton/_C/libtriton.so"


def _fail(message: str) -> int:
    print(f"gpu_check: {message}", file=sys.stderr)
    return 2


def _record_version(record: str) -> str | None:
    match = re.search(r"^triton-([^/]+)\.dist-info/RECORD,", record, re.MULTILINE)
    return match.group(1) if match else None


# -- here: build the bundle ------------------------------------------------------------------------


def write_bundle(args) -> int:
    from kiln.cache import cache_root
    from kiln.errors import KilnError
    from kiln.paths import RepoFiles
    from kiln.triton import aot
    from kiln.triton.imagekey import runtime_key
    from kiln.triton.keyfiles import read_key_sources
    from kiln.triton.toolchain import toolchain_for
    from kiln.verify import patched_source

    out: Path = args.bundle
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        return _fail(f"--bundle {out}: not a new or empty folder")
    if not args.gpu_triton_record:
        return _fail("--bundle needs --gpu-triton-record (the GPU machine's triton-X.dist-info/RECORD)")
    record = args.gpu_triton_record.read_text()
    version = _record_version(record)
    if version is None:
        return _fail(f"--gpu-triton-record {args.gpu_triton_record}: not a Triton dist-info RECORD")
    try:  # the pin by default: the image's first (ImageDefinition.pins_of)
        patched = patched_source(RepoFiles(), args.image, args.sm, args.pin)
    except KilnError as err:
        return _fail(str(err))
    definition, pin, tree = patched.inputs.definition, patched.inputs.pin, patched.tree
    preset = definition.model.kernels
    if preset is None:
        return _fail(f"{definition.path} declares no [model.kernels]")
    applied = patched.applied
    sources = aot.KernelSources(patched.changed, tree.root)
    toolchain = toolchain_for(version, definition.name, cache_root())
    keyed = runtime_key(record, toolchain.record, args.gpu_python, toolchain.wheel_python,
                        read_key_sources(toolchain.site, toolchain.version))
    if keyed.problem:
        return _fail(f"the GPU machine's Triton cannot read kiln's cache: {keyed.problem}")
    built = aot.compile_kernel_caches(preset, [args.sm], sources, toolchain, cache_root(),
                                      image_libtriton=keyed.libtriton_sha256)[args.sm]
    staged, _ = aot.stage_sources(preset, sources)
    stock, _ = aot.stage_sources(preset, aot.KernelSources({}, tree.root))
    out.mkdir(parents=True, exist_ok=True)
    shutil.copytree(built.root, out / "cache")
    shutil.copytree(staged, out / "src")
    shutil.copytree(stock, out / "stock")
    if "P103" in applied:  # the GDN prefill ops, stock and patched, for ci/gpu_p103.py
        import gpu_p103

        gpu_p103.write_packages(tree.root / "vllm" / gpu_p103.OPS, patched.changed, out)
    from kiln.triton.kernels import launch_plan

    plan = launch_plan(preset, sources.runtime_layout())

    job = {"image": definition.name, "pin": pin.name, "vllm": str(pin.vllm), "sm": args.sm,
           "patches": applied,
           "kv_cache_dtype": definition.model.kv_cache_dtype, "triton": version, "libtriton_sha256": keyed.libtriton_sha256,
           "preset": preset.to_json(), "launches": plan,
           "built": {"compiled": built.compiled, "from_cache": built.cached, "failures": built.failures}}
    (out / "job.json").write_text(json.dumps(job, indent=1))
    print(f"{out}: {definition.name} on {pin.name} for sm_{args.sm}, Triton {version} "
          f"(libtriton.so {keyed.libtriton_sha256[:12]}), {len(applied)} patches applied")
    return 0


# -- there: run it -------------------------------------------------------------------------------


def _installed_triton() -> tuple[str, str]:
    import triton

    lib = Path(triton.__file__).parent / "_C" / "libtriton.so"
    digest = hashlib.sha256()
    with open(lib, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 24), b""):
            digest.update(chunk)
    return triton.__version__, digest.hexdigest()


def run_bundle(args) -> int:
    bundle: Path = args.run_bundle.resolve()
    if not (bundle / "job.json").is_file():
        return _fail(f"--run-bundle {args.run_bundle}: no job.json (write one with --bundle)")
    job = json.loads((bundle / "job.json").read_text())
    try:
        version, libtriton = _installed_triton()
    except ImportError as err:
        return _fail(f"this machine cannot import Triton ({err})")
    if version != job["triton"] or libtriton != job["libtriton_sha256"]:
        return _fail(f"this machine's Triton is {version} (libtriton.so {libtriton[:12]}); the bundle was keyed "
                     f"for {job['triton']} ({job['libtriton_sha256'][:12]})")
    import tempfile

    from kiln import lifeline
    from kiln.errors import Interrupted

    runtime_cache = Path(os.environ.get("KILN_GPU_CHECK_RUNTIME_CACHE", RUNTIME_CACHE))
    claimed = False
    try:
        with lifeline.stop_on_signals():
            try:
                with lifeline.uninterrupted():  # a signal waits until the claim is made or refused
                    refused = _claim_runtime_cache(runtime_cache, bundle / "cache")
                    claimed = refused is None
                if refused:
                    return _fail(refused)
                # working files in a folder of the check's own: nothing is written beside the user's bundle
                with tempfile.TemporaryDirectory(prefix="kiln-gpu-bundle-") as tmp:
                    return _run_in(bundle, job, version, Path(tmp), runtime_cache, args)
            finally:
                if claimed:  # made by this run: only then is it this run's to remove
                    shutil.rmtree(runtime_cache, ignore_errors=True)
    except Interrupted as stop:
        print(f"gpu_check: stopped by {stop}" + (f"; {runtime_cache} removed" if claimed else ""), file=sys.stderr)
        return 128 + stop.signum


# -- the runtime cache: made whole by one rename, owned by this process ---------------------------


def _owner_of_this_process() -> dict:
    from kiln.staging import start_time

    return {"pid": os.getpid(), "start": start_time(os.getpid()), "boot": _boot_id()}


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def _owner_alive(owner: dict) -> bool:
    """Whether the process ``owner`` describes still runs (a reused pid, or another boot, does not)."""
    from kiln.staging import start_time

    if owner.get("boot") != _boot_id():
        return False
    try:
        os.kill(owner["pid"], 0)
    except ProcessLookupError:
        return False
    except (OverflowError, ValueError):
        return True  # no pid of this machine: not provably dead, so kept
    except PermissionError:
        pass  # another user's live process: its start time tells
    return owner.get("start") is None or start_time(owner["pid"]) in (None, owner["start"])


def _claim_runtime_cache(root: Path, cache: Path) -> str | None:
    """Put ``cache`` at ``root`` with this process's owner file; why not, or None once it is there.

    A folder already at ``root`` is removed (and said so) only when its owner file names a process
    that no longer runs; a live check's is refused, and so is a folder kiln did not make."""
    from kiln import staging

    owner = None
    if root.exists() or root.is_symlink():
        try:
            owner = json.loads((root / OWNER).read_text())
            owner["pid"] = int(owner["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            return f"{root} exists and holds no readable {OWNER}: not a kiln GPU check's, so nothing is removed"
        if _owner_alive(owner):
            return f"{root} is in use by a running GPU check (pid {owner['pid']}); run one check at a time"
    stage = None
    try:
        if owner is not None:
            shutil.rmtree(root)
            print(f"gpu_check: removed {root}, left by a killed check (pid {owner['pid']})", file=sys.stderr)
        root.parent.mkdir(parents=True, exist_ok=True)
        staging.remove_dead_stages(root.parent)  # a claim killed halfway through its copy
        stage = staging.stage_dir(root)
        shutil.copytree(cache, stage, dirs_exist_ok=True)
        (stage / OWNER).write_text(json.dumps(_owner_of_this_process()))
        os.rename(stage, root)  # the folder appears whole, owner file and all
    except OSError as err:
        if stage is not None:
            shutil.rmtree(stage, ignore_errors=True)
        return f"{root}: cannot put the bundle's cache there ({err.strerror or err})"
    return None


def _run_in(bundle: Path, job: dict, version: str, work: Path, runtime_cache: Path, args) -> int:
    from kiln import lifeline

    report_path = work / "kernels.json"
    gpu_job = {"sm": job["sm"], "roots": [str(bundle / "src")], "preset": job["preset"],
               "launches": job["launches"], "report": str(report_path)}
    (work / "gpu-job.json").write_text(json.dumps(gpu_job))
    env = {**os.environ, "TRITON_CACHE_DIR": str(runtime_cache)}
    env.pop("TRITON_STORE_BINARY_ONLY", None)
    proc = lifeline.run([sys.executable, str(REPO / "ci" / "gpu_check.py"), "--gpu-job",
                         str(work / "gpu-job.json")], env=env)
    # its lines (a launch that failed, why it could not run) on stderr: stdout may be --json
    sys.stderr.write(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        return proc.returncode
    report = json.loads(report_path.read_text())
    report.update(image=job["image"], pin=job["pin"], sm=job["sm"], triton=version)
    report["cache_ok"] = not report["compiles"] and report["hits"] > 0
    report["numerics_ok"] = all(n.get("ok", True) for n in report["numerics"])
    code = 0 if report["cache_ok"] and report["numerics_ok"] else 1
    if "PN119" in job["patches"] and args.pn119 != "none":
        import gpu_pn119

        report["pn119"] = gpu_pn119.compare(bundle, job, work, grid=args.pn119 == "all")
        code = max(code, 0 if report["pn119"]["ok"] else 1)
    if "P103" in job["patches"] and (bundle / "fla_src").is_dir() and args.p103 == "run":
        import gpu_p103

        report["p103"] = gpu_p103.compare(bundle, work)
        code = max(code, 0 if report["p103"]["ok"] else 1)
    report["ok"] = code == 0
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        from gpu_reference import print_kernel_report

        print_kernel_report(report, f"sm_{job['sm']}, {job['image']} on {job['pin']}",
                            [f"{name.upper()}: {report[name]['summary']}" for name in ("pn119", "p103") if name in report])
    return code


# -- here again: the figures -----------------------------------------------------------------------


def write_bench_doc(reports: list[Path]) -> int:
    """The ``gpu`` section of docs/BENCHMARKS.md from ``--run-bundle --json`` reports."""
    import benchlib

    loaded = [json.loads(path.read_text()) for path in reports]
    lines = ["## gpu (issues 20 and 21: kiln's kernels on a GPU)", "",
             "Reproduce: build the bundles here, run them on the GPU machine, write this section from "
             "their reports:", "", "```bash",
             ".venv/bin/python ci/gpu_check.py --bundle B --gpu-triton-record RECORD --image IMAGE --pin PIN "
             "--sm 90 --kernel-block-size N",
             "PYTHONPATH=. python3 ci/gpu_check.py --run-bundle B [--pn119 all|bench] --json > B.json     # on the GPU",
             ".venv/bin/python ci/gpu_check.py --bench-doc B.json ...", "```", ""]
    for report in loaded:
        lines += [f"### {report['image']} on {report['pin']}, {report['gpu']} (sm_{report['sm']}), "
                  f"Triton {report['triton']}", "",
                  f"- kiln's ahead-of-time cache: {report['hits']} kernel(s) loaded, {len(report['compiles'])} "
                  f"compiled; k8v4 decode against the PyTorch reference: max abs error "
                  f"{max(n.get('max_abs_error', 0) for n in report['numerics']):.1e}"]
        p103 = report.get("p103")
        if p103 and p103.get("cases"):
            cases = p103["cases"]
            lines += ["", "P103, GDN chunked prefill (`chunk_gated_delta_rule`, two sequences, 16 key / 48 value "
                      "heads, dim 128, fp16; first autotune config on both sides), stock against 64-chunk "
                      f"windows; time: median of {len(cases[0].get('rounds_ms', {}).get('stock', []))} interleaved "
                      "rounds of `do_bench` medians:", "",
                      "| tokens | peak MiB stock | peak MiB P103 | ms stock | ms P103 | first layer ms stock | "
                      "first layer ms P103 | max abs diff (o / state) |",
                      "| --- | --- | --- | --- | --- | --- | --- | --- |"]
            lines += [f"| {c['tokens']} | {c['stock_peak_mib']:.0f} | {c['patched_peak_mib']:.0f} | {c['stock_ms']:.1f} | "
                      f"{c['patched_ms']:.1f} | {c.get('stock_first_layer_ms', float('nan')):.1f} | "
                      f"{c.get('patched_first_layer_ms', float('nan')):.1f} | "
                      f"{c['o_max_abs_diff']:.1e} / {c['state_max_abs_diff']:.1e} |"
                      for c in cases if "error" not in c]
            lines += [f"| {c['tokens']} | {c['error']} | | | | | | |" for c in cases if "error" in c]
        pn119 = report.get("pn119")
        if not pn119:
            lines.append("")
            continue
        cases = pn119.get("cases", [])
        grid = [c for c in cases if "stock_ms" not in c and "error" not in c]
        if grid:
            lines.append(f"- PN119 stock against grouped, compiled: {sum(c['ok'] for c in grid)}/{len(grid)} grid "
                         f"cases within the tolerance, largest difference {max(c['max_abs_diff'] for c in grid):.1e}")
        for size in sorted({c["block_size"] for c in cases if "stock_ms" in c}):
            timed = [c for c in cases if "stock_ms" in c and c["block_size"] == size]
            lines += ["", f"Decode time (ms, median of {len(timed[0]['rounds_ms']['stock'])} interleaved rounds, "
                      "each the median of `triton.testing.do_bench`), query/KV heads x head dim, kernel block "
                      f"size {timed[0]['block_size']}, {timed[0]['splits']} KV splits:", "",
                      "| heads | batch | context | stock | PN119 | speed-up | max abs diff |",
                      "| --- | --- | --- | --- | --- | --- | --- |"]
            lines += [f"| {c['hq']}/{c['hk']} x {c['d']} | {len(c['seq_lens'])} | {c['seq_lens'][0]} | "
                      f"{c['stock_ms']:.3f} | {c['patched_ms']:.3f} | {c['speedup']:.2f}x | {c['max_abs_diff']:.1e} |"
                      for c in timed]
        lines.append("")
    benchlib.write_section("gpu", "\n".join(lines))
    print(f"{benchlib.BENCHMARKS}: section gpu written from {len(loaded)} report(s)")
    return 0
