#!/usr/bin/env python3
"""pytest's time by folder, from its JUnit XML: where CI's minutes go (docs/CI.md's table).

    python3 ci/junit_folders.py JUNIT.xml [--markdown]

Each test's time (setup, call and teardown, as pytest writes it in the XML) is added to its
folder (``tests/image``; ``tests`` for a file at the top). Prints one line per folder, the
slowest first, and the total; ``--markdown`` prints a table instead. Standard library only.
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict


def by_folder(path: str) -> dict[str, list[float]]:
    """folder -> [seconds, tests]."""
    folders: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for case in ET.parse(path).getroot().iter("testcase"):
        module = case.get("classname", "").split(".")
        # classname is the module's dotted path, then the class if any: the folder is all but the file
        parts = [p for p in module if not p[:1].isupper()]
        folder = "/".join(parts[:-1]) or "(top)"
        folders[folder][0] += float(case.get("time") or 0)
        folders[folder][1] += 1
    return dict(folders)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("junit")
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args(argv)
    try:
        folders = by_folder(args.junit)
    except (OSError, ET.ParseError) as err:
        print(f"error: {args.junit}: {err}", file=sys.stderr)
        return 2
    rows = sorted(folders.items(), key=lambda item: -item[1][0])
    total = sum(seconds for seconds, _ in folders.values())
    if args.markdown:
        print("| folder | tests | seconds | share |\n|---|---|---|---|")
        for folder, (seconds, count) in rows:
            print(f"| `{folder}` | {int(count)} | {seconds:.0f} | {100 * seconds / (total or 1):.0f}% |")
        print(f"| all | {sum(int(c) for _, c in folders.values())} | {total:.0f} | |")
    else:
        for folder, (seconds, count) in rows:
            print(f"{seconds:8.0f} s  {int(count):5d} tests  {folder}")
        print(f"{total:8.0f} s  total")
    return 0


if __name__ == "__main__":
    sys.exit(main())
