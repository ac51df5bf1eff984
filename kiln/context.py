"""``build.py context``: kiln's layers as a build context for the top-level ``Dockerfile``.

Public API:
    LABEL_ARGS                      image label -> the Dockerfile build arg that carries it
    ENV_ARGS, ENV_STAGES            config Env kiln sets -> build arg; set of names -> Dockerfile stage
    CONTEXT_MARKER                  "kiln-context.json", the summary that marks a directory as a context
    write_context(layers, base, labels, dest, env=None, summary=None) -> Path   staged, renamed into place
    context_build_args(base, labels, env=None) -> dict[str, str]
    add_context_parser(subparsers)  registers the ``context`` command

The context is another sink of the same ``LayerContents`` the daemonless build bakes into
tar layers (``kiln.build.prepare_build`` decides them once); nothing here patches anything.
Layers are merged bottom first with the semantics of image layers: a removal hides what an
earlier layer (or the base) put at that path, a file replaces what was there. What is written:

    Dockerfile         a copy of the repository's ``Dockerfile``, so ``podman build DIR`` works
    rootfs/<path>      every file at its image path (0644, directories 0755, the layer mtime)
    remove.txt         base paths to delete, one absolute path a line (the daemonless whiteouts)
    base.txt           the base, ``registry/repository@sha256:…``
    build-args         ``BASE=…``, ``KILN_ENV=…`` (the stage that sets kiln's config Env) and
                       one ``KILN_*=…`` per label and variable, ``KEY=VALUE`` lines
    kiln-context.json  what was written, for scripts (and to recognise a context to replace)

Every value is written without quoting, so ``$(sed 's/^/--build-arg=/' DIR/build-args)`` can
pass them to podman or docker: a path or value with whitespace is refused instead.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

from rich.markup import escape

from kiln import paths, ui
from kiln.bake import LayerContents
from kiln.build import load_build_inputs, prepare_build
from kiln.errors import KilnError
from kiln.images import add_target_options
from kiln.oci.endpoints import add_registry_options, config_from_options
from kiln.oci.layer import LAYER_MTIME, normalise_path

CONTEXT_MARKER = "kiln-context.json"
ROOTFS = "rootfs"

# The Dockerfile's ARG for each label the daemonless build sets (its LABEL instruction lists
# the same pairs; tests/oci/test_dockerfile.py checks that the two agree).
LABEL_ARGS = {
    "org.opencontainers.image.base.name": "KILN_BASE_NAME",
    "org.opencontainers.image.base.digest": "KILN_BASE_DIGEST",
    "org.opencontainers.image.version": "KILN_VERSION",
    "org.opencontainers.image.revision": "KILN_REVISION",
    "org.opencontainers.image.source": "KILN_SOURCE",
    "io.kiln.image": "KILN_IMAGE",
    "io.kiln.pin": "KILN_PIN",
    "io.kiln.sm": "KILN_SM",
    "io.kiln.patches": "KILN_PATCHES",
    "io.kiln.vllm": "KILN_VLLM",
}

# The config Env kiln sets (the Triton cache layer sets TRITON_CACHE_DIR). A Dockerfile cannot
# set ENV conditionally, so each combination of names is a stage of its own that ``KILN_ENV``
# picks; the values travel as build args.
ENV_ARGS = {"TRITON_CACHE_DIR": "KILN_TRITON_CACHE_DIR"}
ENV_STAGES = {frozenset(): "none", frozenset({"TRITON_CACHE_DIR"}): "triton"}


def _plain(value: str, what: str) -> str:
    if not value or any(ch.isspace() for ch in value):
        raise KilnError(f"{what} {value!r}: empty or contains whitespace; a build context cannot carry it")
    return value


def context_build_args(base: str, labels: dict[str, str], env: dict[str, str] | None = None) -> dict[str, str]:
    """``BASE``, ``KILN_ENV`` and the label and Env build args; what the Dockerfile cannot set is refused."""
    env = env or {}
    unknown = sorted(set(labels) - set(LABEL_ARGS))
    if unknown:
        raise KilnError(f"label {unknown[0]}: the Dockerfile has no build arg for it (add one to "
                        "Dockerfile and kiln/context.py LABEL_ARGS)")
    stage = ENV_STAGES.get(frozenset(env))
    if stage is None:
        raise KilnError(f"environment {', '.join(sorted(env))}: the Dockerfile has no stage setting exactly "
                        "these (add one to Dockerfile and kiln/context.py ENV_STAGES)")
    if "@sha256:" not in base:
        raise KilnError(f"base {base}: a build context needs the base pinned by digest")
    args = {"BASE": _plain(base, "base"), "KILN_ENV": stage}
    for name, arg in ENV_ARGS.items():
        if name in env:
            args[arg] = _plain(env[name], f"environment variable {name}")
    for label, arg in LABEL_ARGS.items():
        if label in labels:
            args[arg] = _plain(labels[label], f"label {label}")
    return args


def _merge(layers: Sequence[LayerContents]) -> tuple[dict[str, bytes], list[str]]:
    """Files and removals of ``layers`` applied bottom first, as an image's layers would be."""
    files: dict[str, bytes] = {}
    removals: dict[str, None] = {}  # ordered set
    for contents in layers:
        for raw in contents.removals:
            path = normalise_path(raw)
            for existing in [f for f in files if f == path or f.startswith(path + "/")]:
                del files[existing]
            removals[path] = None
        for raw, data in contents.files.items():
            path = normalise_path(raw)
            removals.pop(path, None)
            files[path] = data
    return files, sorted(removals)


def write_context(layers: Sequence[LayerContents], base: str, labels: dict[str, str], dest: Path,
                  env: dict[str, str] | None = None, summary: dict | None = None,
                  dockerfile: Path = paths.DOCKERFILE) -> Path:
    """Write the build context for ``layers`` over ``base`` at ``dest`` (staged, then renamed).

    ``labels`` and ``env``: the config labels and Env entries the daemonless image gets.
    ``dest`` may be absent, empty, or an earlier context (replaced whole); anything else is
    refused. ``summary`` is merged into ``kiln-context.json``.
    """
    build_args = context_build_args(base, labels, env)
    files, removals = _merge(layers)
    for path in [*files, *removals]:
        _plain(path, "image path")
    if not dockerfile.is_file():
        raise KilnError(f"{dockerfile}: missing; the build context copies the repository's Dockerfile")
    dest = dest.resolve()
    _check_replaceable(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    staged = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}.tmp-"))
    try:
        os.chmod(staged, 0o755)
        shutil.copyfile(dockerfile, staged / "Dockerfile")
        _write_rootfs(staged / ROOTFS, files)
        (staged / "remove.txt").write_text("".join(f"/{path}\n" for path in removals))
        (staged / "base.txt").write_text(base + "\n")
        (staged / "build-args").write_text("".join(f"{k}={v}\n" for k, v in build_args.items()))
        record = {**(summary or {}), "base": base, "build_args": build_args,
                  "files": [f"/{path}" for path in sorted(files)], "removals": [f"/{p}" for p in removals]}
        (staged / CONTEXT_MARKER).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
        _replace_dir(staged, dest)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    return dest


def _write_rootfs(root: Path, files: dict[str, bytes]) -> None:
    """Files 0644 and directories 0755 with the layer's fixed mtime, as the tar layer has them.

    COPY keeps a context file's mode and mtime; the mtime matters because a module whose size
    and mtime equal those recorded in a leftover .pyc would run that bytecode.
    """
    root.mkdir(mode=0o755)
    directories = {root}
    for path, data in sorted(files.items()):
        target = root / path
        parent = target.parent
        while parent not in directories:
            directories.add(parent)
            parent = parent.parent
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        os.chmod(target, 0o644)
        os.utime(target, (LAYER_MTIME, LAYER_MTIME))
    for directory in sorted(directories, key=lambda d: len(d.parts), reverse=True):
        os.chmod(directory, 0o755)
        os.utime(directory, (LAYER_MTIME, LAYER_MTIME))  # after its entries were written


def _check_replaceable(dest: Path) -> None:
    if not dest.exists():
        return
    if not dest.is_dir():
        raise KilnError(f"{dest}: exists and is not a directory; --out wants a directory")
    if any(dest.iterdir()) and not (dest / CONTEXT_MARKER).is_file():
        raise KilnError(f"{dest}: not empty and not a kiln build context; refusing to replace it")


def _replace_dir(staged: Path, dest: Path) -> None:
    if not dest.exists():
        os.rename(staged, dest)
        return
    old = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}.old-"))
    os.rename(dest, old / "previous")
    os.rename(staged, dest)
    shutil.rmtree(old, ignore_errors=True)


# -- command line ----------------------------------------------------------------------------


def cmd_context(args) -> int:
    definition, pin, catalogue = load_build_inputs(args)
    prepared = prepare_build(definition, pin, args.sm, catalogue, config_from_options(args), args.allow_unlocked)
    summary = {"image": definition.name, "pin": pin.name, "sm": args.sm, "tag": prepared.tag,
               "patches": prepared.applied, "triton": prepared.triton}
    dest = write_context(prepared.layers, prepared.base_by_digest, prepared.labels, args.out,
                         env=prepared.env, summary=summary)
    record = json.loads((dest / CONTEXT_MARKER).read_text())
    if args.json:
        print(json.dumps({**record, "out": str(dest), "timings": prepared.clock.total()}, indent=2))
        return 0
    ui.stdout.print(escape(
        f"wrote {dest}: {len(record['files'])} file(s), {len(record['removals'])} removal(s) over "
        f"{record['base']}\n  podman build $(sed 's/^/--build-arg=/' {dest}/build-args) "
        f"-t {definition.name}:{prepared.tag} {dest}"
    ))
    return 0


def add_context_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("context", help="write a build context for the Dockerfile (same files as build)")
    add_target_options(p)
    p.add_argument("--out", type=Path, required=True, metavar="DIR", help="the context directory to write")
    add_registry_options(p)
    p.add_argument("--allow-unlocked", action="store_true", help="use an unlocked or mismatching pin")
    p.add_argument("--json", action="store_true", help="print a JSON summary on stdout")
    p.set_defaults(func=cmd_context)
    return p
