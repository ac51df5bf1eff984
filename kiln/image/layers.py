"""The patched-source layer: changed files, stale-bytecode whiteouts, and the audit file.

Public API:
    AUDIT_PATH                       "opt/kiln/manifest.json" (inside the image)
    pyc_whiteouts(rel, site_dir, base_files) -> list[str]
    audit_record(...) -> dict        what ``/opt/kiln/manifest.json`` holds
    patched_contents(changed, site_dir, base_files, audit, created_by="", baked=()) -> LayerContents
    source_contents(changed, site_dir, base_files) -> LayerContents   the changed modules and their whiteouts
    with_audit(source, audit, created_by="", baked=()) -> LayerContents   ... plus baked files and the audit file

The layer holds only what differs from the base: the patched (or added) modules under
``<site_dir>/vllm/``, a whiteout for each ``__pycache__`` entry the base holds for a changed
module (the base's bytecode would otherwise be trusted when size and mtime happen to match),
the files the definition bakes (``[[files]]``, under ``/opt/kiln/``) and the audit file, which
records each baked file's source and sha256. Baked files share this layer rather than adding
one: the audit file records them, so a changed template changes this layer anyway, and a
few-kilobyte file is not worth a layer of its own. Nothing here reads a clock: the same inputs give the same layer digest.

Deciding *what* the layer holds (``patched_contents``) is separate from writing it: the
daemonless build writes ``LayerContents`` as a tar layer (``write_layer``, removals become
whiteouts), ``kiln/publish/context.py`` writes the very same value as a Dockerfile build context
(removals become ``rm``). Either way there is one list of files and one list of removals.
"""

from __future__ import annotations

import json
import posixpath
import re
from collections.abc import Collection

from kiln import __version__
from kiln.definitions import BakedFile
from kiln.errors import KilnError
from kiln.image.provenance import kiln_revision
from kiln.oci.digest import sha256_text
from kiln.oci.layer import LayerContents
from kiln.patch.outcome import Outcome

AUDIT_PATH = "opt/kiln/manifest.json"
AUDIT_SCHEMA = 1
_PYVER = re.compile(r"python3\.(\d+)/")
_OPT_SUFFIXES = ("", ".opt-1", ".opt-2")


def pyc_whiteouts(rel: str, site_dir: str, base_files: Collection[str] | None) -> list[str]:
    """Image paths of the base's bytecode for ``vllm/<rel>`` that must be whited out.

    ``base_files`` lists the files the base shows under ``vllm/`` (``__pycache__`` included).
    When it holds any ``.pyc`` at all, exactly the matching ones are whited out; when it holds
    none (unknown, or a base compiled elsewhere), the names CPython would use for the site
    dir's Python version are whited out instead — a whiteout of an absent name is harmless.
    """
    directory, name = posixpath.split(rel)
    if not name.endswith(".py"):
        return []
    stem = name[:-3]
    cache_dir = f"{directory}/__pycache__" if directory else "__pycache__"
    package = f"{site_dir}/vllm"
    known = [f for f in (base_files or ()) if f.endswith(".pyc")]
    if known:
        prefix = f"{cache_dir}/{stem}."
        hits = sorted(f for f in known if f.startswith(prefix) and "/" not in f[len(prefix):])
        return [f"{package}/{f}" for f in hits]
    match = _PYVER.search(site_dir + "/")
    if not match:
        return []
    tag = f"cpython-3{match.group(1)}"
    return [f"{package}/{cache_dir}/{stem}.{tag}{opt}.pyc" for opt in _OPT_SUFFIXES]


def audit_record(*, image: str, pin: dict, sm: int, base_reference: str, base_digest: str,
                 site_dir: str, outcomes: dict[str, Outcome], before: dict[str, str],
                 changed: dict[str, str], baked: tuple[BakedFile, ...] = (),
                 images_dir: str = "images") -> dict:
    """The audit file's content. ``before``: rel -> sha256 of the pristine text (``sha256_text``)
    for every changed file that existed (what a registry cache entry keeps of the pristine source)."""
    commit, dirty = kiln_revision()
    files = {}
    for rel, text in sorted(changed.items()):
        files[f"/{site_dir}/vllm/{rel}"] = {
            "before": before.get(rel),
            "after": sha256_text(text),
        }
    record = {
        "schema": AUDIT_SCHEMA,
        "kiln": {"version": __version__, "commit": commit, "dirty": dirty},
        "image": image,
        "pin": pin,
        "sm": sm,
        "base": {"reference": base_reference, "digest": base_digest},
        "site_dir": f"/{site_dir}",
        "patches": [outcomes[pid].to_json() for pid in outcomes],
        "files": files,
    }
    if baked:  # absent when nothing is baked, so images without [[files]] keep their digests
        record["baked"] = {f.path: {"source": f"{images_dir}/{f.source}", "sha256": f.sha256} for f in baked}
    return record


def patched_contents(changed: dict[str, str], site_dir: str, base_files: Collection[str] | None,
                     audit: dict, created_by: str = "", baked: tuple[BakedFile, ...] = ()) -> LayerContents:
    """The patched-source layer: every changed module, its stale bytecode, baked files, the audit file."""
    return with_audit(source_contents(changed, site_dir, base_files), audit, created_by, baked)


def source_contents(changed: dict[str, str], site_dir: str, base_files: Collection[str] | None) -> LayerContents:
    """The part of the layer that depends only on the base and the patching: every changed module
    and the whiteouts of its stale bytecode (a registry cache's patched-source entry holds this)."""
    if not site_dir or site_dir.startswith("/"):
        raise KilnError(f"site dir {site_dir!r}: expected a relative image path like usr/local/lib/python3.12/dist-packages")
    files: dict[str, bytes] = {}
    removals: list[str] = []
    base = set(base_files or ())
    for rel, text in sorted(changed.items()):
        files[f"{site_dir}/vllm/{rel}"] = text.encode("utf-8")
        if base_files is None or rel in base:
            removals.extend(pyc_whiteouts(rel, site_dir, base_files))
    return LayerContents(files, tuple(removals))


def with_audit(source: LayerContents, audit: dict, created_by: str = "",
               baked: tuple[BakedFile, ...] = ()) -> LayerContents:
    """``source`` (``source_contents``) with the definition's baked files and the audit file."""
    files = dict(source.files)
    for baked_file in baked:  # under /opt/kiln/ (checked when the definition loads): no clash
        files[baked_file.path.lstrip("/")] = baked_file.data
    files[AUDIT_PATH] = (json.dumps(audit, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8")
    return LayerContents(files, source.removals, created_by)
