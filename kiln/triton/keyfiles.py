"""Which files of a Triton install its ``triton_key()`` reads, decided from that version's own source.

Public API:
    KeySources(own_file, walked, extension)
        ``.files(paths)`` the paths (a RECORD's) that ``triton_key()`` hashes
    key_sources(source, version) -> KeySources    from the text of ``triton/runtime/cache.py``
    read_key_sources(site, version) -> KeySources from an unpacked Triton under ``site``

Why from the source: which files make the cache key is Triton's decision, and it may change
between releases (3.6.0 and 3.8.0 hash ``runtime/cache.py`` itself, every module
``pkgutil.walk_packages`` finds under ``compiler/``, ``backends/`` and ``language/``, and
``_C/libtriton.so``). kiln reads ``triton_key()`` with ``ast``: the package root it derives from
``__file__``, the directories it hands to ``pkgutil.walk_packages``, the files it opens. Anything
else that reads the file system there (``os.walk``, ``glob``, an ``open`` of something kiln does
not recognise) is refused in one line naming the version: kiln then cannot tell the key.

The walk is replayed over a RECORD's paths as ``pkgutil`` does it: a walked directory's own
``__init__`` is not yielded; every file with an importable suffix is; a subdirectory is entered
only when it is a package (holds an ``__init__`` module), and then the package itself is hashed
through its ``__init__``. Importable suffixes are taken broadly (``.py``, ``.pyc``, any ``.so``):
a file counted that Triton would skip only makes the comparison stricter.
"""

from __future__ import annotations

import ast
import posixpath
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from kiln.errors import KilnError

CACHE_MODULE = "triton/runtime/cache.py"
_ROOT = "os.path.dirname(os.path.dirname(os.path.abspath(__file__)))"  # the triton package directory
_READERS = {"walk", "listdir", "scandir", "glob", "iglob", "rglob", "iterdir", "read_bytes", "read_text",
            "iter_modules", "open_binary", "open_text", "files"}


@dataclass(frozen=True)
class KeySources:
    own_file: str  # the module holding triton_key(), which hashes itself
    walked: tuple[str, ...]  # directories handed to pkgutil.walk_packages ("triton/compiler", ...)
    extension: str  # the extension module it hashes ("triton/_C/libtriton.so")
    opened: tuple[str, ...] = ()  # other files it opens by name

    def files(self, paths: Iterable[str]) -> set[str]:
        """The paths among ``paths`` that ``triton_key()`` hashes, plus the files it opens by name."""
        paths = set(paths)
        packages = {posixpath.dirname(p) for p in paths if _module_name(posixpath.basename(p)) == "__init__"}
        read = {self.extension, *self.opened} | ({self.own_file} if self.own_file else set())
        for path in paths:
            for root in self.walked:
                if not path.startswith(root + "/") or _module_name(posixpath.basename(path)) is None:
                    continue
                parent, inside = posixpath.dirname(path), []
                while parent != root:
                    inside.append(parent)
                    parent = posixpath.dirname(parent)
                if all(d in packages for d in inside) and not (not inside and _module_name(
                        posixpath.basename(path)) == "__init__"):
                    read.add(path)
        return read


def _module_name(name: str) -> str | None:
    """What ``inspect.getmodulename`` gives, with every ``.so`` counted as an extension module."""
    for suffix in (".py", ".pyc", ".so"):
        if name.endswith(suffix) and len(name) > len(suffix):
            return name[:-len(suffix)].split(".")[0]
    return None


def read_key_sources(site: Path, version: str) -> KeySources:
    path = site / CACHE_MODULE
    try:
        source = path.read_text(encoding="utf-8")
    except OSError as err:
        raise KilnError(f"{path}: cannot read Triton {version}'s cache module ({err.strerror or err})") from None
    return key_sources(source, version)


def key_sources(source: str, version: str) -> KeySources:
    """Parse ``triton_key()`` out of ``triton/runtime/cache.py``'s text."""
    def refuse(why: str) -> KilnError:
        return KilnError(f"Triton {version}: {CACHE_MODULE}: {why}; kiln cannot tell which files its "
                         "triton_key() reads (docs/TRITON.md)")

    try:
        module = ast.parse(source)
    except SyntaxError as err:
        raise refuse(f"does not parse (line {err.lineno})") from None
    function = next((node for node in module.body if isinstance(node, ast.FunctionDef)
                     and node.name == "triton_key"), None)
    if function is None:
        raise refuse("has no triton_key()")
    roots = {target.id for node in ast.walk(function) if isinstance(node, ast.Assign)
             and ast.unparse(node.value) == _ROOT for target in node.targets if isinstance(target, ast.Name)}
    if not roots:
        raise refuse(f"triton_key() does not derive the package directory as {_ROOT}")
    walked, extensions, opened, own, walks = [], [], [], False, False
    opened_args = {id(node.args[0]) for node in ast.walk(function)
                   if isinstance(node, ast.Call) and ast.unparse(node.func) == "open" and node.args}
    for node in ast.walk(function):
        if not isinstance(node, ast.Call):
            continue
        name = ast.unparse(node.func)
        if name == "os.path.join":
            if not node.args or not (isinstance(node.args[0], ast.Name) and node.args[0].id in roots):
                raise refuse(f"line {node.lineno}: a path not under the package directory: {ast.unparse(node)}")
            parts = node.args[1:]
            if all(isinstance(p, ast.Constant) and isinstance(p.value, str) for p in parts):
                rel = posixpath.join("triton", *(p.value for p in parts))
                (opened if id(node) in opened_args else walked).append(rel)
            elif id(node) in opened_args and _extension_file(parts) is not None:
                extensions.append(posixpath.join("triton", *_extension_file(parts)))
            else:
                raise refuse(f"line {node.lineno}: a path kiln cannot resolve: {ast.unparse(node)}")
        elif name == "open":
            arg = node.args[0] if node.args else None
            text = ast.unparse(arg) if arg is not None else ""
            if text == "__file__":
                own = True
            elif not (isinstance(arg, ast.Call) and ast.unparse(arg.func) == "os.path.join") and not (
                    text.endswith(".origin") and "find_spec" in text):
                raise refuse(f"line {node.lineno}: opens {text or 'something'} kiln does not recognise")
        elif name == "pkgutil.walk_packages":
            walks = True
        elif name.rsplit(".", 1)[-1] in _READERS:
            raise refuse(f"line {node.lineno}: reads files through {name}()")
    if walked and not walks:
        raise refuse("names directories but walks none with pkgutil.walk_packages")
    if len(extensions) != 1:
        raise refuse(f"opens {len(extensions)} extension module(s) by name (kiln keys exactly one: libtriton)")
    return KeySources(CACHE_MODULE if own else "", tuple(walked), extensions[0], tuple(opened))


def _extension_file(parts: list[ast.expr]) -> list[str] | None:
    """``"_C", f"libtriton.{ext}"`` -> ``["_C", "libtriton.so"]`` (the extension suffix's last part
    is ``so`` on Linux, where vLLM's images run); None for any other shape."""
    *dirs, last = parts
    if not all(isinstance(p, ast.Constant) and isinstance(p.value, str) for p in dirs):
        return None
    if not (isinstance(last, ast.JoinedStr) and len(last.values) == 2 and isinstance(last.values[0], ast.Constant)
            and str(last.values[0].value).endswith(".") and isinstance(last.values[1], ast.FormattedValue)):
        return None
    return [*(p.value for p in dirs), f"{last.values[0].value}so"]
