"""The shape of the code: one-way imports, the command line in one package, small modules.

These hold the layout docs/ARCHITECTURE.md describes: only ``kiln/commands/`` parses argv or
prints; library code reports through a ``Reporter``; the import graph of ``kiln/`` has no cycle,
between modules or between packages; kiln builds no path under ``ci/`` (an installed kiln has
none), and ``ci/`` is a client of kiln's public API (no ``tests`` import, no private kiln name).
"""

from __future__ import annotations

import ast
from pathlib import Path

from kiln import paths

KILN = paths.REPO / "kiln"
MODULES = sorted(KILN.rglob("*.py"))
MAX_LINES = 420
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


def _documented_modules() -> set[str]:
    """Modules docs/ARCHITECTURE.md's table names: `kiln/a/b.py`, `kiln/a/{b,c}.py`, and bare
    `c.py` after a path in the same cell (same directory)."""
    import re

    named = set()
    for line in (paths.REPO / "docs" / "ARCHITECTURE.md").read_text().splitlines():
        if not line.startswith("|") or line.count("|") < 4:
            continue
        cell = line.split("|")[2]
        directory = None
        for token in re.findall(r"`([^`]+)`", cell):
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
    return named


def test_the_architecture_table_matches_the_tree():
    modules = {str(p.relative_to(paths.REPO)) for p in MODULES if p.name != "__init__.py"}
    documented = _documented_modules()
    assert not modules - documented, f"docs/ARCHITECTURE.md does not list {sorted(modules - documented)}"
    stale = {m for m in documented if not (paths.REPO / m).is_file()}
    assert not stale, f"docs/ARCHITECTURE.md lists modules that do not exist: {sorted(stale)}"


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


def _ci_offences(root: Path) -> list[str]:
    """What a ``ci/`` file under ``root`` must not do: import ``tests``, or use a private kiln name
    (``from kiln.x import _y``, ``module._y`` on a kiln module, ``import worker`` by path included)."""
    kiln_stems = {p.stem for p in (root / "kiln").rglob("*.py") if p.stem != "__init__"}
    ci_stems = {p.stem for p in (root / "ci").rglob("*.py")}
    offences = []
    for path in sorted((root / "ci").rglob("*.py")):
        where = str(path.relative_to(root))
        tree = ast.parse(path.read_text())
        kiln_names: set[str] = set()
        for node in ast.walk(tree):
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
        "aot.stage_sources()\n")
    assert [line for line, _ in _ci_paths(tmp_path / "kiln" / "values.py")] == [2, 4]
    assert _ci_offences(tmp_path) == [
        "ci/a.py:1 imports from tests.support.registry", "ci/a.py:2 imports kiln.triton.aot._stage_sources",
        "ci/a.py:5 uses aot._stage_sources", "ci/a.py:6 uses worker._DEVICE"]
