"""The shape of the code: one-way imports, the command line in one package, small modules.

These hold the layout docs/ARCHITECTURE.md describes: only ``kiln/commands/`` parses argv or
prints; library code reports through a ``Reporter``; the import graph of ``kiln/`` has no cycle,
between modules or between packages, and every import goes down the layers the page's table
places each module in (``LAYERS``); no function is over ``MAX_FUNCTION_LINES``; kiln builds no
path under ``ci/`` (an installed kiln has none), and ``ci/`` is a client of kiln's public API (no
``tests`` import, no private kiln name, no ``sys.path`` edit: it imports the installed kiln and
the modules beside it).
"""

from __future__ import annotations

import ast
from pathlib import Path

from kiln import paths

KILN = paths.REPO / "kiln"
MODULES = sorted(KILN.rglob("*.py"))
MAX_LINES = 420
MAX_FUNCTION_LINES = 80  # a function longer than a screen hides the steps it should name
# docs/ARCHITECTURE.md's layers, top to bottom: a module imports its own layer or one below. The
# page's table says which layer each module is in, in this order, and its chain line is this list
# (test_the_architecture_table_matches_the_tree), so the page and this test cannot drift.
LAYERS = ("commands", "tools", "pipeline", "warm", "publish", "attest", "image", "loaders", "patch", "triton",
          "source", "oci", "shared")
ARCHITECTURE = paths.REPO / "docs" / "ARCHITECTURE.md"
# A test hook, not output: with KILN_TEST_PAUSE_AT set, it announces the pause the crash tests wait for.
TEST_HOOKS = {"kiln/pausepoint.py"}
# A child process's protocol, not output: the kernel worker's one marked stderr line on a full disk,
# which kiln.triton.aot reads back and turns into its own error.
PROTOCOL_LINES = {"kiln/triton/worker_process.py"}


def _name(path: Path) -> str:
    rel = path.relative_to(paths.REPO).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """The kiln modules ``path`` imports at module level or in functions (``from kiln.x import y``
    counts ``kiln.x.y`` when that is a module)."""
    names = {_name(p) for p in MODULES}
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("kiln"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kiln") and node.level == 0:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in names else node.module)
    return {name for name in found if name in names}


def _graph() -> dict[str, set[str]]:
    return {_name(p): _imports(p) - {_name(p)} for p in MODULES}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def _package(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2])


def test_no_import_cycle_between_modules():
    assert _cycle(_graph()) is None, " -> ".join(_cycle(_graph()) or [])


def test_no_import_cycle_between_packages():
    packages: dict[str, set[str]] = {}
    for module, targets in _graph().items():
        packages.setdefault(_package(module), set()).update(
            _package(t) for t in targets if _package(t) != _package(module))
    # importing a package's __init__ from inside it is not an edge between packages
    assert _cycle(packages) is None, " -> ".join(_cycle(packages) or [])


def test_only_the_commands_package_parses_argv_or_prints():
    offenders = []
    for path in MODULES:
        if "commands" in path.relative_to(KILN).parts or str(path.relative_to(paths.REPO)) in TEST_HOOKS | PROTOCOL_LINES:
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + ([node.module] if isinstance(node, ast.ImportFrom) else [])
                if any(n and (n == "argparse" or n.startswith("rich")) for n in names):
                    offenders.append(f"{path.relative_to(paths.REPO)}:{node.lineno} imports {names}")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print":
                offenders.append(f"{path.relative_to(paths.REPO)}:{node.lineno} calls print()")
            if isinstance(node, ast.Attribute) and node.attr in ("stdout", "stderr") \
                    and isinstance(node.value, ast.Name) and node.value.id == "sys":
                offenders.append(f"{path.relative_to(paths.REPO)}:{node.lineno} writes sys.{node.attr}")
    assert not offenders, offenders


def test_modules_stay_small():
    big = {str(p.relative_to(paths.REPO)): n for p in MODULES if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not big, big


def test_functions_stay_short():
    long = [f"{p.relative_to(paths.REPO)}:{node.lineno} {node.name} ({lines} lines)" for p in MODULES
            for node in ast.walk(ast.parse(p.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and (lines := node.end_lineno - node.lineno + 1) > MAX_FUNCTION_LINES]
    assert not long, f"over {MAX_FUNCTION_LINES} lines: {long}"


def _table_rows() -> list[tuple[str, set[str]]]:
    """docs/ARCHITECTURE.md's module table, row by row: the layer and the modules the row names
    (`kiln/a/b.py`, `kiln/a/{b,c}.py`, and bare `c.py` after a path in the same cell: same directory)."""
    import re

    rows = []
    for line in ARCHITECTURE.read_text().split("## Packages and modules", 1)[1].split("\n## ", 1)[0].splitlines():
        if not line.startswith("|") or line.count("|") < 4 or line.startswith("|---"):
            continue
        cells = line.split("|")
        named: set[str] = set()
        directory = None
        for token in re.findall(r"`([^`]+)`", cells[2]):
            if token.startswith("kiln/"):
                directory = token.rsplit("/", 1)[0]
                name = token.rsplit("/", 1)[1]
            elif directory:
                name = token
            else:
                continue
            group = re.fullmatch(r"\{(.+)\}\.py", name)
            for stem in (group.group(1).split(",") if group else [name.removesuffix(".py")]):
                named.add(f"{directory}/{stem.strip()}.py")
        if named:
            rows.append((cells[1].strip(), named))
    return rows


def _documented_modules() -> set[str]:
    return {module for _, named in _table_rows() for module in named}


def _documented_chain() -> list[str]:
    """The page's one line of layers: `commands → ... → shared`."""
    import re

    chains = re.findall(r"^`([a-z]+(?: → [a-z]+)+)`$", ARCHITECTURE.read_text(), re.MULTILINE)
    assert len(chains) == 1, f"docs/ARCHITECTURE.md: expected one line of layers, found {chains}"
    return chains[0].split(" → ")


def _layer_of() -> dict[str, str]:
    """Each kiln module's layer, as the table places it; a package's ``__init__`` the table does
    not name is in its package's layer (the one every module of that package is in)."""
    placed = {_name(paths.REPO / module): layer for layer, named in _table_rows() for module in named}
    for path in MODULES:
        name = _name(path)
        if name not in placed and path.name == "__init__.py":
            layers = {layer for module, layer in placed.items() if module.startswith(f"{name}.")}
            assert len(layers) == 1, f"{path.relative_to(paths.REPO)}: its package is in layers {sorted(layers)}"
            placed[name] = layers.pop()
    return placed


def _upward(graph: dict[str, set[str]], layer_of: dict[str, str]) -> list[str]:
    """Every import of a module in a layer above the importer's."""
    rank = {layer: i for i, layer in enumerate(LAYERS)}
    return sorted(f"{module} ({layer_of[module]}) imports {target} ({layer_of[target]})"
                  for module, targets in graph.items() for target in targets
                  if rank[layer_of[target]] < rank[layer_of[module]])


def test_the_architecture_table_matches_the_tree():
    modules = {str(p.relative_to(paths.REPO)) for p in MODULES if p.name != "__init__.py"}
    documented = _documented_modules()
    assert not modules - documented, f"docs/ARCHITECTURE.md does not list {sorted(modules - documented)}"
    stale = {m for m in documented if not (paths.REPO / m).is_file()}
    assert not stale, f"docs/ARCHITECTURE.md lists modules that do not exist: {sorted(stale)}"
    assert _documented_chain() == list(LAYERS), "docs/ARCHITECTURE.md's line of layers is not LAYERS"
    rows = [layer for layer, _ in _table_rows()]
    assert not set(rows) - set(LAYERS), f"docs/ARCHITECTURE.md's table has layers not in LAYERS: {set(rows) - set(LAYERS)}"
    assert rows == sorted(rows, key=LAYERS.index), f"docs/ARCHITECTURE.md's table is not in layer order: {rows}"
    twice = sorted(m for m in documented if sum(m in named for _, named in _table_rows()) > 1)
    assert not twice, f"docs/ARCHITECTURE.md places these in more than one row: {twice}"


def test_imports_go_down_the_layers():
    layer_of = _layer_of()
    assert not (unplaced := set(_graph()) - set(layer_of)), f"in no layer: {sorted(unplaced)}"
    upward = _upward(_graph(), layer_of)
    assert not upward, f"imports of a layer above the importer's (docs/ARCHITECTURE.md): {upward}"


def test_the_direction_check_catches_an_upward_import():
    layer_of = {"kiln.oci.registry": "oci", "kiln.image.prepare": "image", "kiln.errors": "shared"}
    graph = {"kiln.oci.registry": {"kiln.errors", "kiln.image.prepare"}, "kiln.image.prepare": {"kiln.oci.registry"},
             "kiln.errors": set()}
    assert _upward(graph, layer_of) == ["kiln.oci.registry (oci) imports kiln.image.prepare (image)"]


# kiln runs from its package alone (an installed kiln has no ci/: tests/test_installed.py). The one
# exception: `pin bump --upstream-tests` runs the tool of the checkout whose pins file it bumps
# (beside that file, not beside kiln), and says so when there is none.
CI_PATH_ALLOWED = {("kiln/pinning/upstream.py", "checkout_tool")}


def _ci_paths(path: Path) -> list[tuple[int, str]]:
    """Where ``path`` builds a path under ``ci/``: ``x / "ci"``, ``x / "ci/..."``, ``Path("ci/...")``,
    ``.joinpath("ci", ...)``, ``open("ci/...")``, with the enclosing function's name."""
    def is_ci(node) -> bool:
        return isinstance(node, ast.Constant) and isinstance(node.value, str) and (
            node.value == "ci" or node.value.startswith("ci/"))

    found = []

    def visit(node, function: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            function = node.name
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and (is_ci(node.right) or is_ci(node.left)):
            found.append((node.lineno, function))
        elif isinstance(node, ast.Call) and node.args and is_ci(node.args[0]):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name in ("Path", "PurePath", "joinpath", "open", "with_name", "run", "Popen", "check_output"):
                found.append((node.lineno, function))
        for child in ast.iter_child_nodes(node):
            visit(child, function)

    visit(ast.parse(path.read_text()), "<module>")
    return found


def _ci_python(root: Path) -> list[Path]:
    """ci/'s Python: its ``.py`` files and its scripts without a suffix (a ``python`` shebang)."""
    def python_script(path: Path) -> bool:
        first = path.read_bytes()[:64]
        return first.startswith(b"#!") and b"python" in first

    scripts = [p for p in (root / "ci").rglob("*") if p.is_file() and not p.suffix and python_script(p)]
    return sorted([*(root / "ci").rglob("*.py"), *scripts])


_SYS_PATH_EDITS = {"insert", "append", "extend", "remove", "pop", "clear"}


def _is_sys_path(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name) \
        and node.value.id == "sys"


def _sys_path_edit(node: ast.AST) -> str | None:
    """How ``node`` edits ``sys.path`` (a method call, or an assignment to it or a slice of it), else None."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and _is_sys_path(node.func.value) \
            and node.func.attr in _SYS_PATH_EDITS:
        return node.func.attr
    targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else \
        [node.target] if isinstance(node, ast.AugAssign) else []
    if any(_is_sys_path(t) or (isinstance(t, ast.Subscript) and _is_sys_path(t.value)) for t in targets):
        return "assignment"
    return None


def _ci_offences(root: Path) -> list[str]:
    """What a ``ci/`` file under ``root`` must not do: import ``tests``, or use a private kiln name
    (``from kiln.x import _y``, ``module._y`` on a kiln module, ``import worker`` by path included)."""
    kiln_stems = {p.stem for p in (root / "kiln").rglob("*.py") if p.stem != "__init__"}
    ci_stems = {p.stem for p in (root / "ci").rglob("*.py")}
    offences = []
    for path in _ci_python(root):
        where = str(path.relative_to(root))
        tree = ast.parse(path.read_text())
        kiln_names: set[str] = set()
        for node in ast.walk(tree):
            edit = _sys_path_edit(node)  # ci/ imports the installed kiln and the modules beside it
            if edit:
                offences.append(f"{where}:{node.lineno} edits sys.path ({edit})")
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name == "tests" or alias.name.startswith("tests."):
                        offences.append(f"{where}:{node.lineno} imports {alias.name}")
                    top = alias.name.split(".")[0]
                    if top == "kiln" or (alias.name in kiln_stems and alias.name not in ci_stems):
                        kiln_names.add(alias.asname or top)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                if node.module == "tests" or node.module.startswith("tests."):
                    offences.append(f"{where}:{node.lineno} imports from {node.module}")
                if node.module == "kiln" or node.module.startswith("kiln."):
                    for alias in node.names:
                        if alias.name.startswith("_") and not alias.name.startswith("__"):
                            offences.append(f"{where}:{node.lineno} imports {node.module}.{alias.name}")
                        if alias.name in kiln_stems:
                            kiln_names.add(alias.asname or alias.name)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in kiln_names \
                    and node.attr.startswith("_") and not node.attr.startswith("__"):
                offences.append(f"{where}:{node.lineno} uses {node.value.id}.{node.attr}")
    return sorted(offences, key=lambda o: (o.split(":")[0], int(o.split(":")[1].split()[0])))


def test_kiln_opens_nothing_under_ci():
    found = [f"{path.relative_to(paths.REPO)}:{line} (in {function})" for path in MODULES
             for line, function in _ci_paths(path)
             if (str(path.relative_to(paths.REPO)), function) not in CI_PATH_ALLOWED]
    assert not found, f"kiln builds a path under ci/ (an installed kiln has none): {found}"


def test_ci_is_a_client_of_kiln_s_public_api():
    offences = _ci_offences(paths.REPO)
    assert not offences, offences


def test_the_ci_checks_catch_what_they_are_for(tmp_path):
    (tmp_path / "kiln" / "triton").mkdir(parents=True)
    for name in ("worker", "aot"):
        (tmp_path / "kiln" / "triton" / f"{name}.py").write_text("")
    (tmp_path / "kiln" / "values.py").write_text('from kiln import paths\nS = paths.REPO / "ci" / "helm"\n'
                                                 'def f():\n    return open("ci/x.json")\n')
    (tmp_path / "ci").mkdir()
    (tmp_path / "ci" / "a.py").write_text(
        "from tests.support.registry import run\nfrom kiln.triton.aot import _stage_sources\n"
        "from kiln.triton import aot\nimport worker\naot._stage_sources()\nworker._DEVICE = 'cuda'\n"
        "aot.stage_sources()\nimport sys\nsys.path.insert(0, 'ci')\nsys.path[:0] = ['x']\nprint(sys.path[0])\n")
    (tmp_path / "ci" / "script").write_text("#!/usr/bin/env python3\nimport sys\nsys.path.append('ci')\n")
    assert [line for line, _ in _ci_paths(tmp_path / "kiln" / "values.py")] == [2, 4]
    assert _ci_offences(tmp_path) == [
        "ci/a.py:1 imports from tests.support.registry", "ci/a.py:2 imports kiln.triton.aot._stage_sources",
        "ci/a.py:5 uses aot._stage_sources", "ci/a.py:6 uses worker._DEVICE", "ci/a.py:9 edits sys.path (insert)",
        "ci/a.py:10 edits sys.path (assignment)", "ci/script:3 edits sys.path (append)"]
