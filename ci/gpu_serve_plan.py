"""The GPU run of issue 37: a serve bundle's parts carried one per run, then one serve run.

    PYTHONPATH=. .venv/bin/python ci/gpu_serve_plan.py plan --parts DIR        # here: the runs, in order
    PYTHONPATH=. .venv/bin/python ci/gpu_serve_plan.py dry-run --parts DIR --standin DIR --python PY
    PYTHONPATH=. python3 ci/gpu_serve_plan.py serve --prefix PREFIX --out DIR  # there (the last run)

``plan``: what a session with the device tool does, as JSON: for each part, put that part and the
manifest (alone) in the checkout's ignored folder ``.bundle`` and call ``run`` with
``carry: [".bundle"]`` and ``--receive`` (the part is checked and kept in ``/tmp/kiln-parts``,
which outlives the run while the machine stays up); then one ``run`` that assembles
(``--opt-kiln /opt/kiln``: the kernel cache's group files name that path) and serves. Every run
has a timeout; the serve run's leaves time to rerun it once (``docs/gpu/SERVE_BUNDLE.md``).

``dry-run``: the same sequence here, against a stand-in machine folder ``--standin`` (the
machine's ``/tmp`` and ``/opt/kiln`` under it) and a Python standing in for the machine's
(``--python``, a venv of its packages): each part carried alone, received, assembled, then the
serve run's preflight (``serve --preflight``: both sides import vLLM's server, the overlay's files
are kiln's, the serve commands are built). Only the serving itself needs the GPU.

``serve`` (on the machine): from one assembled install, pristine then patched (the overlay
switched by ``PYTHONPATH``), each with TurboQuant k8v4, MTP speculative decoding and async
scheduling as the image's ``[serve] args`` say, scaled to the tiny model (``scaled_args``):
1. pristine server up; the Triton cache's entries counted; one request; counted again (compiles
   during the first request); greedy outputs of ``GREEDY`` kept; the profile's memory lines of its log;
2. the patched server beside it, the same;
3. ``kiln.bench``: speed A/B (interleaved: TTFT, TPOT, tokens/s with their CV) and the forced
   tool-call battery; then both stopped;
4. ``serve.json`` in ``--out``: all of it, and which requests failed on one side only.
Each server has ``--ready-timeout``; the whole run ``--budget-s``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

CI = Path(__file__).resolve().parent
REPO = CI.parent
ASSEMBLE = CI / "gpu_serve_assemble.py"
PARTS_THERE = "/tmp/kiln-parts"
PREFIX_THERE = "/tmp/kiln-serve"
GREEDY = ["The capital of France is", "def fibonacci(n):", "Tool calls: search the web, read a file,"]
RECEIVE_TIMEOUT_S = 120
SERVE_TIMEOUT_S = 420


# -- the plan --------------------------------------------------------------------------------------


def plan(parts: Path) -> list[dict]:
    manifest = json.loads((parts / "manifest.json").read_text())
    runs = []
    for entry in manifest["parts"]:
        runs.append({
            "stage": f"rm -rf .bundle && mkdir .bundle && cp {parts / entry['name']} {parts / 'manifest.json'} .bundle/",
            "carry": [".bundle"], "timeout_s": RECEIVE_TIMEOUT_S,
            "command": (f"python3 ci/gpu_serve_assemble.py --receive .bundle/{entry['name']} "
                        f"--manifest .bundle/manifest.json --into {PARTS_THERE}"),
            "mib": round(entry["size"] / (1 << 20), 1)})
    runs.append({
        "stage": "rm -rf .bundle", "carry": [], "timeout_s": SERVE_TIMEOUT_S + 60,
        "command": (f"python3 ci/gpu_serve_assemble.py --assemble {PARTS_THERE} --prefix {PREFIX_THERE} "
                    f"--opt-kiln /opt/kiln > $OUT/assembled.json && PYTHONUNBUFFERED=1 PYTHONPATH=$PWD "
                    f"python3 ci/gpu_serve_plan.py serve --prefix {PREFIX_THERE} --out $OUT "
                    f"--budget-s {SERVE_TIMEOUT_S - 30}")})
    return runs


CARRY_LIMIT_MIB = 64  # what one device run carries: the checkout's tracked files and the carried folder


def checkout_mib() -> float:
    """The tracked files' size: every run carries them beside the part (the manifest's few KiB aside)."""
    names = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    return sum((REPO / n).stat().st_size for n in names.decode().split("\0") if n and (REPO / n).is_file()) / (1 << 20)


# -- the serve run ---------------------------------------------------------------------------------


def scaled_args(image_args: list[str], model: Path, chat_template: Path, gpu_share: float,
                kv_cache_dtype: str | None = None) -> list[str]:
    """The image's ``[serve] args`` for the tiny model: what the model or the bundle changes, and why.
    ``kv_cache_dtype`` replaces the image's (the pristine side: see ``PRISTINE_KV``)."""
    args, skip = [], False
    for index, arg in enumerate(image_args):
        if skip:
            skip = False
            continue
        value = image_args[index + 1] if index + 1 < len(image_args) else None
        if arg == "--quantization":  # the tiny model is not quantized
            skip = True
        elif arg == "--max-model-len":  # its max_position_embeddings
            args += [arg, "4096"]
            skip = True
        elif arg == "--gpu-memory-utilization":  # two servers share the GPU for the A/B
            args += [arg, f"{gpu_share:.2f}"]
            skip = True
        elif arg == "--kv-cache-dtype" and kv_cache_dtype:
            args += [arg, kv_cache_dtype]
            skip = True
        elif arg == "--chat-template":  # where the assembler put kiln's /opt/kiln
            args += [arg, str(chat_template)]
            skip = True
        else:
            args.append(arg)
            del value
    return ["--model", str(model), *args,
            "--async-scheduling",  # the image relies on 0.20.1's default; said explicitly here
            "--gdn-prefill-backend", "triton",  # FlashInfer is not carried (ci/gpu_serve_bundle.OMIT_DEPS)
            "--language-model-only"]  # text requests only: the vision tower is not built


def cache_entries(root: Path) -> set[str]:
    return {p.name for p in root.iterdir() if p.is_dir()} if root.is_dir() else set()


def _kernel_files(root: Path, entries: list[str]):
    """(entry, ``<kernel>.json``) of these Triton cache entries; group files ``__grp__*`` are not kernels."""
    for entry in entries:
        for f in sorted((root / entry).glob("*.json")):
            if not f.name.startswith("__grp__"):
                yield entry, f


def kernel_names(root: Path, entries: list[str]) -> list[str]:
    """The kernels compiled into these entries: what a compile count alone does not say."""
    return sorted({f.stem for _, f in _kernel_files(root, entries)})


def kernel_metadata(root: Path, entries: list[str], limit: int = 64 << 10) -> dict[str, dict]:
    """Each entry's kernel metadata (Triton's ``<kernel>.json``: options and target), to match a
    first-request compile against kiln's launch plan here, on the CPU: the 2026-11-30 run brought
    back names only."""
    found = {}
    for entry, f in _kernel_files(root, entries):
        if f.stat().st_size <= limit:
            try:
                found[entry] = json.loads(f.read_text())
            except ValueError:
                found[entry] = {"unreadable": f.name}
    return found


# vLLM 0.20.1 refuses a turboquant_* KV cache for a hybrid model in create_engine_config
# (engine/arg_utils.py:1675-1680, "TurboQuant KV cache is not supported for hybrid (attention + Mamba)
# models"), as the H200 run of 2026-11-30 showed on the pristine side; kiln's P4 lifts it. So the
# pristine side serves what a stock user can: the model's own KV dtype.
PRISTINE_KV = "auto"


PROFILE_LINES = re.compile(r"(Model loading took|Available KV cache memory|GPU KV cache size|"
                           r"Memory profiling takes|torch peak memory|non-torch|CUDA graph|Maximum concurrency)")


# the preflight's probe: each module imported, the file Python loaded and its sha256
_PROBE = ("import hashlib, importlib, json, sys\nout = {}\nfor name in sys.argv[1:]:\n"
          "    module = importlib.import_module(name)\n"
          "    out[name] = [module.__file__, hashlib.sha256(open(module.__file__, 'rb').read()).hexdigest()]\n"
          "print(json.dumps(out))")


def changed_modules(opt_kiln: Path, side: str) -> list[str]:
    """The modules of the files kiln changes that exist on ``side``: all of them patched, those it
    did not add pristine (the audit file, /opt/kiln/manifest.json, says which were new)."""
    # imported here, as serve's own kiln imports are: plan and dry-run need none
    from kiln.source.tree import module_name

    audit = json.loads((opt_kiln / "manifest.json").read_text())
    out = []
    for path, sums in sorted(audit["files"].items()):
        rel = path.removeprefix("/site/vllm/")
        if rel.endswith(".py") and (side == "patched" or sums["before"] is not None):
            out.append(module_name(rel))
    return out


def preflight(env: dict[str, str], opt_kiln: Path, side: str) -> dict:
    """One side without a server: vLLM's server entry point and every module kiln changes import,
    and which file each came from (kiln's on the patched side, the installed one on pristine)."""
    modules = ["vllm.entrypoints.openai.api_server", *changed_modules(opt_kiln, side)]
    probe = subprocess.run([sys.executable, "-c", _PROBE, *modules], env=env, capture_output=True, text=True,
                           timeout=900)
    loaded = {}
    if probe.returncode == 0:
        loaded = json.loads(probe.stdout.strip().splitlines()[-1])
    return {"imports": probe.returncode == 0, "modules": loaded,
            "vllm": loaded.get("vllm.entrypoints.openai.api_server", [""])[0],
            "error": probe.stderr.strip().splitlines()[-1:]}


def _greedy_body(prompt: str, max_tokens: int) -> dict:
    return {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0.0,
            "chat_template_kwargs": {"enable_thinking": False}}


def serve(args) -> int:
    from gpu_serve import Server, StepError, free_port  # ci/gpu_serve.py: a server and its lifeline

    from kiln.bench.battery import CASES
    from kiln.bench.client import stream_chat
    from kiln.bench.evidence import evidence, machine_info
    from kiln.bench.run import BenchSettings, run_battery, run_speed

    prefix: Path = args.prefix
    assembled = json.loads((prefix / "assembled.json").read_text())
    bundle = json.loads((prefix / "bundle" / "bundle.json").read_text())
    opt_kiln = Path(assembled["opt_kiln"])
    cache_dir = Path(assembled["env"]["TRITON_CACHE_DIR"])
    model = Path(assembled["model"])
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.budget_s
    report: dict = {"bundle": {"kiln": bundle["kiln"], "model": bundle["model"]}, "sides": {}}
    servers, endpoints = {}, {}
    base_env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    base_env.update(bundle["kiln"].get("serve_env", {}), TRITON_CACHE_DIR=str(cache_dir), VLLM_NO_USAGE_STATS="1")
    try:
        for label, side in (("B", "pristine"), ("A", "patched")):  # one at a time: each profiles memory
            if side not in args.sides:
                continue
            command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1",
                       "--port", str(free_port()), "--served-model-name", "kiln-check",
                       *scaled_args(bundle["kiln"]["serve_args"], model, opt_kiln / "chat-templates" / "qwen3.6.jinja",
                                    args.gpu_share, args.pristine_kv_cache_dtype if side == "pristine" else None),
                       *(["--enforce-eager"] if args.enforce_eager else [])]
            env = {**base_env, **assembled["env"][side]}
            if args.preflight:
                report["sides"][side] = {"command": command, **preflight(env, opt_kiln, side)}
                continue
            servers[label] = Server(command, env, out / f"server-{side}.log")
            try:
                endpoints[label] = servers[label].wait_ready(min(args.ready_timeout, deadline - time.monotonic()))
            except StepError as error:  # the other side still runs: one GPU run says what each side does
                report["sides"][side] = {"command": command, "first_request_ok": False, "first_error": str(error)}
                servers.pop(label).stop()
                continue
            before = cache_entries(cache_dir)
            first = stream_chat(endpoints[label], _greedy_body("Hello", 16), timeout=120)
            compiled = sorted(cache_entries(cache_dir) - before)
            greedy = [stream_chat(endpoints[label], _greedy_body(p, 32), timeout=60) for p in GREEDY]
            log = (out / f"server-{side}.log").read_text(errors="replace")
            report["sides"][side] = {"command": command, "first_request_ok": first.ok, "first_error": first.error,
                                     "triton_compiles_first_request": len(compiled), "compiled_entries": compiled,
                                     "compiled_kernels": kernel_names(cache_dir, compiled),
                                     "compiled_metadata": kernel_metadata(cache_dir, compiled),
                                     "greedy": [g.content if g.ok else f"error: {g.error}" for g in greedy],
                                     "profile": [line.strip() for line in log.splitlines()
                                                                   if PROFILE_LINES.search(line)][-12:]}
        if not args.preflight and len(endpoints) == 2:
            settings = BenchSettings(runs=args.runs, warmup=1, concurrency=(1, 4))
            speed = run_speed(endpoints, settings, deadline=time.perf_counter() + max(30.0, deadline - time.monotonic() - 60))
            battery = run_battery(endpoints, CASES, 1, settings, deadline=time.perf_counter() + 50)
            data = evidence(endpoints, {}, settings, speed, battery, machine_info())
            (out / "bench.json").write_text(json.dumps(data, indent=1) + "\n")
            sides = report["sides"]
            report["greedy_equal"] = sides["pristine"]["greedy"] == sides["patched"]["greedy"]
            report["failed_requests"] = data["speed"]["failed_requests"]
    finally:
        for server in servers.values():
            server.stop()
    (out / "serve.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({side: {k: v for k, v in info.items() if k != "command"} for side, info in report["sides"].items()},
                     indent=1))
    if args.preflight:
        return 0 if all(s["imports"] for s in report["sides"].values()) else 1
    return 0 if all(s["first_request_ok"] for s in report["sides"].values()) else 1


# -- the dry run -----------------------------------------------------------------------------------


def dry_run(parts: Path, standin: Path, python: str) -> dict:
    """The plan's runs against a stand-in machine folder: each carried part alone, then the last run's
    assembly and the serve preflight, its paths moved under ``standin``."""
    checkout = standin / "checkout"  # the carried folder, as the run sees it
    steps = []
    for run in plan(parts):
        started = time.monotonic()
        shutil.rmtree(checkout / ".bundle", ignore_errors=True)
        if run["carry"]:
            (checkout / ".bundle").mkdir(parents=True)
            names = run["command"].split("--receive .bundle/")[1].split()[0], "manifest.json"
            for name in names:
                shutil.copyfile(parts / name, checkout / ".bundle" / name)
            carried = sum(f.stat().st_size for f in (checkout / ".bundle").iterdir())
            proc = subprocess.run([python, str(ASSEMBLE), "--receive", str(checkout / ".bundle" / names[0]),
                                   "--manifest", str(checkout / ".bundle" / "manifest.json"),
                                   "--into", str(standin / PARTS_THERE.lstrip("/"))],
                                  capture_output=True, text=True, timeout=run["timeout_s"])
            steps.append({"run": run["command"], "carried_mib": round(carried / (1 << 20), 1), "rc": proc.returncode,
                          "said": (proc.stdout + proc.stderr).strip(), "s": round(time.monotonic() - started, 1)})
            if proc.returncode:
                break
            continue
        prefix = standin / PREFIX_THERE.lstrip("/")
        proc = subprocess.run([python, str(ASSEMBLE), "--assemble", str(standin / PARTS_THERE.lstrip("/")),
                               "--prefix", str(prefix), "--opt-kiln", str(standin / "opt" / "kiln")],
                              capture_output=True, text=True, timeout=run["timeout_s"])
        steps.append({"run": "assemble", "rc": proc.returncode, "said": proc.stderr.strip(),
                      "s": round(time.monotonic() - started, 1)})
        if proc.returncode:
            break
        started = time.monotonic()
        proc = subprocess.run([python, str(Path(__file__)), "serve", "--prefix", str(prefix), "--out",
                               str(standin / "out"), "--preflight"], capture_output=True, text=True,
                              timeout=run["timeout_s"], env={**os.environ, "PYTHONPATH": str(REPO)})
        steps.append({"run": "serve --preflight", "rc": proc.returncode, "said": (proc.stdout + proc.stderr)[-3000:],
                      "s": round(time.monotonic() - started, 1)})
    return {"runs": len(plan(parts)), "steps": steps}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="verb", required=True)
    p = sub.add_parser("plan")
    p.add_argument("--parts", type=Path, required=True)
    d = sub.add_parser("dry-run")
    d.add_argument("--parts", type=Path, required=True)
    d.add_argument("--standin", type=Path, required=True, help="a folder standing for the machine's / (new or empty)")
    d.add_argument("--python", required=True, help="a Python standing for the machine's (its packages)")
    s = sub.add_parser("serve")
    s.add_argument("--prefix", type=Path, required=True)
    s.add_argument("--out", type=Path, required=True)
    s.add_argument("--gpu-share", type=float, default=0.4)
    s.add_argument("--ready-timeout", type=float, default=150.0, help="seconds for each server to answer")
    s.add_argument("--budget-s", type=float, default=SERVE_TIMEOUT_S - 30, help="the whole serve step")
    s.add_argument("--runs", type=int, default=3, help="bench runs per prompt")
    s.add_argument("--pristine-kv-cache-dtype", default=PRISTINE_KV,
                   help="the pristine side's KV dtype ('' keeps the image's: 0.20.1 refuses it for hybrid models)")
    s.add_argument("--preflight", action="store_true", help="no server: imports and commands only")
    s.add_argument("--sides", nargs="+", choices=("pristine", "patched"), default=["pristine", "patched"],
                   help="which sides to serve (the bench needs both)")
    s.add_argument("--enforce-eager", action="store_true",
                   help="no torch.compile, no CUDA graphs: a cold machine's server up in less GPU time "
                        "(the image's compile mode is not what is then shown)")
    args = parser.parse_args(argv)
    if args.verb == "plan":
        runs = plan(args.parts)
        checkout = checkout_mib()
        over = [run for run in runs if run.get("mib", 0) + checkout > CARRY_LIMIT_MIB]
        if over:  # the device tool would refuse the run: say so here, before a machine is held
            print(f"gpu_serve_plan: a part of {over[0]['mib']} MiB with the checkout's {checkout:.1f} MiB is over the "
                  f"{CARRY_LIMIT_MIB} MiB a run carries: rebuild with a smaller --part-mib", file=sys.stderr)
            return 1
        print(json.dumps(runs, indent=1))
        return 0
    if args.verb == "dry-run":
        done = dry_run(args.parts, args.standin, args.python)
        print(json.dumps(done, indent=1))
        return 0 if done["steps"] and all(s["rc"] == 0 for s in done["steps"]) else 1
    return serve(args)


if __name__ == "__main__":
    sys.exit(main())
