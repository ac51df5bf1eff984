"""The kiln command line: the only package that parses argv, prints, and maps errors to exit codes.

Each command module exposes ``register(subparsers)``, which adds its parser(s) and sets
``run=<function(args, out: Output) -> int>`` as the parser default. Library code below this
package never prints: progress reaches the user through the ``Reporter`` a command passes in
(``out.reporter()``), results come back as values and are shown here.

Exit codes: 0 success; 1 a check failed (verdicts differ from the record, a preflight failed);
2 an error (``KilnError``: one line naming the file, field, option or patch at fault, or a
usage error; a full disk anywhere: one line naming the path written and the bytes it needed,
``kiln.errors.no_space_line``); 130 interrupted by SIGINT (Ctrl-C), 143 by SIGTERM (128 + the signal, as a shell
reports it), with one line ``error: interrupted (SIGTERM)`` once the build stopped cleanly: its
worker processes killed, its staging removed, nothing committed (``kiln.lifeline``).
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
from typing import NoReturn

from kiln import jobs
from kiln.commands.options import KilnParser, add_repo_options, command_inputs, progress_mode
from kiln.commands.output import Output
from kiln.errors import Interrupted, KilnError, is_no_space, no_space_line
from kiln.lifeline import stop_on_signals
from kiln.publish.destinations import check_stdout
from kiln.schema import skip_format_grammars

# Each command module, in the order ``--help`` lists them, and the commands it registers. A run
# imports only its command's module (``bench``'s HTTP client and statistics, ``pin``'s bump and
# ``plan``'s matrix are no part of a build, whose cache hit is timed to the tenth of a second:
# docs/BENCHMARKS.md); ``--help``, no command or an unknown one registers them all.
COMMANDS = {"patches": ("patches",), "genesis": ("genesis",), "verify": ("verify", "diff", "apply"),
            "build": ("build", "context", "values"), "check": ("check",), "pin": ("pin",), "plan": ("plan",), "bench": ("bench",),
            "warm": ("warm", "warm-answers")}


class _Version(argparse.Action):
    """``--version``: kiln's version and, when it runs from a git checkout, the commit (asked
    only when the option is given: git is not run on every command)."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                         help="print kiln's version and git commit, then exit")

    def __call__(self, parser, namespace, values, option_string=None):
        from kiln.image.provenance import kiln_revision, kiln_version

        commit, dirty = kiln_revision()
        where = f"commit {commit}{', dirty' if dirty else ''}" if commit else "not a git checkout: commit unknown"
        sys.stdout.write(f"kiln {kiln_version()} ({where})\n")
        parser.exit(0)


def build_parser(prog: str = "build.py", command: str | None = None) -> argparse.ArgumentParser:
    """The whole command line; with ``command``, only the module that registers it (all of them
    when no module does)."""
    parser = KilnParser(prog=prog, description="kiln: build-time patched vLLM images")
    parser.add_argument("--version", action=_Version)
    add_repo_options(parser)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    modules = [name for name, names in COMMANDS.items() if command in names] or list(COMMANDS)
    for name in modules:
        importlib.import_module(f"kiln.commands.{name}").register(sub)
    return parser


class _Unparsed(Exception):
    pass


class _CommandFinder(argparse.ArgumentParser):
    """The repository options and the command's name, nothing else: a mistake here is left to
    the whole parser to report."""

    def error(self, message):
        raise _Unparsed(message)


def command_name(argv: list[str]) -> str | None:
    """The command ``argv`` runs (``build`` in ``--pins p.toml build --image x``), or None: no
    command, ``--help``/``--version`` before it, or options the whole parser must judge."""
    finder = _CommandFinder(add_help=False, allow_abbrev=False)
    add_repo_options(finder)
    finder.add_argument("command", nargs="?")
    finder.add_argument("rest", nargs=argparse.REMAINDER)
    try:
        known, unknown = finder.parse_known_args(argv)
    except _Unparsed:
        return None
    return None if unknown else known.command


def main(argv: list[str] | None = None, prog: str = "build.py") -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(prog, command_name(argv)).parse_args(argv)
    try:
        progress = progress_mode(args)
        jobs.configured()  # a bad KILN_JOBS is refused before any work, not at the patch step
    except KilnError as err:
        Output().error(str(err))
        return 2
    out = Output(json_mode=bool(getattr(args, "json", False)), progress=progress)
    try:
        check_stdout(sys.stdout, command_inputs(args))  # `> pins.toml`: kiln never writes its output into an input
        with stop_on_signals():
            return args.run(args, out)
    except KilnError as err:
        out.error(str(err))
        return 2
    except OSError as err:
        if not is_no_space(err):
            raise
        out.error(no_space_line(err, _written_under(args)))  # a full disk is one line, not a traceback
        return 2
    except KeyboardInterrupt as err:  # Interrupted (a signal the build stopped on), or Ctrl-C
        signum = err.signum if isinstance(err, Interrupted) else signal.SIGINT
        out.error(f"interrupted ({signal.Signals(signum).name})")
        return 128 + signum


def _written_under(args) -> list[str]:
    """Where a command writes (its outputs, kiln's cache, the temporary directory): the one with
    the least space left is named when a full disk's error carries no path."""
    import tempfile

    from kiln.cache import cache_dir

    places = []
    for name in ("oci", "docker_archive", "values", "out"):
        path = getattr(args, name, None)
        if isinstance(path, (str, os.PathLike)):  # a directory (--oci) or a file's directory
            path = os.path.abspath(path)
            places.append(path if name == "oci" else os.path.dirname(path))
    try:
        places.append(str(cache_dir()))
    except Exception:  # (an unusable cache setting was reported already, or will be)
        pass
    return [*places, tempfile.gettempdir()]


def entry(prog: str = "kiln") -> NoReturn:
    """The ``kiln`` console script (and ``build.py``): ``main``, then exit with its code.

    After an interruption the build has already undone what it must (its ``finally`` blocks
    ran, its children are dead): the process leaves at once, without tearing down the
    interpreter's heap (a second or more after a large patching), so it is gone promptly.
    The process is kiln's alone, so jsonschema is imported without the format grammars kiln
    never uses (``kiln.schema.skip_format_grammars``).
    """
    skip_format_grammars()
    code = main(prog=prog)
    if code in (128 + signal.SIGINT, 128 + signal.SIGTERM):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    raise SystemExit(code)
