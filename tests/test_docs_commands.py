"""The commands README.md and docs/*.md show run as written: kiln through the set-up's
``.venv/bin/python build.py`` (or the installed ``kiln``), never a bare ``python build.py`` or
``python -m kiln``, which a fresh machine answers with "command not found" or a Python
without kiln's dependencies."""

from __future__ import annotations

import re

from kiln import paths

BARE = re.compile(r"(?<![\w./-])python3?\s+(?:build\.py|-m\s+kiln)\b")


def bare_commands(text: str) -> list[tuple[int, str]]:
    return [(number, line.strip()) for number, line in enumerate(text.splitlines(), 1) if BARE.search(line)]


def test_the_scan_finds_bare_python_and_leaves_the_venv_alone():
    text = ("python build.py verify\n`python3 build.py pin lock`\nrun python -m kiln build\n"
            ".venv/bin/python build.py verify\n/usr/bin/python build.py\nkiln verify\nmypython build.py\n")
    assert [n for n, _ in bare_commands(text)] == [1, 2, 3]


def test_readme_and_docs_show_no_bare_python_command():
    found = [f"{path.relative_to(paths.REPO)}:{number}: {line}"
             for path in [paths.REPO / "README.md", *sorted((paths.REPO / "docs").glob("*.md"))]
             for number, line in bare_commands(path.read_text())]
    assert found == [], "use .venv/bin/python build.py (or kiln):\n" + "\n".join(found)
