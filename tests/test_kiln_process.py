"""tests/support/kiln_process.py: the child is kiln's command line as the worker would run it, and
the `network` marker's guard reaches it (tests/support/netguard.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kiln.commands import main
from tests.support import kiln_process, netguard
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


# -- the zygote (tests/support/kiln_zygote.py): each child is build.py as a fresh interpreter starts it


def test_each_child_has_the_tests_environment_and_directory_not_the_zygotes(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_JOBS", "many")
    code, _, err = run_kiln("pin", "list")
    assert code == 2 and "KILN_JOBS='many'" in err, err
    monkeypatch.delenv("KILN_JOBS")
    (tmp_path / "pins.toml").write_text(PINS)
    monkeypatch.chdir(tmp_path)
    code, out, err = run_kiln("--pins", "pins.toml", "pin", "list")  # relative: the test's directory
    assert code == 0, err
    assert (code, out, err) == run_fresh("--pins", "pins.toml", "pin", "list")


def run_fresh(*argv):
    done = subprocess.run([sys.executable, str(kiln_process.BUILD_PY), *argv], capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=120)
    return done.returncode, done.stdout, done.stderr


def test_a_child_past_its_timeout_is_killed_and_the_next_child_runs(tmp_path):
    import socket

    silent = socket.socket()  # accepts (the kernel's backlog) and never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    pins = tmp_path / "pins.toml"
    pins.write_text(PINS)
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            run_kiln("--pins", pins, "pin", "lock", "--mirror", f"docker.io=127.0.0.1:{silent.getsockname()[1]}",
                     timeout=2)
    finally:
        silent.close()
    assert run_kiln("--version")[0] == 0


def test_a_zygote_that_died_is_started_again():
    assert run_kiln("--version")[0] == 0
    kiln_process._ZYGOTES["kiln"].process.kill()
    kiln_process._ZYGOTES["kiln"].process.wait()
    code, out, _ = run_kiln("--version")
    assert code == 0 and out.startswith("kiln ")
