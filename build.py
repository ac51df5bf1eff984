#!/usr/bin/env python3
"""kiln's command line: `python build.py --help` (also installed as the `kiln` command)."""

import sys

from kiln.commands import main

if __name__ == "__main__":
    sys.exit(main())
