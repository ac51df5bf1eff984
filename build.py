#!/usr/bin/env python3
"""kiln's command line: `python build.py --help`."""

import sys

from kiln.cli import main

if __name__ == "__main__":
    sys.exit(main())
