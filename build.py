#!/usr/bin/env python3
"""kiln's command line: `python build.py --help` (also installed as the `kiln` command)."""

from kiln.commands import entry

if __name__ == "__main__":
    entry("build.py")
