"""The served-model step of ``ci/gpu_check.py``: serve kiln's patched vLLM, bench it, record it.

    .venv/bin/python ci/gpu_check.py --step serve [--model DIR] [--overlay DIR [--against-stock]]

1. The patched vLLM: inside a kiln image, the installed one, checked file by file against the
   image's ``/opt/kiln/manifest.json`` (each patched file's sha256 must be the "after" one);
   elsewhere ``--overlay DIR`` (a ``build.py apply --out DIR`` tree) laid over the installed
   vLLM of the same version as a tree of links in which only the patched files differ, put
   first on ``PYTHONPATH``. With ``--against-stock`` the installed, unpatched vLLM is served
   beside it (each server gets part of the GPU) and ``bench`` compares the two.
2. The model: ``--model DIR``, or the smallest model in the Hugging Face cache (nothing can be
   downloaded on such a machine). The tool-call parser follows the model's ``model_type``.
3. ``vllm.entrypoints.openai.api_server`` on 127.0.0.1 until ``GET /v1/models`` answers, then
   ``kiln.bench``'s speed run and tool-call battery, then the server is stopped.
4. The evidence (JSON) is written, and the ``served`` section of docs/BENCHMARKS.md rewritten.

Everything but the GPU is tested on CPU in tests/test_gpu_check.py, with a stand-in ``vllm``
package that serves the fake OpenAI server of tests/bench/.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MANIFEST = Path("/opt/kiln/manifest.json")
SERVED_NAME = "kiln-check"

# model_type (config.json) -> the arguments that turn on its tool-call (and reasoning) parser
TOOL_PARSERS = {
    "qwen3": ["--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3"],
    "qwen3_moe": ["--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3"],
    "qwen2": ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"],
    "llama": ["--enable-auto-tool-choice", "--tool-call-parser", "llama3_json"],
    "mistral": ["--enable-auto-tool-choice", "--tool-call-parser", "mistral"],
}


class StepError(Exception):
    """The machine cannot run the step (exit 2): no model, no vLLM, a version mismatch."""


# -- the model -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LocalModel:
    path: Path  # the directory vLLM loads (a snapshot of the HF cache, or the given one)
    name: str
    size: int  # bytes of its files
    model_type: str | None


def _model_at(path: Path, name: str | None = None) -> LocalModel | None:
    config = path / "config.json"
    if not config.is_file() or not any(path.glob("*.safetensors")):
        return None
    try:
        model_type = json.loads(config.read_text()).get("model_type")
    except ValueError:
        model_type = None
    size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())  # follows the cache's links
    if name is None and path.parent.name == "snapshots" and path.parent.parent.name.startswith("models--"):
        name = path.parent.parent.name[len("models--"):].replace("--", "/")  # a snapshot of the HF cache
    return LocalModel(path, name or path.name, size, model_type)


def find_models(hf_home: Path) -> list[LocalModel]:
    """Models in a Hugging Face cache (``hub/models--ORG--NAME/snapshots/REV``), smallest first."""
    found = []
    for repo in sorted((hf_home / "hub").glob("models--*")):
        name = repo.name[len("models--"):].replace("--", "/")
        for snapshot in sorted((repo / "snapshots").glob("*")):
            model = _model_at(snapshot, name)
            if model is not None:
                found.append(model)
                break
    return sorted(found, key=lambda m: (m.size, m.name))


def choose_model(given: Path | None, hf_home: Path) -> LocalModel:
    if given is not None:
        model = _model_at(given)
        if model is None:
            raise StepError(f"--model {given}: no config.json and *.safetensors there")
        return model
    models = find_models(hf_home)
    if not models:
        raise StepError(f"no model in the Hugging Face cache {hf_home}/hub: pass --model DIR")
    return models[0]


# -- the patched vLLM ------------------------------------------------------------------------------


def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def verify_manifest(manifest: Path) -> dict:
    """The image's patched files, checked on disk; returns what the evidence records."""
    data = json.loads(manifest.read_text())
    wrong = [path for path, sums in data["files"].items()
             if not Path(path).is_file() or sha256_file(Path(path)) != sums["after"]]
    if wrong:
        raise StepError(f"{manifest}: {len(wrong)} patched file(s) differ on disk, e.g. {wrong[0]}")
    return {"mode": "image", "manifest": str(manifest), "image": data.get("image"), "pin": data.get("pin"),
            "base": data.get("base"), "patches": [p["patch"] for p in data["patches"] if p["verdict"] == "APPLIES"],
            "files_verified": len(data["files"])}


def installed_vllm(python: str, env: dict) -> tuple[Path, str]:
    """Where ``python`` imports vLLM from, and its version."""
    probe = ("import importlib.metadata as m, vllm\n"
             "try:\n    v = m.version('vllm')\nexcept m.PackageNotFoundError:\n    v = vllm.__version__\n"
             "print(vllm.__path__[0]); print(v)")
    proc = _lifeline().run([python, "-c", probe], env=env)  # dies with this process, SIGKILL too
    if proc.returncode != 0:
        raise StepError(f"{python} cannot import vllm: {proc.stderr.strip().splitlines()[-1:]}")
    path, version = proc.stdout.split()
    return Path(path), version


def build_overlay(installed: Path, patched: Path, dest: Path) -> list[str]:
    """``dest/vllm``: links to every installed file, the files kiln changed replaced by its text.

    ``patched`` is a ``build.py apply --out`` tree (``vllm/`` + ``kiln-report.json``); returns
    the relative paths that differ from the installed package.
    """
    report = json.loads((patched / "kiln-report.json").read_text())
    shutil.copytree(installed, dest / "vllm", symlinks=True, copy_function=os.symlink,
                    ignore=shutil.ignore_patterns("__pycache__"))
    changed = sorted(report["files"])
    for rel in changed:
        target = dest / "vllm" / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.is_symlink() or target.exists():
            target.unlink()
        shutil.copyfile(patched / "vllm" / rel, target)
    return changed


def prepare_overlay(python: str, patched: Path, dest: Path, env: dict) -> dict:
    report = json.loads((patched / "kiln-report.json").read_text())
    installed, version = installed_vllm(python, env)
    if version.split("+")[0] != report["vllm_version"]:
        raise StepError(f"--overlay {patched} patches vLLM {report['vllm_version']}, "
                        f"but {python} has vLLM {version}")
    changed = build_overlay(installed, patched, dest)
    return {"mode": "overlay", "overlay": str(patched), "installed": str(installed), "vllm_version": version,
            "patches": [p["patch"] for p in report["patches"] if p["verdict"] == "APPLIES"], "files": changed}


# -- serving ---------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def serve_command(python: str, model: LocalModel, port: int, gpu_share: float, extra: list[str]) -> list[str]:
    """The ``vllm serve`` command line for the check (small context: the model is small)."""
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1", "--port", str(port),
            "--model", str(model.path), "--served-model-name", SERVED_NAME, "--max-model-len", "8192",
            "--gpu-memory-utilization", f"{gpu_share:.2f}", *TOOL_PARSERS.get(model.model_type or "", []), *extra]


def serve_env(base: dict, overlay: Path | None) -> dict:
    env = {**base, "VLLM_NO_USAGE_STATS": "1"}
    if overlay is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(overlay), base.get("PYTHONPATH", "")) if p)
    return env


def _lifeline():
    from kiln import lifeline  # stdlib only

    return lifeline


class Server:
    """One ``vllm serve`` process in its own session, its output in a log file; it gets SIGKILL from
    the kernel when this process dies (``kiln/lifeline.py``), SIGKILL included."""

    def __init__(self, command: list[str], env: dict, log: Path):
        self.command, self.log = command, log
        self.url = f"http://127.0.0.1:{command[command.index('--port') + 1]}"
        parent, lifeline = os.getpid(), _lifeline()
        with open(log, "wb") as out:
            self.process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT,
                                            start_new_session=True, preexec_fn=lambda: lifeline.child_of(parent))

    def wait_ready(self, timeout: float, poll: float = 1.0):
        """The endpoint once ``GET /v1/models`` answers; StepError when the process dies first."""
        from kiln.bench.client import connect
        from kiln.errors import KilnError

        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise StepError(f"the server exited with {self.process.returncode} before answering: "
                                f"{self.tail()}")
            try:
                return connect(self.url, timeout=5.0)
            except KilnError:
                if time.monotonic() > deadline:
                    raise StepError(f"the server did not answer within {timeout:g} s: {self.tail()}") from None
                time.sleep(poll)

    def tail(self, lines: int = 5) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return " | ".join(text.strip().splitlines()[-lines:])

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)  # the session this Popen started
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


# -- recording -------------------------------------------------------------------------------------


def _ms(value) -> str:
    return "-" if value is None else f"{value * 1000:.1f} ms"


def _tps(value) -> str:
    return "-" if value is None else f"{value:.1f}"


def _cv(value) -> str:
    return "-" if value is None else f"{value * 100:.1f} %"


def served_section(data: dict, patched: dict, model: LocalModel) -> str:
    """The docs/BENCHMARKS.md section for one run of the step (from the bench evidence)."""
    gpus = ", ".join(g["name"] for g in data["machine"]["gpus"]) or "a machine whose nvidia-smi lists no GPU"
    endpoints = {e["label"]: e for e in data["endpoints"]}
    names = {"A": "kiln-patched", "B": "stock"}
    lines = [
        "## served model (issue 15)", "",
        f"`ci/gpu_check.py --step serve`: {model.name} ({model.size / 2**30:.2f} GiB, model_type "
        f"`{model.model_type}`) served by vLLM {endpoints['A']['server_version'] or '?'} on {gpus}, "
        f"{data['machine']['cpu']}. Patched vLLM from {patched['mode']}: "
        f"{', '.join(patched['patches']) or 'no patch'} applied. Prompt set {data['prompt_set']['version']}, "
        f"{data['settings']['runs']} runs per prompt after {data['settings']['warmup']} warm-up pass(es); "
        "overall figures (mean, median, CV over the runs; see docs/BENCH.md).", "",
    ]
    if data["speed"]:
        compared = len(endpoints) > 1
        header = "| concurrency | metric | " + " | ".join(names[label] for label in endpoints) + \
            (" | change | verdict |" if compared else " |")
        lines += [header, "|" + "---|" * (header.count("|") - 1)]
        for figure in data["speed"]["figures"]:
            if figure["prompt"] != "overall":
                continue
            fmt = _tps if figure["unit"] == "tok/s" else _ms
            cells = [f"{fmt(s['mean'])} / {fmt(s['median'])} / {_cv(s['cv'])}" for s in figure["summaries"].values()]
            row = f"| {figure['concurrency']} | {figure['metric']} | " + " | ".join(cells)
            if compared:
                c = figure["comparison"]
                change = "-" if c["change"] is None else f"{c['change'] * 100:+.1f} %"
                row += f" | {change} | {c['verdict']}"
            lines.append(row + " |")
        lines += ["", f"Failed requests: {data['speed']['failed_requests']}.", ""]
    if data["battery"]:
        clean = data["battery"]["clean"]
        lines += ["| tool-call case | " + " | ".join(names[label] for label in clean) + " |",
                  "|---|" + "---|" * len(clean)]
        for case in data["battery"]["cases"]:
            lines.append(f"| {case['id']} | " + " | ".join(
                "{}/{}".format(*clean[label]["by_case"][case["id"]]) for label in clean) + " |")
        lines.append("| all | " + " | ".join(f"{c['clean']}/{c['total']}" for c in clean.values()) + " |")
        lines.append("")
    lines.append("Reproduce on a GPU machine: `.venv/bin/python ci/gpu_check.py --step serve` "
                 "(inside a kiln image, or with `--overlay DIR --against-stock`).")
    return "\n".join(lines)


def record(section: str) -> None:
    import benchlib

    benchlib.write_section("served", section)


# -- the step --------------------------------------------------------------------------------------


def add_arguments(parser) -> None:
    group = parser.add_argument_group("--step serve (a served model, benched)")
    group.add_argument("--model", type=Path, help="model directory (default: the smallest in the HF cache)")
    group.add_argument("--hf-home", type=Path, default=Path(os.environ.get("HF_HOME", Path.home() / ".cache/huggingface")),
                       help="Hugging Face cache to look for models in (default: $HF_HOME)")
    group.add_argument("--vllm-python", default=sys.executable, help="a Python that imports vLLM (default: this one)")
    group.add_argument("--manifest", type=Path, default=MANIFEST, help="a kiln image's audit file (default: %(default)s)")
    group.add_argument("--overlay", type=Path, help="a `build.py apply --out` tree to lay over the installed vLLM")
    group.add_argument("--against-stock", action="store_true", help="with --overlay: also serve the stock vLLM and compare")
    group.add_argument("--serve-args", default="", help="more `vllm serve` arguments, one shell-quoted string")
    group.add_argument("--port", type=int, help="port of the patched server (default: a free one)")
    group.add_argument("--runs", type=int, default=5, help="bench runs per prompt (default: %(default)s)")
    group.add_argument("--concurrency", default="1,4", help="bench concurrency sweep (default: %(default)s)")
    group.add_argument("--battery-runs", type=int, default=3, help="attempts per tool-call case (default: %(default)s)")
    group.add_argument("--ready-timeout", type=float, default=1200.0, help="seconds to wait for the server")
    group.add_argument("--evidence", type=Path, help="where to write the bench evidence (default: a temporary file)")
    group.add_argument("--no-record", action="store_true", help="do not rewrite the served section of docs/BENCHMARKS.md")


def step_settings(args):
    """The bench settings the step runs with (one warm-up pass; the sweep from --concurrency)."""
    from kiln.bench.run import BenchSettings

    levels = tuple(int(part) for part in args.concurrency.split(",") if part.strip())
    return BenchSettings(runs=args.runs, warmup=1, concurrency=levels)


def run_step(args) -> int:
    import shlex
    import tempfile

    from kiln.bench.battery import CASES
    from kiln.bench.evidence import evidence, machine_info
    from kiln.bench.run import run_battery, run_speed

    env = dict(os.environ)
    settings = step_settings(args)
    try:
        if args.against_stock and args.overlay is None:
            raise StepError("--against-stock needs --overlay DIR (the stock vLLM is the installed one)")
        model = choose_model(args.model, args.hf_home)
        with tempfile.TemporaryDirectory(prefix="kiln-serve-") as scratch:
            scratch = Path(scratch)
            overlay = None
            if args.overlay is not None:
                overlay = scratch / "overlay"
                patched = prepare_overlay(args.vllm_python, args.overlay, overlay, env)
            elif args.manifest.is_file():
                patched = verify_manifest(args.manifest)
            else:
                raise StepError(f"no kiln-patched vLLM: run inside a kiln image ({args.manifest}) "
                                "or pass --overlay DIR (from `build.py apply --out DIR`)")
            share = 0.4 if args.against_stock else 0.85
            extra = shlex.split(args.serve_args)
            plan = {"A": (args.port or free_port(), overlay)}
            if args.against_stock:
                plan["B"] = (free_port(), None)
            servers, endpoints = {}, {}
            try:
                for label, (port, tree) in plan.items():  # one at a time: each profiles GPU memory
                    servers[label] = Server(serve_command(args.vllm_python, model, port, share, extra),
                                            serve_env(env, tree), scratch / f"server-{label}.log")
                    endpoints[label] = servers[label].wait_ready(args.ready_timeout)
                speed = run_speed(endpoints, settings)
                battery = run_battery(endpoints, CASES, args.battery_runs, settings) if args.battery_runs else None
            finally:
                for server in servers.values():
                    server.stop()
    except StepError as err:
        print(f"gpu_check: {err}", file=sys.stderr)
        return 2
    data = evidence(endpoints, {}, settings, speed, battery, machine_info())
    data["served"] = {"patched": patched, "model": {"name": model.name, "path": str(model.path), "size": model.size,
                                                   "model_type": model.model_type},
                      "commands": {label: server.command for label, server in servers.items()}}
    target = args.evidence or Path(tempfile.gettempdir()) / "kiln-served-bench.json"
    target.write_text(json.dumps(data, indent=2) + "\n")
    section = served_section(data, patched, model)
    if not args.no_record:
        record(section)
    failed = data["speed"]["failed_requests"]
    print(section if not args.json else json.dumps({"evidence": str(target), "failed_requests": failed,
                                                    "battery": (data["battery"] or {}).get("clean")}, indent=2))
    print(f"evidence: {target}", file=sys.stderr)
    return 1 if failed else 0
