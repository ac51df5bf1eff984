"""The warm step: boot the built image once from its files, send the fixed request set, capture the caches.

``warm_rootfs`` needs the image unpacked (``umoci unpack``, ``docker export``…) and root: the
server runs in the rootfs as ``boot.boot_chroot`` starts it, with the definition's serve args
and env, and the caches at their image paths (``key.warm_env``). What it returns is the bundle's
record: the key and its factors, what booted and on what machine, the versions the caches were
made with, vLLM's cache directories (named by its own config hash), the time to healthy, the
greedy answers, and what the compilers wrote outside the warm root (not baked).
"""

from __future__ import annotations

import json
import platform
import re
import socket
from pathlib import Path

from kiln.errors import KilnError
from kiln.image.layers import AUDIT_PATH
from kiln.image.warmlayer import MACHINE_PLATFORMS, WARM_ROOT, key_factors, warm_env, warm_key
from kiln.warm.boot import boot_chroot, send_requests, stop, wait_healthy
from kiln.warm.capture import capture, write_bundle

# vLLM's lines when it compiles and when it loads what it compiled (on CPU, DYNAMO_TRACE_ONCE: only the AOT ones)
COMPILED = re.compile(r"torch\.compile took|Starting torch\.compile|Compiling a graph|Dynamo bytecode transform time|"
                      r"saved AOT compiled function|Compiling model again")
LOADED = re.compile(r"Directly load AOT compilation|Directly load the compiled graph")
OUTSIDE = ("tmp", "root/.cache", "root/.triton")  # where torch, Inductor and Triton write by default


def audit_of(rootfs: Path) -> dict:
    try:
        return json.loads((rootfs / AUDIT_PATH).read_text())
    except (OSError, ValueError) as err:
        raise KilnError(f"{rootfs}: no kiln audit file /{AUDIT_PATH} ({err}): not a rootfs of a kiln image") from None


def files_under(rootfs: Path, folders=OUTSIDE) -> set[str]:
    return {p.relative_to(rootfs).as_posix() for folder in folders if (rootfs / folder).is_dir()
            for p in (rootfs / folder).rglob("*") if p.is_file()}


def versions(rootfs: Path, site_dir: str) -> dict[str, str]:
    """torch's, Triton's and Python's versions as the image installs them (its dist-info names)."""
    site = rootfs / site_dir.strip("/")
    found = {}
    for name in ("torch", "triton"):
        info = sorted(site.glob(f"{name}-*.dist-info"))
        found[name] = info[0].name[len(name) + 1:-len(".dist-info")] if info else None
    found["python"] = Path(site_dir).parent.name
    return found


def compile_evidence(log: Path) -> dict:
    text = log.read_text(errors="replace").splitlines()
    return {"compiled_lines": [line[-200:] for line in text if COMPILED.search(line)][:20],
            "loaded_lines": [line[-200:] for line in text if LOADED.search(line)][:20]}


def serve_argv(python: str, definition, model: str, port: int) -> list[str]:
    """``vllm serve`` by the image's Python, the definition's serve args."""
    return [python, "-m", "vllm.entrypoints.cli.main", "serve", model, "--served-model-name", "kiln-warm",
            "--host", "127.0.0.1", "--port", str(port), *definition.serve_args]


def warm_rootfs(rootfs: Path, definition, out: Path, model: str, binds: dict[str, str], port: int,
                python: str, deadline_s: float = 1800) -> dict:
    """Boot, request, stop, capture; the bundle in ``out``; its record."""
    audit = audit_of(rootfs)
    if (rootfs / WARM_ROOT).exists():
        raise KilnError(f"{rootfs}/{WARM_ROOT}: already there (a warmed image, or a warm boot's leftovers)")
    if platform.machine() not in MACHINE_PLATFORMS:
        raise KilnError(f"this machine is {platform.machine()}: kiln builds for {', '.join(sorted(set(MACHINE_PLATFORMS.values())))}")
    factors = key_factors(audit, definition, MACHINE_PLATFORMS[platform.machine()])
    env = {"PATH": f"{Path(python).parent}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
           "HOME": "/root", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           **definition.serve_env, **warm_env({})}
    serve = serve_argv(python, definition, model, port)
    before = files_under(rootfs)
    log = out.with_name(f"{out.name}.server.log")
    url = f"http://127.0.0.1:{port}"
    process = boot_chroot(rootfs, binds, serve, env, log)
    try:
        seconds = wait_healthy(process, url, log, deadline_s)
        answers = send_requests(url, "kiln-warm")
    finally:
        stop(process)
    hosts = [str(rootfs), str(rootfs.resolve()), *binds]
    files = capture(rootfs, hosts, socket.gethostname())
    vllm_dirs = sorted({"/".join(rel.split("/")[:7]) for rel in files if "/torch_aot_compile/" in rel})
    record = {"key": warm_key(factors), "factors": factors, "audit_kiln": audit.get("kiln"),
              "booted": {"serve": serve, "env": env, "model": model, "runner": "chroot"},
              "hardware": {"machine": platform.machine(), "processor": cpu_model(), "platform": factors["platform"],
                           "sm": factors["sm"]},
              "versions": versions(rootfs, audit.get("site_dir", "")), "vllm_cache_dirs": vllm_dirs,
              "seconds_to_healthy": round(seconds, 1), "answers": answers, "log": compile_evidence(log),
              "written_elsewhere": sorted(files_under(rootfs) - before)[:50]}
    return write_bundle(out, files, record)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()
