"""Import real modules of a pristine vLLM tree on CPU torch, with stand-ins for the rest.

vLLM's package needs its compiled extensions, CUDA and dozens of third-party packages to import;
a test that wants to run, say, the real ``vllm.model_executor.layers.linear`` asks for it by name
and gets the tree's own file executed as that module. Every other ``vllm.*`` module it imports
(directly or through another real module) is, in order of precedence:

- a stand-in the test passes (``standins``: dotted name -> module or dict of attributes; what a
  test must control: the tensor-parallel group, the platform, kernel selection);
- a real module (``real``: dotted names) executed from the tree;
- a package directory of the tree: an empty package (its ``__init__`` is not run) whose missing
  attributes are stubs, so that submodules import by their real paths;
- anything else: a stub module, whose every attribute is a ``Stub``.

A ``Stub`` is a class that absorbs what module-level code does with an import it does not need:
called with one callable it returns that callable (a bare decorator), called otherwise it returns
another stub (a decorator factory, a logger, a registration), and its attributes are stubs. It is
falsy, so ``if envs.SOME_FLAG`` is off; ``isinstance(x, Stub)`` is never true of a real object.
Third-party modules that are not installed here (``transformers``, ``regex``...) are stubbed the
same way; ``regex`` is the standard ``re``, which these files' patterns only need.

``VllmModules`` is a context manager: on exit every ``vllm`` module it put into ``sys.modules`` is
removed (and whatever was there before put back), so two trees can be loaded one after the other
in one process.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.machinery
import importlib.util
import re
import sys
import types
from pathlib import Path

# Every stub call while a ``VllmModules.recording()`` is open: (stub's qualified name). A test
# checks that what it ran called no stub it did not expect, so that no stand-in silently took the
# place of code whose result matters.
_RECORDING: list[list[str]] = []


class _StubType(type):
    def __getattr__(cls, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _child(cls, name)

    def __call__(cls, *args, **kwargs):
        for calls in _RECORDING:
            calls.append(cls.__qualname__)
        if len(args) == 1 and not kwargs and callable(args[0]) and not isinstance(args[0], _StubType):
            return args[0]
        return _child(cls, "()")

    def __bool__(cls):
        return False

    def __or__(cls, other):
        return cls

    __ror__ = __or__

    def __getitem__(cls, item):
        return cls

    def __iter__(cls):
        return iter(())

    def __repr__(cls):
        return f"<stub {cls.__qualname__}>"


def _child(parent, name):
    children = parent.__dict__.get("_children")
    if children is None:
        children = {}
        type.__setattr__(parent, "_children", children)
    if name not in children:
        children[name] = stub(f"{parent.__qualname__}.{name}")
    return children[name]


def stub(qualname: str) -> type:
    """A new stub class named ``qualname``."""
    return _StubType(qualname.rsplit(".", 1)[-1], (), {"__qualname__": qualname})


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        value = stub(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


# Third-party modules some real files import at module level but never use on the paths a test
# runs, stubbed where they are not installed.
THIRD_PARTY = ("transformers", "safetensors", "huggingface_hub", "msgspec", "pydantic", "cachetools",
               "einops", "gguf", "blake3", "cbor2", "zmq", "psutil", "numba", "compressed_tensors")


class _Loader(importlib.abc.Loader):
    def __init__(self, owner: VllmModules, kind: str, payload=None):
        self.owner, self.kind, self.payload = owner, kind, payload

    def create_module(self, spec):
        if self.kind == "standin":
            module = self.payload
            if isinstance(module, dict):
                attrs = module
                module = _StubModule(spec.name)
                module.__dict__.update(attrs)
            return module
        if self.kind in ("package", "stub"):
            return _StubModule(spec.name)
        return None  # "real": the default module object

    def exec_module(self, module):
        if self.kind == "package":
            module.__path__ = [str(self.payload)]
            module.__package__ = module.__name__
        elif self.kind == "real":
            path: Path = self.payload
            module.__file__ = str(path)
            if path.name == "__init__.py":
                module.__path__ = [str(path.parent)]
                module.__package__ = module.__name__
            else:
                module.__package__ = module.__name__.rpartition(".")[0]
            code = compile(path.read_text(), f"vllm/{path.relative_to(self.owner.root / 'vllm')}", "exec")
            exec(code, module.__dict__)


class VllmModules(importlib.abc.MetaPathFinder):
    """``with VllmModules(tree_root, real=[...], standins={...}) as vm: vm.load("vllm.x.y")``."""

    def __init__(self, root: Path, real=(), standins=None):
        self.root = Path(root)
        self.real = set(real)
        self.standins = dict(standins or {})
        self._saved: dict[str, types.ModuleType] = {}
        self._provided: set[str] = set()  # every name this finder answered (removed on exit)

    # -- the finder -------------------------------------------------------------------------
    def find_spec(self, name, path=None, target=None):
        spec = self._find_spec(name)
        if spec is not None:
            self._provided.add(name)
        return spec

    def _find_spec(self, name):
        top = name.split(".")[0]
        if top == "regex":
            return importlib.machinery.ModuleSpec(name, _Loader(self, "standin", re))
        if top in THIRD_PARTY and name not in self.standins:
            if importlib.machinery.PathFinder.find_spec(top) is not None:
                return None  # installed: the real one
            return importlib.machinery.ModuleSpec(name, _Loader(self, "stub"), is_package=True)
        if top != "vllm":
            return None
        if name in self.standins:
            return importlib.machinery.ModuleSpec(name, _Loader(self, "standin", self.standins[name]),
                                                  is_package=True)
        parts = name.split(".")
        base = self.root.joinpath(*parts)
        if name in self.real:
            file = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
            assert file.is_file(), f"{name}: no {file}"
            return importlib.machinery.ModuleSpec(name, _Loader(self, "real", file), is_package=file.name == "__init__.py",
                                                  origin=str(file))
        if base.is_dir():
            return importlib.machinery.ModuleSpec(name, _Loader(self, "package", base), is_package=True)
        return importlib.machinery.ModuleSpec(name, _Loader(self, "stub"), is_package=True)

    # -- the context ------------------------------------------------------------------------
    def __enter__(self):
        for name in list(sys.modules):
            if name == "vllm" or name.startswith("vllm."):
                self._saved[name] = sys.modules.pop(name)
        sys.meta_path.insert(0, self)
        return self

    def __exit__(self, *exc):
        sys.meta_path.remove(self)
        for name in list(sys.modules):
            if name == "vllm" or name.startswith("vllm.") or name in self._provided:
                del sys.modules[name]
        sys.modules.update(self._saved)
        return False

    @staticmethod
    @contextlib.contextmanager
    def recording():
        """The qualified names of the stubs called inside the block, in order."""
        calls: list[str] = []
        _RECORDING.append(calls)
        try:
            yield calls
        finally:
            _RECORDING.remove(calls)

    def load(self, name: str) -> types.ModuleType:
        """The module ``name`` (real if listed in ``real``), imported through this finder."""
        return importlib.import_module(name)


def in_child(test):
    """Run ``test`` in a process of its own: the real vLLM modules it imports, and whatever they
    do to the globals of torch, Triton or the import system, stay there (run in the suite's own
    process, they once broke a later test's Triton-interpreted kernel). Not a fork of the worker:
    a fork of a process with other threads (pytest-xdist's worker has its channel's) can inherit a
    lock held mid-operation and hang (seen: a forked PN520 case waiting on a futex for 47 minutes).
    The child is a fork of a single-threaded zygote that imported torch and nothing ran
    (tests/support/kiln_zygote.py, ``in-child``: ~4 s of CPU a child less), or a fresh
    interpreter when that zygote is busy or ``$KILN_TEST_FRESH_CHILDREN`` is set. Its arguments
    are JSON values, and ``trees``, which the child makes itself (the conftest fixture's own
    recipe: the release wheels in kiln's cache). A failure comes back as the child's traceback."""

    @functools.wraps(test)
    def run(*args, **kwargs):
        import json

        import pytest

        from tests.support.kiln_process import REPO, run_forked

        assert not args, "in_child takes keyword arguments (pytest passes fixtures and params so)"
        values = {name: value for name, value in kwargs.items() if name != "trees"}
        call = {"module": test.__module__, "name": test.__name__, "kwargs": values, "trees": "trees" in kwargs}
        code, _, err = run_forked("in-child", {"call": call},
                                  [sys.executable, "-m", "tests.support.vllm_modules", json.dumps(call)], 900,
                                  cwd=REPO)
        if code != 0:
            pytest.fail(f"in a child process (exit {code}):\n{err[-8000:]}", pytrace=False)

    return run


def _run_in_child(call: dict) -> None:
    """The child's half of ``in_child``: the undecorated test, called with its arguments."""
    import importlib

    from packaging.version import Version

    from kiln.schema import skip_format_grammars
    from kiln.source.wheel import WheelSource

    # The child is the test's process alone, as build.py's is kiln's: jsonschema (which
    # tests.conftest's pins load imports) without the format grammars no test here checks
    # (kiln/schema.py; compiling them took most of a child's ~5 s start).
    skip_format_grammars()
    from tests.conftest import SOURCES

    kwargs = dict(call["kwargs"])
    if call["trees"]:
        made: dict = {}

        def trees(label: str):
            if label not in made:
                made[label] = WheelSource(Version(SOURCES[label])).fetch()
            return made[label]

        kwargs["trees"] = trees
    test = getattr(importlib.import_module(call["module"]), call["name"]).__wrapped__
    test(**kwargs)


if __name__ == "__main__":
    import json

    _run_in_child(json.loads(sys.argv[1]))
