"""A build with a warm bundle: the key checked against the build's own inputs, then one more layer.

``with_warm`` takes the ``PreparedBuild`` as ``prepare_build`` decided it and returns it with the
warm layer on top, the env pointing vLLM and its compilers there, and the audit file recording the
warm cache (``warm``: its key, what booted and on what, the versions, the layer's files). The
registry build cache never holds a warm layer: its entries were decided before this step.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path

from kiln.image.layers import AUDIT_PATH
from kiln.image.prepare import PreparedBuild
from kiln.triton.cachelayer import image_env
from kiln.warm.capture import RECORD, read_bundle, warm_contents
from kiln.warm.key import check_bundle, warm_env

_SUMMARY = ("key", "factors", "booted", "hardware", "versions", "vllm_cache_dirs", "bytes")


def with_warm(prepared: PreparedBuild, folder: Path) -> PreparedBuild:
    """``prepared`` with the bundle in ``folder`` baked as its top layer; refused (one line) when
    the bundle was made for other inputs (``key.check_bundle``) or its files are not as recorded."""
    record, files = read_bundle(folder)
    source = prepared.layers[0]
    audit = json.loads(source.files[AUDIT_PATH])
    check_bundle(record, audit, prepared.inputs.definition, prepared.inputs.platform, f"--warm {folder}")
    summary = {name: record.get(name) for name in _SUMMARY}
    summary["record_sha256"] = hashlib.sha256((folder / RECORD).read_bytes()).hexdigest()
    summary["files"] = len(files)
    audit["warm"] = {**summary, "files": record["files"]}
    text = (json.dumps(audit, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8")
    layers = [replace(source, files={**source.files, AUDIT_PATH: text}), *prepared.layers[1:],
              warm_contents(files, record["key"])]
    env = {**prepared.env, **warm_env({**image_env(prepared.base_model.config), **prepared.env})}
    return replace(prepared, layers=layers, env=env, warm=summary)
