"""A build with a warm bundle: the bundle read (each file against its record), then baked on top.

``with_warm`` takes the ``PreparedBuild`` as ``prepare_build`` decided it and returns it with the
warm layer on top, the env pointing vLLM and its compilers there, and the audit file recording the
warm cache (``kiln.image.warmlayer.bake_warm``: the key checked against the build's own inputs),
and the registry build cache's ``warm`` entry of it, which ``--cache-to`` writes
(``kiln.image.warmcache``).
"""

from __future__ import annotations

from pathlib import Path

from kiln.image.prepare import PreparedBuild
from kiln.image.warmcache import with_warm_entry
from kiln.image.warmlayer import bake_warm, bundle_summary
from kiln.warm.capture import RECORD, read_bundle


def with_warm(prepared: PreparedBuild, folder: Path) -> PreparedBuild:
    """``prepared`` with the bundle in ``folder`` baked as its top layer; refused (one line) when
    the bundle was made for other inputs or its files are not as recorded."""
    record, files = read_bundle(folder)
    text = (folder / RECORD).read_bytes()
    return with_warm_entry(bake_warm(prepared, bundle_summary(record, text), files, f"--warm {folder}"), text)
