"""A run imports only its own command's module; ``--help`` and mistakes still see every command."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kiln import paths
from kiln.commands import COMMANDS, command_name

_PROBE = """
import json, sys
from kiln.commands import COMMANDS, build_parser, command_name
argv = json.loads(sys.argv[1])
parser = build_parser("build.py", command_name(argv))
try:
    parser.parse_args(argv)
    code = 0
except SystemExit as exit:
    code = exit.code
print(json.dumps({"code": code, "modules": sorted(name.rsplit(".", 1)[1] for name in sys.modules
                                                 if name.startswith("kiln.commands.")
                                                 and name.rsplit(".", 1)[1] in COMMANDS)}))
"""


def probe(argv: list[str]) -> tuple[dict, str]:
    done = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(argv)], capture_output=True, text=True,
                          cwd=paths.REPO, timeout=120, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stdout + done.stderr


@pytest.mark.parametrize(("argv", "module"), [
    (["build", "--image", "qwen3.6-27b-tq", "--pin", "v0.20.1", "--sm", "120"], "build"),
    (["--pins", "pins.toml", "values", "--image", "qwen3.6-27b-tq", "--pin", "v0.20.1", "--sm", "120"], "build"),
    (["diff", "--pin", "v0.20.1"], "verify"),
    (["pin", "list"], "pin"),
])
def test_a_command_imports_its_own_module_and_no_other(argv, module):
    seen, _ = probe(argv)
    assert seen == {"code": 0, "modules": [module]}


def test_help_and_an_unknown_command_see_every_command():
    seen, shown = probe(["--help"])
    assert seen == {"code": 0, "modules": sorted(COMMANDS)}
    assert all(name in shown for names in COMMANDS.values() for name in names)
    seen, shown = probe(["bild", "--image", "x"])
    assert seen == {"code": 2, "modules": sorted(COMMANDS)}
    assert "invalid choice: 'bild'" in shown and "'build'" in shown


def test_every_registered_command_is_listed_with_its_module():
    from kiln.commands import build_parser

    parser = build_parser()
    (sub,) = [action for action in parser._actions if action.dest == "command"]
    assert set(sub.choices) == {name for names in COMMANDS.values() for name in names}


@pytest.mark.parametrize(("argv", "found"), [
    (["--pins", "p.toml", "build", "--image", "x"], "build"),
    (["--pins=p.toml", "plan"], "plan"),
    (["--help"], None), (["-h", "build"], None), (["--version"], None), ([], None),
    (["--pins"], None),  # the whole parser reports the missing value
    (["--pin", "x", "build"], None),  # not a repository option: the whole parser judges it
])
def test_the_command_is_found_after_the_repository_options_only(argv, found):
    assert command_name(argv) == found
