"""A serve bundle for the GPU machine (issue 37): what it lacks to serve kiln's v0.20.1 vLLM, in parts.

    PYTHONPATH=. .venv/bin/python ci/gpu_serve_bundle.py --out DIR --gpu-triton-record RECORD \\
        --model-python PY [--image qwen3.6-27b-tq] [--pin v0.20.1] [--sm 90] [--python-version 3.12]

The GPU machine (Python 3.12.3, torch 2.11.0 cu130, Triton 3.6.0, no network; its packages in
``ci/gpu_machine_packages.txt``) has vLLM 0.20.1's torch, not vLLM. DIR gets:

- ``parts/part-NNN``: one tar of the bundle cut into parts of at most ``--part-mib`` MiB (default 44:
  a run carries 64 MiB with the checkout, 14.1 MiB on 2026-11-30, and ci/upstream's records grow it), and ``parts/manifest.json``: each part's sha256
  and size, the whole tar's sha256, and what the bundle holds (``bundle.json``, below);
- ``stage/``: the bundle unpacked (what the tar holds).

What the bundle holds (``bundle.json`` records each file's sha256):

1. ``wheels/vllm-0.20.1-…whl``: PyPI's wheel (sha256 from the simple JSON index, kiln's
   ``kiln.source.wheel``), repacked without the files the run does not load (``OMIT_FROM_VLLM``:
   each with the reason, read from 0.20.1's own code), its RECORD rewritten to match.
2. ``wheels/*.whl``: vLLM's requirements the machine lacks (or has at a version vLLM refuses),
   resolved for the machine's Python and platform by pip (``--dry-run --report``, one round per
   level of the graph, PyPI only: this machine's pip mirror is ignored), downloaded by kiln and
   checked against PyPI's sha256. ``OMIT_DEPS``: requirements left out, each with the reason.
3. ``overlay/``: kiln's patched-source layer for (image, pin, SM), made by kiln's build code
   (``kiln.verify.patched_source``: the build's checks and selection call;
   ``kiln.image.layers.audit_record`` / ``patched_contents``: the layer's files, the definition's
   baked files and ``/opt/kiln/manifest.json``), with the site dir ``site`` (where the assembler
   installs vLLM).
4. ``kernels/``: kiln's Triton kernel layer for the SM (``kiln.triton.aot.compile_kernel_caches``
   keyed for the machine's ``libtriton.so`` from RECORD, ``kernel_cache_files``): ``opt/kiln/triton-cache``.
5. ``model/``: a tiny Qwen3.5/3.6 hybrid made here (``ci/cpu/tiny_model.py --family qwen3_5``)
   with ``--model-python`` (a Python with torch, transformers, tokenizers, safetensors).

Why not ``build.py build --oci`` on a stand-in base: the two layers would be the same bytes (the
build calls the same functions), and a stand-in base would need a Python site dir and a Triton
dist-info faked to the machine's; the functions above take the machine's Triton RECORD directly.

``ci/gpu_serve_assemble.py`` (stdlib only) puts it together on the machine.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

import requests

# the hash the assembler checks the parts with on the GPU machine, one definition for both ends
# (run as a script, this file's folder is on sys.path; the assembler is stdlib only)
from gpu_serve_assemble import sha256_file  # noqa: E402
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

import kiln  # noqa: F401  (kiln's public API below; run with kiln importable, no sys.path edit)
from kiln.cache import cache_root
from kiln.errors import KilnError
from kiln.image.layers import audit_record, patched_contents
from kiln.oci.digest import sha256_text
from kiln.paths import RepoFiles
from kiln.source.wheel import choose_wheel, list_release_files
from kiln.triton import aot
from kiln.triton.imagekey import runtime_key
from kiln.triton.keyfiles import read_key_sources
from kiln.triton.toolchain import toolchain_for
from kiln.verify import patched_source

CI = Path(__file__).resolve().parent
MACHINE_PACKAGES = CI / "gpu_machine_packages.txt"
TINY_MODEL = CI / "cpu" / "tiny_model.py"
PYPI = "https://pypi.org/simple"
SITE = "site"  # the overlay's site dir: the assembler installs vLLM into PREFIX/site
MIB = 1 << 20
MAX_DOWNLOAD = 512 * MIB  # no wheel the bundle takes is larger (vLLM's is 233 MiB)
FORMAT = 1

# Files of vLLM 0.20.1's wheel the serve run on sm_90 does not load, and why (read from its code).
OMIT_FROM_VLLM = {
    "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so": (
        "FA3: with a turboquant_* KV cache, create_engine_config sets attention_config.flash_attn_version "
        "to 2 (engine/arg_utils.py:2003-2014: 'TurboQuant is not yet compatible with FlashAttention >= 3'), "
        "so TurboQuant's prefill calls FA2's varlen_fwd (vllm_flash_attn/flash_attn_interface.py:300); "
        "flash_attn_interface imports _vllm_fa3_C in a try/except (:22-27), so its absence only marks FA3 "
        "unsupported. FA2 is kept: the H200 run of 2026-11-30 left FA2 out and its first request died "
        "in _vllm_fa2_C.varlen_fwd (docs/gpu/h200-2026-11-30-serve)"),
    "vllm/_moe_C.abi3.so": (
        "fused-MoE ops: Qwen3.6-27B and the tiny model are dense; Platform.import_kernels imports it "
        "under contextlib.suppress(ImportError) (platforms/interface.py:242)"),
}

# Requirements of vLLM 0.20.1 the bundle leaves out, and why.
OMIT_DEPS = {
    "flashinfer-python": (
        "GDN prefill on sm_90 would use FlashInfer's JIT-compiled kernel (gdn_linear_attn.py, "
        "ChunkGatedDeltaRule); the run sets gdn_prefill_backend=triton (Triton/FLA, as on sm_86/89/120) "
        "so the first request compiles no CUDA; the sampler uses it only with VLLM_USE_FLASHINFER_SAMPLER"),
    "flashinfer-cubin": "FlashInfer's prebuilt kernels: FlashInfer is not carried (above)",
    "tilelang": "TileLang kernels (DeepSeek sparse attention): no such model here",
    "nvidia-cutlass-dsl": "CuTe DSL kernels (FA4 on sm_100, quack): not on sm_90 with FA3",
    "quack-kernels": "CuTe DSL kernels for Blackwell: not on sm_90",
    "nvidia-cudnn-frontend": "cuDNN frontend: FlashInfer's cuDNN paths only",
    "fastsafetensors": "GPU-direct safetensors loading: only with --load-format fastsafetensors",
}


# vLLM 0.20.1's own pins the bundle does not hold it to, and why: its other requirements then decide.
RELAXED = {
    "apache-tvm-ffi": (
        "vLLM pins ==0.1.9 for FlashInfer's and TileLang's ABI, neither carried; xgrammar (structured "
        "output, hence forced tool calls) imports it too, and every xgrammar that takes 0.1.9 (<=0.2.5) "
        "needs transformers<5, which would shadow the machine's 5.17.0"),
}


def _fail(message: str) -> int:
    print(f"gpu_serve_bundle: {message}", file=sys.stderr)
    return 2


# -- downloads: bounded, sha256-checked, content-addressed ----------------------------------------


def fetch(url: str, sha256: str, filename: str, downloads: Path) -> Path:
    """``downloads/<sha256>/<filename>``: reused when its bytes hash to ``sha256``, else fetched."""
    if not re.fullmatch(r"[0-9a-f]{64}", sha256 or ""):
        raise KilnError(f"{filename}: the index gives no sha256; refusing an unverifiable download")
    target = downloads / sha256 / filename
    if target.is_file():
        if sha256_file(target) == sha256:
            return target
        target.unlink()
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=".tmp-")
    tmp = Path(tmp_name)
    digest, size = hashlib.sha256(), 0
    try:
        with os.fdopen(fd, "wb") as out, requests.get(url, stream=True, timeout=120) as resp:
            if resp.status_code != 200:
                raise KilnError(f"{filename}: {url} answered HTTP {resp.status_code}")
            for chunk in resp.iter_content(MIB):
                size += len(chunk)
                if size > MAX_DOWNLOAD:
                    raise KilnError(f"{filename}: larger than {MAX_DOWNLOAD // MIB} MiB; refusing it")
                digest.update(chunk)
                out.write(chunk)
        if digest.hexdigest() != sha256:
            raise KilnError(f"{filename}: sha256 mismatch (index says {sha256}, downloaded {digest.hexdigest()})")
        os.replace(tmp, target)
    except requests.RequestException as err:
        raise KilnError(f"{filename}: download from {url} failed: {err.__class__.__name__}") from None
    finally:
        tmp.unlink(missing_ok=True)
    return target


# -- 1. vLLM's wheel, without what the run does not load ------------------------------------------


def vllm_wheel(version: str, downloads: Path) -> tuple[Path, dict]:
    chosen = choose_wheel(Version(version), list_release_files(Version(version)))
    return fetch(chosen.url, chosen.sha256, chosen.filename, downloads), {
        "filename": chosen.filename, "sha256": chosen.sha256, "url": chosen.url}


def trim_wheel(wheel: Path, out_dir: Path, omit: dict[str, str]) -> dict:
    """``wheel`` again under its name in ``out_dir`` without ``omit``'s members, RECORD to match."""
    out = out_dir / wheel.name
    omitted = []
    with zipfile.ZipFile(wheel) as src:
        names = src.namelist()
        missing = sorted(set(omit) - set(names))
        if missing:
            raise KilnError(f"{wheel.name}: has no {missing[0]} to leave out (OMIT_FROM_VLLM is for another wheel)")
        record_name = next(n for n in names if n.endswith(".dist-info/RECORD"))
        with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=6) as dst:
            for info in src.infolist():
                if info.filename in omit:
                    omitted.append({"path": info.filename, "size": info.file_size, "reason": omit[info.filename]})
                elif info.filename == record_name:
                    lines = [line for line in src.read(info).decode().splitlines()
                             if line.split(",", 1)[0] not in omit]
                    dst.writestr(info, ("\n".join(lines) + "\n").encode(), compress_type=zipfile.ZIP_DEFLATED)
                else:
                    _copy_member(src, info, dst)
    return {"filename": out.name, "omitted": omitted}


def _copy_member(src: zipfile.ZipFile, info: zipfile.ZipInfo, dst: zipfile.ZipFile) -> None:
    """``info``'s compressed bytes from ``src`` into ``dst`` as they are: no inflating and deflating
    again (most of a 233 MiB wheel's repacking time), the member's CRC and sizes unchanged. zipfile
    has no public call for it; this writes what ``ZipFile.write`` writes, from the member's own
    local header on."""
    src.fp.seek(info.header_offset)
    header = src.fp.read(zipfile.sizeFileHeader)
    if header[:4] != zipfile.stringFileHeader:
        raise KilnError(f"{info.filename}: no local file header at offset {info.header_offset}")
    name_len, extra_len = int.from_bytes(header[26:28], "little"), int.from_bytes(header[28:30], "little")
    src.fp.seek(name_len + extra_len, os.SEEK_CUR)
    raw = src.fp.read(info.compress_size)
    if len(raw) != info.compress_size:
        raise KilnError(f"{info.filename}: {len(raw)} of its {info.compress_size} compressed bytes")
    copied = zipfile.ZipInfo(info.filename, info.date_time)
    copied.compress_type, copied.external_attr, copied.create_system = (
        info.compress_type, info.external_attr, info.create_system)
    copied.CRC, copied.compress_size, copied.file_size = info.CRC, info.compress_size, info.file_size
    copied.flag_bits = info.flag_bits & 0x800  # UTF-8 names kept; no data descriptor: the header has the sizes
    dst.fp.seek(dst.start_dir)  # where the next member goes (the central directory, at close, after it)
    copied.header_offset = dst.start_dir
    dst.fp.write(copied.FileHeader(zip64=info.file_size > zipfile.ZIP64_LIMIT))
    dst.fp.write(raw)
    dst.start_dir = dst.fp.tell()
    dst.filelist.append(copied)
    dst.NameToInfo[copied.filename] = copied
    dst._didModify = True


# -- 2. vLLM's requirements the machine lacks -----------------------------------------------------


def machine_packages(path: Path = MACHINE_PACKAGES) -> dict[str, str | None]:
    found = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, *version = line.split()
            found[canonicalize_name(name)] = version[0] if version else None
    return found


def target_environment(python_version: str) -> dict[str, str]:
    env = default_environment()
    env.update(python_version=python_version, python_full_version=f"{python_version}.0", sys_platform="linux",
               platform_system="Linux", platform_machine="x86_64", os_name="posix",
               implementation_name="cpython", platform_python_implementation="CPython")
    return env


def applies(req: Requirement, env: dict[str, str], extras: set[str]) -> bool:
    if req.marker is None:
        return True
    return any(req.marker.evaluate({**env, "extra": extra}) for extra in (extras or {""}) | {""})


PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (17, 24, 26, 27, 28, 31, 34, 35, 39)] + [
    "manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64", "linux_x86_64"]


def pip_resolve(lines: list[str], python_version: str, work: Path) -> list[dict]:
    """What pip picks from PyPI for each requirement line, for the machine (no dependencies followed)."""
    reqs, report = work / "reqs.txt", work / "report.json"
    reqs.write_text("\n".join(lines) + "\n")
    report.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE="/dev/null", PIP_DISABLE_PIP_VERSION_CHECK="1")
    command = [sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps", "--ignore-installed",
               "--target", str(work / "never"), "--report", str(report), "--index-url", PYPI,
               "--only-binary=:all:", "--python-version", python_version, "--implementation", "cp",
               *[arg for p in PLATFORMS for arg in ("--platform", p)], "-r", str(reqs)]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise KilnError(f"pip cannot resolve {reqs.name} for Python {python_version}: {last}")
    return json.loads(report.read_text())["install"]


def resolve_deps(vllm_metadata: str, python_version: str, machine: dict[str, str | None], work: Path,
                 restarts: int = 12) -> dict:
    """Which requirements the machine meets, which are carried (with the wheel pip chose), which omitted.

    pip picks each level's versions without seeing the next level's requirements, so a choice can
    conflict with a later requirement (xgrammar 0.2.9 needs apache-tvm-ffi>=0.1.11; vLLM pins 0.1.9).
    Then the resolution starts again holding back the package that asked (below the version chosen)
    when vLLM itself pins the other one, else with the later requirement added: a small backtrack,
    at most ``restarts`` times. What was held back is in the result."""
    held: dict[str, list[str]] = {}
    for _ in range(restarts + 1):
        result, conflict = _resolve_once(vllm_metadata, python_version, machine, work, held)
        if conflict is None:
            return {**result, "held_back": {name: ",".join(specs) for name, specs in held.items()}}
        name, req, parent, by_vllm = conflict
        if by_vllm and parent != "vllm":
            held.setdefault(parent, []).append(f"<{result['carried'][parent]['version']}")
        elif not by_vllm and str(req.specifier) not in held.get(name, []):
            held.setdefault(name, []).append(str(req.specifier))
        else:
            raise KilnError(f"{name}: {result['carried'][name]['version']} was chosen, but {parent} needs {req}")
    raise KilnError(f"vLLM's requirements did not resolve after {restarts} restarts (held back: {held})")


def _resolve_once(vllm_metadata: str, python_version: str, machine: dict[str, str | None], work: Path,
                  held: dict[str, list[str]]) -> tuple[dict, tuple | None]:
    env = target_environment(python_version)
    wanted: dict[str, list[Requirement]] = {}  # name -> every requirement on it met so far
    asked_by: dict[int, str] = {}
    extras: dict[str, set[str]] = {}
    queue = [Requirement(line.split(":", 1)[1].strip()) for line in vllm_metadata.splitlines()
             if line.startswith("Requires-Dist:")]
    queue = [(req, "vllm") for req in queue if applies(req, env, set()) and canonicalize_name(req.name) not in RELAXED]
    carried: dict[str, dict] = {}
    on_machine: dict[str, dict] = {}
    omitted: dict[str, dict] = {}
    rounds = 0
    while queue:
        rounds += 1
        fresh: dict[str, list[Requirement]] = {}
        for req, by in queue:
            name = canonicalize_name(req.name)
            wanted.setdefault(name, []).append(req)
            asked_by[id(req)] = by
            new_extras = set(req.extras) - extras.setdefault(name, set())
            extras[name] |= set(req.extras)
            if name in OMIT_DEPS:
                omitted.setdefault(name, {"reason": OMIT_DEPS[name], "required_by": []})["required_by"].append(by)
                continue
            have = machine.get(name, "absent")
            if name not in carried and have != "absent" and (have is None or req.specifier.contains(have, prereleases=True)):
                entry = on_machine.setdefault(name, {"version": have, "requires": []})
                entry["requires"].append(f"{req.name}{req.specifier} (by {by})")
                continue
            if name in carried and not new_extras:
                continue
            if have != "absent":
                on_machine.pop(name, None)
                omitted_reason = f"the machine has {have}, {by} needs {req.specifier}"
            else:
                omitted_reason = "not on the machine"
            fresh.setdefault(name, []).append(req)
            carried.setdefault(name, {"why": omitted_reason})
        queue = []
        if not fresh:
            break
        lines = []
        for name in sorted(fresh):
            specs = [str(r.specifier) for r in wanted[name] if str(r.specifier)] + held.get(name, [])
            lines.append(f"{name}{','.join(specs)}")
        for item in pip_resolve(lines, python_version, work):
            meta = item["metadata"]
            name = canonicalize_name(meta["name"])
            archive = item["download_info"]
            carried[name].update(version=meta["version"], url=archive["url"],
                                 sha256=archive.get("archive_info", {}).get("hashes", {}).get("sha256", ""),
                                 filename=archive["url"].rsplit("/", 1)[-1])
            for line in meta.get("requires_dist", []):
                req = Requirement(line)
                if applies(req, env, extras.get(name, set())):
                    queue.append((req, name))
        if rounds > 20:
            raise KilnError("vLLM's requirements did not settle in 20 rounds")
    result = {"carried": carried, "on_machine": on_machine, "omitted": omitted, "rounds": rounds,
              "relaxed": RELAXED}
    for name, info in carried.items():  # every requirement met so far holds for the version chosen
        for req in wanted[name]:
            if not req.specifier.contains(info["version"], prereleases=True):
                by_vllm = any(asked_by[id(r)] == "vllm" for r in wanted[name])
                return result, (name, req, asked_by[id(req)], by_vllm)
    return result, None


# -- 3 and 4. kiln's layers ------------------------------------------------------------------------


def kiln_layers(image: str, pin: str, sm: int, record: str, gpu_python: str, wheel_info: dict) -> tuple[dict, dict, dict]:
    """(patched-layer files, kernel-layer files, what was built): image path -> bytes."""
    patched = patched_source(RepoFiles(), image, sm, pin)
    definition, tree = patched.inputs.definition, patched.tree
    changed = patched.changed
    before = {rel: sha256_text(tree.read(rel)) for rel in changed if tree.exists(rel)}
    pin_json = {"name": patched.inputs.pin.name, "image": patched.inputs.pin.image, "vllm": str(patched.inputs.pin.vllm),
                "cuda": patched.inputs.pin.cuda, "digest": patched.inputs.pin.digest or None}
    audit = audit_record(image=definition.name, pin=pin_json, sm=sm,
                         base_reference=f"pypi:{wheel_info['filename']}", base_digest=f"sha256:{wheel_info['sha256']}",
                         site_dir=SITE, outcomes=patched.outcomes, before=before, changed=changed,
                         baked=definition.files)
    layer = patched_contents(changed, SITE, None, audit, baked=definition.files)
    match = re.search(r"^triton-([^/]+)\.dist-info/RECORD,", record, re.MULTILINE)
    if match is None:
        raise KilnError("--gpu-triton-record: not a Triton dist-info RECORD")
    preset = definition.model.kernels
    sources = aot.KernelSources(changed, tree.root)
    toolchain = toolchain_for(match.group(1), definition.name, cache_root())
    keyed = runtime_key(record, toolchain.record, gpu_python, toolchain.wheel_python,
                        read_key_sources(toolchain.site, toolchain.version))
    if keyed.problem:
        raise KilnError(f"the GPU machine's Triton cannot read kiln's cache: {keyed.problem}")
    built = aot.compile_kernel_caches(preset, [sm], sources, toolchain, cache_root(),
                                      image_libtriton=keyed.libtriton_sha256)[sm]
    kernels = aot.kernel_cache_files(built, toolchain, preset)
    info = {"image": definition.name, "pin": patched.inputs.pin.name, "sm": sm, "applied": patched.applied,
            "changed": sorted(changed), "triton": match.group(1), "libtriton_sha256": keyed.libtriton_sha256,
            "kernels": {"compiled": built.compiled, "from_cache": built.cached, "not_built": built.failures,
                        "launches": len(built.launches)},
            "serve_args": list(definition.serve_args), "serve_env": dict(definition.serve_env)}
    return dict(layer.files), kernels, info


# -- 5. the model ----------------------------------------------------------------------------------


def make_model(python: str, out: Path) -> dict:
    proc = subprocess.run([python, str(TINY_MODEL), "--family", "qwen3_5", str(out)], capture_output=True,
                          text=True, timeout=900)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise KilnError(f"{TINY_MODEL.name} with {python} failed: {last}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# -- the bundle ------------------------------------------------------------------------------------


def write_files(root: Path, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        target = root / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)


def tar_stage(stage: Path, out: Path) -> None:
    """A deterministic tar of ``stage`` (sorted, no owner, mtime 0)."""
    with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(stage.rglob("*")):
            rel = path.relative_to(stage).as_posix()
            info = tar.gettarinfo(str(path), rel)
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.mtime = 0
            info.mode = 0o755 if path.is_dir() or os.access(path, os.X_OK) else 0o644
            if path.is_file():
                with open(path, "rb") as handle:
                    tar.addfile(info, handle)
            elif path.is_dir():
                tar.addfile(info)


def split(tar_path: Path, parts: Path, part_bytes: int) -> list[dict]:
    listed = []
    with open(tar_path, "rb") as src:
        index = 0
        while True:
            chunk = src.read(part_bytes)
            if not chunk:
                break
            name = f"part-{index:03d}"
            (parts / name).write_bytes(chunk)
            listed.append({"name": name, "size": len(chunk), "sha256": hashlib.sha256(chunk).hexdigest()})
            index += 1
    return listed


def vllm_metadata(wheel: Path) -> str:
    with zipfile.ZipFile(wheel) as archive:
        return archive.read(next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))).decode()


def resolve_only(args) -> dict:
    downloads = args.downloads or cache_root() / "gpu-serve-bundle" / "downloads"
    pristine, _ = vllm_wheel(args.vllm, downloads)
    with tempfile.TemporaryDirectory(prefix="kiln-serve-bundle-") as work:
        return resolve_deps(vllm_metadata(pristine), args.python_version, machine_packages(), Path(work))


def build(args) -> dict:
    out: Path = args.out
    if out.exists() and any(out.iterdir()):
        raise KilnError(f"--out {out}: not a new or empty folder")
    record = args.gpu_triton_record.read_text()
    downloads = args.downloads or cache_root() / "gpu-serve-bundle" / "downloads"
    stage, parts = out / "stage", out / "parts"
    for folder in (stage / "wheels", parts):
        folder.mkdir(parents=True, exist_ok=True)
    pristine, wheel_info = vllm_wheel(args.vllm, downloads)
    vllm = trim_wheel(pristine, stage / "wheels", OMIT_FROM_VLLM)
    with tempfile.TemporaryDirectory(prefix="kiln-serve-bundle-") as work:
        deps = resolve_deps(vllm_metadata(pristine), args.python_version, machine_packages(), Path(work))
    for _, info in sorted(deps["carried"].items()):
        wheel = fetch(info["url"], info["sha256"], info["filename"], downloads)
        shutil.copyfile(wheel, stage / "wheels" / wheel.name)
    overlay, kernels, built = kiln_layers(args.image, args.pin, args.sm, record, args.python_version, wheel_info)
    write_files(stage / "overlay", overlay)
    write_files(stage / "kernels", kernels)
    model = make_model(args.model_python, stage / "model")
    files = {path.relative_to(stage).as_posix(): sha256_file(path) for path in sorted(stage.rglob("*")) if path.is_file()}
    bundle = {"format": FORMAT, "python": args.python_version, "site": SITE,
              "vllm": {**wheel_info, "repacked": vllm["filename"], "omitted": vllm["omitted"]},
              "deps": deps, "kiln": built, "model": model, "files": files}
    (stage / "bundle.json").write_text(json.dumps(bundle, indent=1, sort_keys=True) + "\n")
    tar_path = out / "bundle.tar"
    tar_stage(stage, tar_path)
    listed = split(tar_path, parts, args.part_mib * MIB)
    manifest = {"format": FORMAT, "bundle_sha256": sha256_file(tar_path), "bundle_size": tar_path.stat().st_size,
                "parts": listed}
    (parts / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    tar_path.unlink()
    return {"manifest": manifest, "bundle": bundle}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="a new or empty folder")
    parser.add_argument("--gpu-triton-record", type=Path, required=True,
                        help="the GPU machine's triton-X.dist-info/RECORD (keys the kernel cache)")
    parser.add_argument("--model-python", required=True,
                        help="a Python with torch, transformers, tokenizers and safetensors (makes the model)")
    parser.add_argument("--image", default="qwen3.6-27b-tq")
    parser.add_argument("--pin", default="v0.20.1")
    parser.add_argument("--vllm", default="0.20.1", help="the pin's vLLM release (its PyPI wheel)")
    parser.add_argument("--sm", type=int, default=90)
    parser.add_argument("--python-version", default="3.12", help="the GPU machine's Python (default: %(default)s)")
    parser.add_argument("--part-mib", type=int, default=44, help="largest part, MiB (default: %(default)s)")
    parser.add_argument("--downloads", type=Path, help="download cache (default: <kiln cache>/gpu-serve-bundle/downloads)")
    parser.add_argument("--resolve-only", action="store_true",
                        help="print which requirements are carried, met by the machine or omitted; build nothing")
    args = parser.parse_args(argv)
    try:
        if args.resolve_only:
            print(json.dumps(resolve_only(args), indent=1, sort_keys=True))
            return 0
        done = build(args)
    except (KilnError, OSError) as err:
        return _fail(str(err))
    manifest, bundle = done["manifest"], done["bundle"]
    print(json.dumps({"parts": len(manifest["parts"]), "bundle_mib": round(manifest["bundle_size"] / MIB, 1),
                      "wheels": sum(1 for f in bundle["files"] if f.startswith("wheels/")),
                      "carried": sorted(bundle["deps"]["carried"]), "omitted_deps": sorted(bundle["deps"]["omitted"]),
                      "applied": bundle["kiln"]["applied"], "kernels": bundle["kiln"]["kernels"]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
