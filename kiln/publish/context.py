"""``build.py context``: kiln's layers as a build context for the top-level ``Dockerfile``.

Public API:
    LABEL_ARGS                      image label -> the Dockerfile build arg that carries it
    ENV_ARGS, ENV_STAGES            config Env kiln sets -> build arg; set of names -> Dockerfile stage
    CONTEXT_MARKER                  "kiln-context.json", the summary that marks a directory as a context
    ContextPublisher(path, force=False)        the publisher (``.record``: what was written)
    stage_context(layers, base, labels, dest, env=None, summary=None, ..., platform="linux/amd64") -> Staged
    context_build_args(base, labels, env=None, platform="linux/amd64") -> dict[str, str]

The context is another output of the same ``LayerContents`` the daemonless build bakes into
tar layers (``kiln.image.prepare`` decides them once); nothing here patches anything.
Layers are merged bottom first with the semantics of image layers: a removal hides what an
earlier layer (or the base) put at that path, a file replaces what was there. What is written:

    Dockerfile         a copy of the repository's ``Dockerfile``, so ``podman build DIR`` works
    rootfs/<path>      every file at its image path (0644, directories 0755, the layer mtime)
    remove.txt         base paths to delete, one absolute path a line (the daemonless whiteouts)
    base.txt           the base, ``registry/repository@sha256:…`` (its index, for a multi-platform base)
    build-args         ``BASE=…``, ``KILN_PLATFORM=…`` (the platform of the base the context was
                       computed on, which ``FROM --platform`` picks: ``context --platform``, default
                       the host's), ``KILN_ENV=…`` (the stage that sets kiln's config Env) and
                       one ``KILN_*=…`` per label and variable, ``KEY=VALUE`` lines
    kiln-context.json  what was written, for scripts (and to recognise a context to replace)

Every value is written without quoting, so ``$(sed 's/^/--build-arg=/' DIR/build-args)`` can
pass them to podman or docker: a path or value with whitespace is refused instead.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

from kiln import labels as L
from kiln import paths
from kiln.errors import KilnError
from kiln.oci.layer import LAYER_MTIME, LayerContents, normalise_path
from kiln.publish import Input, Publisher
from kiln.staging import Staged, stage_dir
from kiln.targets import DEFAULT_PLATFORM

CONTEXT_MARKER = "kiln-context.json"
ROOTFS = "rootfs"

# The Dockerfile's ARG for each label the daemonless build sets (its LABEL instruction lists
# the same pairs; tests/oci/test_dockerfile.py checks that the two agree).
LABEL_ARGS = {
    L.BASE_NAME: "KILN_BASE_NAME",
    L.BASE_DIGEST: "KILN_BASE_DIGEST",
    L.VERSION: "KILN_VERSION",
    L.REVISION: "KILN_REVISION",
    L.SOURCE: "KILN_SOURCE",
    L.IMAGE: "KILN_IMAGE",
    L.PIN: "KILN_PIN",
    L.SM: "KILN_SM",
    L.PATCHES: "KILN_PATCHES",
    L.VLLM: "KILN_VLLM",
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


def context_build_args(base: str, labels: dict[str, str], env: dict[str, str] | None = None,
                       platform: str = DEFAULT_PLATFORM) -> dict[str, str]:
    """``BASE``, ``KILN_PLATFORM``, ``KILN_ENV`` and the label and Env build args; what the
    Dockerfile cannot set is refused."""
    env = env or {}
    unknown = sorted(set(labels) - set(LABEL_ARGS))
    if unknown:
        raise KilnError(f"label {unknown[0]}: the Dockerfile has no build arg for it (add one to "
                        "Dockerfile and kiln/publish/context.py LABEL_ARGS)")
    stage = ENV_STAGES.get(frozenset(env))
    if stage is None:
        raise KilnError(f"environment {', '.join(sorted(env))}: the Dockerfile has no stage setting exactly "
                        "these (add one to Dockerfile and kiln/publish/context.py ENV_STAGES)")
    if "@sha256:" not in base:
        raise KilnError(f"base {base}: a build context needs the base pinned by digest")
    args = {"BASE": _plain(base, "base"), "KILN_PLATFORM": _plain(platform, "platform"), "KILN_ENV": stage}
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


class ContextPublisher(Publisher):
    """``build.py context --out DIR``: kiln's layers as a build context for the ``Dockerfile``."""

    kind = "context"
    option = "--out"
    directory = True

    def __init__(self, path: Path, force: bool = False, dockerfile: Path = paths.DOCKERFILE):
        self.path = path
        self.force = force
        self.dockerfile = dockerfile
        self.record: dict = {}

    def check(self, inputs: Sequence[Input] = ()) -> None:
        super().check(inputs)
        dest = self.path
        if dest.is_dir() and any(dest.iterdir()):
            if not (dest / CONTEXT_MARKER).is_file():
                raise KilnError(f"--out {dest}: not empty and not a kiln build context; refusing to replace it")
            if not self.force:
                raise KilnError(f"--out {dest}: already holds a build context (use --force to replace it)")
        if not self.dockerfile.is_file():
            raise KilnError(f"{self.dockerfile}: missing; the build context copies the repository's Dockerfile")

    def stage(self, image) -> Staged:
        prepared = image.prepared
        inputs = prepared.inputs
        summary = {"image": inputs.definition.name, "pin": inputs.pin.name, "sm": inputs.sm, "tag": prepared.tag,
                   "patches": prepared.applied, "triton": prepared.triton, "platform": inputs.platform}
        return stage_context(prepared.layers, prepared.base_by_digest, prepared.labels, self.path,
                             prepared.env, summary, self.dockerfile, self, inputs.platform)

    def where(self, image) -> str:
        return str(self.path)


def stage_context(layers: Sequence[LayerContents], base: str, labels: dict[str, str], dest: Path,
                  env: dict[str, str] | None = None, summary: dict | None = None,
                  dockerfile: Path = paths.DOCKERFILE, owner: ContextPublisher | None = None,
                  platform: str = DEFAULT_PLATFORM) -> Staged:
    """The build context for ``layers`` over ``platform`` of ``base``, staged beside ``dest``.

    ``labels`` and ``env``: the config labels and Env entries the daemonless image gets.
    ``summary`` is merged into ``kiln-context.json`` (kept on ``owner.record``).
    """
    build_args = context_build_args(base, labels, env, platform)
    files, removals = _merge(layers)
    for path in [*files, *removals]:
        _plain(path, "image path")
    dest.parent.mkdir(parents=True, exist_ok=True)
    staged = stage_dir(dest)
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
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    if owner is not None:
        owner.record = record
    return Staged(staged, dest)


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
