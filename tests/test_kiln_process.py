"""tests/support/kiln_process.py: the child is kiln's command line as the worker would run it, and
the `network` marker's guard reaches it (tests/support/netguard.py)."""

from __future__ import annotations

import os
import subprocess
import sys

from kiln.commands import main
from tests.support import netguard
from tests.support.cli import PINS
from tests.support.kiln_process import run_kiln

# 203.0.113.0/24 (TEST-NET-3) routes nowhere: only the guard can refuse it at once
OUTSIDE = "203.0.113.7"


def test_the_child_answers_as_the_command_line_does_in_process(tmp_path, capsys):
    argv = ["--pins", str(tmp_path / "missing.toml"), "pin", "list"]
    code, out, err = run_kiln(*argv)
    assert (code, out, err) == (main(argv), *capsys.readouterr())
    assert code == 2 and "missing.toml" in err  # the same refusal, not an import error of the child


def test_an_offline_tests_kiln_child_is_refused_another_host_and_the_worker_hears_of_it(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_REGISTRY_RETRIES", "0")  # the refusal is the subject, not kiln's backoff (~8 s)
    pins = tmp_path / "pins.toml"
    pins.write_text(PINS)
    code, _, err = run_kiln("--pins", pins, "pin", "lock", "--mirror", f"docker.io={OUTSIDE}:5000", timeout=120)
    # read (and so consumed) here: this test reaches out on purpose, its teardown must not fail it
    reached = netguard.reached_by_children(os.environ[netguard.ENV])
    assert code != 0, err  # refused: the pin is left unlocked
    assert OUTSIDE in reached


def test_any_python_child_of_an_offline_test_is_guarded():
    """Not only kiln: a script of ci/ or a bare interpreter (its own sys.path left alone)."""
    program = ("import socket, sys\n"
               f"try:\n    socket.create_connection(('{OUTSIDE}', 80), timeout=30)\n"
               "except OSError as e:\n    print(e)\n"
               "print(any('offline_site' in p for p in sys.path))\n")
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60)
    reached = netguard.reached_by_children(os.environ[netguard.ENV])
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0].endswith("is not marked network (tests/conftest.py)"), done.stdout
    assert reached == [OUTSIDE]
