"""The kiln command line: the only package that parses argv, prints, and maps errors to exit codes.

Each command module exposes ``register(subparsers)``, which adds its parser(s) and sets
``run=<function(args, out: Output) -> int>`` as the parser default. Library code below this
package never prints: progress reaches the user through the ``Reporter`` a command passes in
(``out.reporter()``), results come back as values and are shown here.

Exit codes: 0 success; 1 a check failed (verdicts differ from the record, a preflight failed);
2 an error (``KilnError``: one line naming the file, field, option or patch at fault, or a
usage error); 130 interrupted.
"""

from __future__ import annotations

import argparse

from kiln.commands import bench, build, check, patches, pin, plan, verify
from kiln.commands.options import KilnParser, add_repo_options
from kiln.commands.output import Output
from kiln.errors import KilnError

COMMANDS = (patches, verify, build, check, pin, plan, bench)


def build_parser(prog: str = "build.py") -> argparse.ArgumentParser:
    parser = KilnParser(prog=prog, description="kiln: build-time patched vLLM images")
    add_repo_options(parser)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.register(sub)
    return parser


def main(argv: list[str] | None = None, prog: str = "build.py") -> int:
    args = build_parser(prog).parse_args(argv)
    out = Output(json_mode=bool(getattr(args, "json", False)))
    try:
        return args.run(args, out)
    except KilnError as err:
        out.error(str(err))
        return 2
    except KeyboardInterrupt:
        out.stderr.print("interrupted")
        return 130


def entry() -> None:
    """The ``kiln`` console script: the same command line as ``python build.py``."""
    raise SystemExit(main(prog="kiln"))
