"""PN92 on real 0.20.1 source: an installed extension that cannot be imported counts as absent.

Behaviour test running extracted code: vLLM 0.20.1's own ``_has_module`` (with its ``@cache``),
``has_nixl_ep``, ``has_deep_ep`` and ``has_mori`` (``utils/import_utils.py``), pristine and
patched by PN92, executed with the real ``importlib``, ``functools.cache`` and a real
``logging.Logger`` (whose records the test reads). The extensions are real packages written to a
temporary directory on ``sys.path`` under the names vLLM asks for: a broken ``nixl_ep`` whose
``__init__`` fails the way the cu130 images' did (``ImportError: libcudart.so.12``), a healthy
``deep_ep``, and no ``mori``. What depends on the answer is read from 0.20.1's
``model_executor/layers/fused_moe/all2all_utils.py``: the import of the extension's
prepare/finalize module under ``if has_nixl_ep():`` at module level, and that module's own
``import nixl_ep``. 0.23.0 and 0.33.0 are checked through their verdicts.
"""

from __future__ import annotations

import functools
import importlib
import logging
import sys

import libcst as cst
import libcst.matchers as m
import pytest
from packaging.version import Version

from kiln.patch.anchor import find
from kiln.patch.engine import Session
from kiln.source.wheel import WheelSource
from tests.patchsets.support.patchlib import (
    assert_applies_once,
    assert_upstream,
    patched_files,
    run_defs,
)

TARGET = "utils/import_utils.py"
LOGGER = "vllm.utils.import_utils"
NAMES = ["_has_module", "has_nixl_ep", "has_deep_ep", "has_mori"]
MISSING_CUDART = "libcudart.so.12: cannot open shared object file: No such file or directory"


def _checks(source: str) -> dict:
    return run_defs(source, NAMES, {"importlib": importlib, "cache": functools.cache,
                                    "logger": logging.getLogger(LOGGER)}, TARGET)


@pytest.fixture
def extensions(tmp_path, monkeypatch):
    """A broken nixl_ep and a healthy deep_ep on sys.path; mori absent."""
    (tmp_path / "nixl_ep").mkdir()
    (tmp_path / "nixl_ep" / "__init__.py").write_text(f"raise ImportError({MISSING_CUDART!r})\n")
    (tmp_path / "deep_ep").mkdir()
    (tmp_path / "deep_ep" / "__init__.py").write_text("HEALTHY = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("nixl_ep", "deep_ep", "mori"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    yield
    for name in ("nixl_ep", "deep_ep"):
        sys.modules.pop(name, None)


@pytest.fixture(scope="module")
def sources(catalogue, sessions):
    session = sessions("v0.20.1")
    return session.tree.read(TARGET), patched_files(catalogue, session, "PN92")[TARGET]


def test_pristine_says_a_broken_extension_is_there_and_the_guarded_import_fails(sources, extensions):
    pristine = _checks(sources[0])
    assert pristine["has_nixl_ep"]() is True
    with pytest.raises(ImportError, match="libcudart.so.12"):
        importlib.import_module("nixl_ep")  # prepare_finalize/nixl_ep.py's `import nixl_ep`


def test_patched_says_it_is_absent_and_warns(sources, extensions, caplog):
    patched = _checks(sources[1])
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert patched["has_nixl_ep"]() is False
    (record,) = caplog.records
    assert "nixl_ep" in record.getMessage() and record.exc_info[0] is ImportError
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert patched["has_nixl_ep"]() is False  # cached: no second import, no second warning
    assert caplog.records == []


def test_healthy_and_absent_extensions_answer_as_before(sources, extensions):
    pristine, patched = _checks(sources[0]), _checks(sources[1])
    assert pristine["has_deep_ep"]() is patched["has_deep_ep"]() is True
    assert pristine["has_mori"]() is patched["has_mori"]() is False
    assert sys.modules["deep_ep"].HEALTHY  # the trial import loaded the real package


def test_what_the_answer_guards_on_0201(sessions):
    """0.20.1 imports each extension's prepare/finalize module at module level under the check,
    and the module every model imports (lora/utils.py) reaches it through FusedMoE."""
    tree = sessions("v0.20.1").tree
    all2all = cst.parse_module(tree.read("model_executor/layers/fused_moe/all2all_utils.py"))
    guarded = [
        node
        for node in find(all2all, m.If(test=m.Call(func=m.Name("has_nixl_ep"))))
        if find(node.body, m.ImportFrom(module=m.Attribute(attr=m.Name("nixl_ep"))))
    ]
    assert len(guarded) == 1
    assert "\nimport nixl_ep\n" in tree.read("model_executor/layers/fused_moe/prepare_finalize/nixl_ep.py")
    assert "from vllm.model_executor.layers.fused_moe import FusedMoE" in tree.read("lora/utils.py")


def test_verdicts(catalogue, sessions):
    old = sessions("v0.20.1")
    assert_applies_once(catalogue, old, "PN92")

    new = sessions("v0.33.0")
    assert assert_upstream(catalogue, new, "PN92").startswith("utils/import_utils.py:412")
    fixed = Session(WheelSource(Version("0.23.0")).fetch())
    assert_upstream(catalogue, fixed, "PN92")
