"""A build with a warm bundle: the bundle read (each file against its record), then baked on top.

``with_warm`` takes the ``PreparedBuild`` as ``prepare_build`` decided it and returns it with the
warm layer on top, the env pointing vLLM and its compilers there, and the audit file recording the
warm cache (``kiln.image.warmlayer.bake_warm``: the key checked against the build's own inputs).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from kiln.image.prepare import PreparedBuild
from kiln.image.warmlayer import SUMMARY, bake_warm
from kiln.warm.capture import RECORD, read_bundle


def bundle_summary(record: dict, record_bytes: bytes) -> dict:
    """What ``bake_warm`` takes of a bundle: its record's summary fields, the record's sha256, its files."""
    return {**{name: record.get(name) for name in SUMMARY},
            "record_sha256": hashlib.sha256(record_bytes).hexdigest(), "files": record.get("files") or {}}


def with_warm(prepared: PreparedBuild, folder: Path) -> PreparedBuild:
    """``prepared`` with the bundle in ``folder`` baked as its top layer; refused (one line) when
    the bundle was made for other inputs or its files are not as recorded."""
    record, files = read_bundle(folder)
    return bake_warm(prepared, bundle_summary(record, (folder / RECORD).read_bytes()), files, f"--warm {folder}")
