"""Ahead-of-time Triton kernel caches: compile per SM, check with a fresh process, make a layer.

Public API:
    KernelSources(changed, pristine_root)     the patched tree as the image will hold it
    SmCache(sm, root, key, launches, failures, compiled, cached, seconds, libtriton)
    compile_kernel_caches(preset, sms, sources, toolchain, cache, runtime_env=None, jobs=None,
        runtime_dir=RUNTIME_CACHE_DIR, progress=None, image_libtriton=None) -> dict[int, SmCache]
    kernel_cache_files(sm_cache, toolchain, preset, runtime_dir=RUNTIME_CACHE_DIR) -> dict[str, bytes]
    stage_sources(preset, sources) -> (Path, str)   the files the worker imports, staged; their hash
    reads_source(preset, rel) -> bool     whether the compile reads vLLM's ``rel`` (kernel dirs + config)
    KERNEL_AUDIT_PATH     "opt/kiln/triton-kernels.json" (inside the image)

Per SM, in its own process (SMs in parallel, up to ``KILN_JOBS`` or the core count): the worker
(``worker.py``) launches vLLM's launchers through Triton's JIT path with a stand-in driver,
which writes a normal Triton cache (``TRITON_STORE_BINARY_ONLY=1``: cubin, metadata, source,
group file). The group files name their members by absolute path, so they are rewritten to
``runtime_dir`` — the image's ``TRITON_CACHE_DIR``. Then a fresh worker process runs the same
launches against a copy of the finished cache (prefix mapped to the copy's path: the check
needs no root and no mount namespace) and must compile nothing; a miss fails the build with
the kernel, its launch parameters and, where the metadata tells, the ingredient that differs.

Finished caches are kept under ``<cache>/triton/kernels/<key>/``; the key covers the toolchain
(version + RECORD fingerprint), the SM, the preset, the launch plan, every staged source
file, the worker's own code, the runtime path and Triton environment variables. The same key
gives the same bytes, so the layer built from an entry has the same digest every time.

Known limitation (reported, not fatal): on sm_86 (and every SM below 89) vLLM stores fp8 keys
as fp8e4b15, and Triton 3.6 converts only fp16/fp32 to it, so ``_tq_fused_store_fp8`` for a
bf16 model does not compile; the build prints a warning, records it in the audit file and
builds the rest. The same compile fails on a real GPU: the store falls back to nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from kiln import lifeline
from kiln.cache import install_dir
from kiln.errors import KilnError, no_space
from kiln.jobs import worker_count
from kiln.pausepoint import pause_point
from kiln.triton import standin_torch
from kiln.triton import worker as worker_module
from kiln.triton.kernels import RUNTIME_CACHE_DIR, KernelPreset, launch_plan

# the sources half, re-exported: callers import it from here
from kiln.triton.sources import KernelSources, reads_source, stage_sources  # noqa: F401
from kiln.triton.toolchain import Toolchain
from kiln.triton.worker_process import no_space_in

KERNEL_AUDIT_PATH = "opt/kiln/triton-kernels.json"
FORMAT = 1  # bump when what an entry holds changes
_WORKER = Path(worker_module.__file__)
_WORKER_KEYS = _WORKER.with_name("worker_keys.py")  # loaded by the worker: how it keys entries
_STANDIN_TORCH = Path(standin_torch.__file__)  # the worker's tensors (no torch needed)
# Environment variables that may change Triton's cache key or output (Triton reads them by name).
_ENV_PREFIXES = ("TRITON_", "DISABLE_", "PTXAS_", "LLVM_", "MLIR_", "NVPTX_", "AMDGCN_")
_ENV_NOT_KEYED = {"TRITON_CACHE_DIR", "TRITON_HOME", "TRITON_DUMP_DIR", "TRITON_OVERRIDE_DIR",
                  "TRITON_CACHE_AUTOTUNING", "TRITON_PRINT_AUTOTUNING"}
# Metadata fields worth naming when a self-check misses.
_META_FIELDS = ("target", "num_warps", "num_stages", "num_ctas", "maxnreg", "enable_fp_fusion",
                "launch_pdl", "launch_cooperative_grid", "debug", "arch", "ptx_options",
                "instrumentation_mode", "triton_version", "supported_fp8_dtypes")


@dataclass
class SmCache:
    sm: int
    root: Path  # the finished cache directory; group files name ``runtime_dir``
    key: str
    launches: list[dict]  # per launch: kernel, params, kernels (name, hash), error
    failures: list[dict] = field(default_factory=list)  # known limitations (kernel, params, error)
    compiled: int = 0  # Triton compiles the build ran (0 when the entry came from the cache)
    cached: bool = False
    seconds: float = 0.0
    libtriton: str = ""  # the libtriton.so sha256 its entries are keyed with (the image's Triton's)
    ptxas: list[str] = field(default_factory=list)  # the image's ptxas --version texts keyed for (another machine's)


# -- worker processes ---------------------------------------------------------------------------


def _worker_env(cache_dir: Path, home: Path, runtime_env: dict[str, str], binary_only: bool) -> dict[str, str]:
    # TMPDIR: Triton writes each kernel's PTX and ptxas log to temporary files that it removes
    # only once ptxas is done; a build killed meanwhile left them in /tmp. Under ``home`` they are
    # in the cache's fill directory, removed with it (``kiln.cache.install_dir``).
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "TRITON_HOME": str(home),
           "TMPDIR": str(home), "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0", "LC_ALL": "C.UTF-8"}
    env.update(runtime_env)
    env["TRITON_CACHE_DIR"] = str(cache_dir)
    if binary_only:
        env["TRITON_STORE_BINARY_ONLY"] = "1"
    return env


def _run_worker(toolchain: Toolchain, job: dict, env: dict[str, str], workdir: Path, sm: int) -> dict:
    job_path = workdir / f"job-{job['mode']}.json"
    job = {**job, "report": str(workdir / f"report-{job['mode']}.json")}
    job_path.write_text(json.dumps(job))
    # (it dies with this process: a killed build leaves no compile running, kiln.lifeline)
    result = lifeline.run([toolchain.python, str(_WORKER), str(job_path)], env=env, cwd=workdir,
                          started=lambda: pause_point("kernels"))
    if full := no_space_in(result.returncode, result.stderr):  # a full disk, one line
        raise no_space(OSError(full[0], os.strerror(full[0])), full[1] or workdir, None, f"sm_{sm}: the Triton kernels")
    if result.returncode != 0:
        tail = "\n".join((result.stderr or result.stdout).strip().splitlines()[-6:])
        raise KilnError(f"sm_{sm}: the Triton kernel worker failed ({job['mode']}): {tail}")
    return json.loads(Path(job["report"]).read_text())


def is_known_limitation(sm: int, preset: KernelPreset, launch: dict, error: str) -> bool:
    """sm < 89 stores fp8 keys as fp8e4b15, which Triton 3.6 converts from fp16/fp32 only."""
    return (sm < 89 and preset.dtype == "bfloat16" and launch["kernel"] == "turboquant_store"
            and ("fp8e4b15" in error or "convert_custom_float8" in error or "float8e4b15" in error))


def rewrite_group_prefix(root: Path, old: str, new: str) -> int:
    """Point every ``__grp__*.json`` member path under ``old`` to ``new``; returns files changed."""
    old, new = old.rstrip("/"), new.rstrip("/")
    count = 0
    for group in sorted(root.glob("*/__grp__*.json")):
        data = json.loads(group.read_text())
        children = data.get("child_paths") or {}
        for name, path in children.items():
            if path == old or path.startswith(old + "/"):
                children[name] = new + path[len(old):]
            else:
                raise KilnError(f"{group}: member {name} is at {path}, outside {old}")
        # the format Triton's FileCacheManager.put_group writes
        group.write_text(json.dumps({"child_paths": children}))
        count += 1
    return count


def _entries_by_hash(root: Path) -> dict[str, dict]:
    found = {}
    for meta in root.glob("*/*.json"):
        if meta.name.startswith("__grp__"):
            continue
        data = json.loads(meta.read_text())
        if isinstance(data, dict) and "hash" in data:
            found[data["hash"]] = data
    return found


def _miss_reason(miss: dict, check_root: Path, built: dict[str, dict]) -> str:
    new = _entries_by_hash(check_root).get(miss.get("hash") or "")
    same_name = [m for m in built.values() if m.get("name") == miss.get("name")]
    if new is None or not same_name:
        return "no cached kernel of that name"
    diffs = []
    for name in _META_FIELDS:
        values = {json.dumps(m.get(name), sort_keys=True) for m in same_name}
        now = json.dumps(new.get(name), sort_keys=True)
        if now not in values:
            diffs.append(f"{name} {now} vs {' / '.join(sorted(values))}")
    if diffs:
        return "; ".join(diffs)
    return "same options and target: the source, its line numbers, the argument specialisation or the environment differ"


# -- one SM -------------------------------------------------------------------------------------


def _entry_key(toolchain: Toolchain, sm: int, preset: KernelPreset, plan: list[dict], source_hash: str,
               runtime_dir: str, runtime_env: dict[str, str], key_libtriton: dict | None,
               key_ptxas: dict | None = None) -> str:
    ingredients = {
        "format": FORMAT, "triton": toolchain.version, "toolchain": toolchain.fingerprint, "sm": sm,
        "key_libtriton": key_libtriton,
        "preset": preset.to_json(), "plan": plan, "sources": source_hash, "runtime_dir": runtime_dir,
        "env": sorted(runtime_env.items()), "worker": hashlib.sha256(_WORKER.read_bytes() + _WORKER_KEYS.read_bytes()).hexdigest(),
        "tensors": hashlib.sha256(_STANDIN_TORCH.read_bytes()).hexdigest(),
    }
    if key_ptxas:  # an image of another machine (absent otherwise: the host's entries keep their keys)
        ingredients["key_ptxas"] = sorted(key_ptxas.items())
    return hashlib.sha256(json.dumps(ingredients, sort_keys=True).encode()).hexdigest()


def _build_one(sm: int, preset: KernelPreset, plan: list[dict], staged: Path, toolchain: Toolchain,
               entries: Path, key: str, runtime_dir: str, runtime_env: dict[str, str],
               key_libtriton: dict | None, key_ptxas: dict | None = None) -> SmCache:
    final = entries / key
    started = time.monotonic()
    built: dict = {}

    def fill(work: Path) -> None:
        launches, failures, compiled = _compile_and_check(sm, preset, plan, staged, toolchain, work, runtime_dir,
                                                          runtime_env, key_libtriton, key_ptxas)
        (work / "entry.json").write_text(json.dumps({"sm": sm, "key": key, "launches": launches,
                                                     "failures": failures}, indent=1, sort_keys=True))
        shutil.rmtree(work / "home", ignore_errors=True)
        shutil.rmtree(work / "check", ignore_errors=True)
        for leftover in work.glob("job-*.json"):
            leftover.unlink()
        built["compiled"] = compiled

    install_dir(final, fill)  # filled under a lock and renamed into place, or found there
    record = json.loads((final / "entry.json").read_text())
    return SmCache(sm, final / "cache", key, record["launches"], record["failures"], built.get("compiled", 0),
                   "compiled" not in built, round(time.monotonic() - started, 3),
                   (key_libtriton or {}).get("image") or toolchain.libtriton_sha256,
                   sorted((key_ptxas or {}).values()))


def _compile_and_check(sm: int, preset: KernelPreset, plan: list[dict], staged: Path, toolchain: Toolchain,
                       work: Path, runtime_dir: str, runtime_env: dict[str, str], key_libtriton: dict | None,
                       key_ptxas: dict | None = None):
    home = work / "home"
    home.mkdir()
    build_dir = work / "cache"
    job = {"sm": sm, "toolchain_site": str(toolchain.staged_site()), "roots": [str(staged)],
           "standin_torch": str(_STANDIN_TORCH), "preset": preset.to_json(), "launches": plan,
           "key_libtriton": key_libtriton, **({"key_ptxas": key_ptxas} if key_ptxas else {})}
    report = _run_worker(toolchain, {**job, "mode": "compile"}, _worker_env(build_dir, home, runtime_env, True),
                         work, sm)
    if report.get("triton") != toolchain.version:
        raise KilnError(f"sm_{sm}: the worker ran Triton {report.get('triton')}, not the toolchain's {toolchain.version}")
    launches, failures, errors = [], [], []
    for entry, launch in zip(report["launches"], plan, strict=True):
        kernels = sorted({(k["name"], k["hash"]) for k in entry["compiled"] + entry["hits"]})
        launches.append({"kernel": launch["kernel"], "params": launch["params"],
                         "kernels": [{"name": n, "hash": h} for n, h in kernels], "error": entry["error"]})
        if entry["error"]:
            if is_known_limitation(sm, preset, launch, entry["error"]):
                failures.append({"kernel": launch["kernel"], "params": launch["params"],
                                 "error": _summary(entry["error"])})
            else:
                errors.append((launch, entry["error"]))
    if errors and len(errors) == len(plan):
        raise KilnError(f"sm_{sm}: Triton {toolchain.version} cannot compile any kernel for this SM: "
                        f"{_summary(errors[0][1])}")
    if errors:
        launch, error = errors[0]
        raise KilnError(f"sm_{sm}: kernel {launch['kernel']} ({_params(launch['params'])}) does not compile: "
                        f"{_summary(error)}")
    compiled = sum(len(e["compiled"]) for e in report["launches"])
    if not build_dir.is_dir():
        build_dir.mkdir()
    rewrite_group_prefix(build_dir, str(build_dir), runtime_dir)
    _self_check(sm, plan, job, launches, toolchain, work, build_dir, runtime_dir, runtime_env)
    return launches, failures, compiled


def _self_check(sm: int, plan: list[dict], job: dict, launches: list[dict], toolchain: Toolchain, work: Path,
                build_dir: Path, runtime_dir: str, runtime_env: dict[str, str]) -> None:
    """A fresh process over a copy of the finished cache must hit every kernel and compile none."""
    check_dir = work / "check"
    shutil.copytree(build_dir, check_dir)
    rewrite_group_prefix(check_dir, runtime_dir, str(check_dir))
    built = _entries_by_hash(build_dir)
    report = _run_worker(toolchain, {**job, "mode": "check"},
                         _worker_env(check_dir, work / "home", runtime_env, False), work, sm)
    for entry, launch, expected in zip(report["launches"], plan, launches, strict=True):
        if entry["compiled"]:
            miss = entry["compiled"][0]
            raise KilnError(
                f"sm_{sm}: self-check: kernel {launch['kernel']} ({_params(launch['params'])}) compiled "
                f"{miss['name']} again instead of loading it from the cache; differs: "
                f"{_miss_reason(miss, check_dir, built)}")
        hit = {k["hash"] for k in entry["hits"]}
        wanted = {k["hash"] for k in expected["kernels"]}
        if not hit <= wanted:
            raise KilnError(f"sm_{sm}: self-check: kernel {launch['kernel']} loaded kernels the build did not make")
        if bool(entry["error"]) != bool(expected["error"]):
            raise KilnError(f"sm_{sm}: self-check: kernel {launch['kernel']} ({_params(launch['params'])}) "
                            f"behaved differently in a fresh process: {entry['error'] or 'no error'}")
    seen = {k["hash"] for e in report["launches"] for k in e["hits"]}
    missing = {k["hash"] for e in launches for k in e["kernels"]} - seen
    if missing:
        raise KilnError(f"sm_{sm}: self-check: {len(missing)} built kernel(s) were never loaded from the cache")


def _summary(error: str) -> str:
    """The first line of a worker error and, for a compile error, the line that says why."""
    lines = [line.strip() for line in error.splitlines() if line.strip()]
    parts = lines[:1]
    caret = [i for i, line in enumerate(lines) if line == "^"]
    if caret and caret[0] > 0:
        parts.append(f"`{lines[caret[0] - 1]}`")  # the source line Triton points at
    parts += [line for line in lines[1:] if line.startswith("caused by")][-1:]
    return " ".join(parts)[:400]


def _params(params: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in params.items())


# -- all SMs ------------------------------------------------------------------------------------


def key_environment(env: dict[str, str]) -> dict[str, str]:
    """The variables of an image's environment that Triton reads while compiling."""
    return {k: v for k, v in sorted(env.items()) if k.startswith(_ENV_PREFIXES) and k not in _ENV_NOT_KEYED}


def compile_kernel_caches(preset: KernelPreset, sms: list[int], sources: KernelSources, toolchain: Toolchain,
                          cache: Path, runtime_env: dict[str, str] | None = None, jobs: int | None = None,
                          runtime_dir: str = RUNTIME_CACHE_DIR,
                          progress: Callable[[SmCache], None] | None = None,
                          image_libtriton: str | None = None,
                          image_ptxas: dict[str, str] | None = None) -> dict[int, SmCache]:
    """Compile, check and keep the kernel cache of every SM (one worker process per SM)."""
    if not runtime_dir.startswith("/"):
        raise KilnError(f"Triton cache path {runtime_dir!r}: must be absolute")
    env = key_environment(runtime_env or {})
    plan = launch_plan(preset, sources.runtime_layout())
    own = toolchain.libtriton_sha256
    key_libtriton = {"own": own, "image": image_libtriton} if image_libtriton and image_libtriton != own else None
    key_ptxas = dict(image_ptxas) if image_ptxas and any(own != text for own, text in image_ptxas.items()) else None
    staged, source_hash = stage_sources(preset, sources)
    entries = cache / "triton" / "kernels"
    entries.mkdir(parents=True, exist_ok=True)
    workers = worker_count(len(sms), jobs)
    results: dict[int, SmCache] = {}
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = {
            sm: pool.submit(_build_one, sm, preset, plan, staged, toolchain, entries,
                            _entry_key(toolchain, sm, preset, plan, source_hash, runtime_dir, env, key_libtriton,
                                       key_ptxas),
                            runtime_dir, env, key_libtriton, key_ptxas)
            for sm in sms
        }
        for sm, future in futures.items():
            results[sm] = future.result()
            if progress:
                progress(results[sm])
    return results


# -- the layer ----------------------------------------------------------------------------------


def kernel_cache_files(sm_cache: SmCache, toolchain: Toolchain, preset: KernelPreset,
                       runtime_dir: str = RUNTIME_CACHE_DIR) -> dict[str, bytes]:
    """Image path -> bytes: the cache under ``runtime_dir`` and the audit file."""
    prefix = runtime_dir.strip("/")
    files: dict[str, bytes] = {}
    for path in sorted(sm_cache.root.rglob("*")):
        if path.is_file():
            files[f"{prefix}/{path.relative_to(sm_cache.root).as_posix()}"] = path.read_bytes()
    audit = {
        "schema": 1,
        "sm": sm_cache.sm,
        "triton": {"version": toolchain.version, "record_sha256": toolchain.fingerprint, "wheel": toolchain.wheel,
                   "wheel_sha256": toolchain.wheel_sha256, "keyed_for_libtriton_sha256": sm_cache.libtriton,
                   **({"keyed_for_ptxas_version": sm_cache.ptxas} if sm_cache.ptxas else {})},
        "cache_dir": runtime_dir,
        "key": sm_cache.key,
        "preset": preset.to_json(),
        "launches": sm_cache.launches,
        "not_built": sm_cache.failures,
    }
    files[KERNEL_AUDIT_PATH] = (json.dumps(audit, indent=2, sort_keys=True) + "\n").encode()
    return files
