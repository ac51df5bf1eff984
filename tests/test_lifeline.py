"""Processes kiln starts die with it (``kiln/lifeline.py``), however they were started.

Each case runs a parent process in a session of its own that starts children the way kiln
does (a fork pool from the main thread or from a helper thread waiting on it; an exec'd child
through ``lifeline.run`` from a helper thread), then SIGKILLs the parent: within 2 s no process
of the session may be alive. The children block forever on their own (a sleep, a pool's queue),
as the patch workers of a killed build did.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.reliability

ROOT = Path(__file__).resolve().parents[1]
PARENT = r"""
import multiprocessing, os, sys, threading, time
WORKER_CHILD = (
    "import importlib.util, subprocess, sys, time\n"
    "spec = importlib.util.spec_from_file_location('worker', sys.argv[1])\n"
    "worker = importlib.util.module_from_spec(spec)\n"
    "spec.loader.exec_module(worker)\n"
    "worker.children_die_with_me()\n"
    "subprocess.Popen(['sleep', '600'])\n"
    "time.sleep(600)\n"
)
from concurrent.futures import ProcessPoolExecutor
from kiln import lifeline

def pool():
    executor = ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("fork"),
                                   initializer=lifeline.child_of, initargs=(os.getpid(),))
    futures = [executor.submit(time.sleep, 600) for _ in range(2)]
    print("ready", flush=True)
    futures[0].result()

how = sys.argv[1]
if how == "pool":
    pool()
elif how == "pool-in-thread":
    threading.Thread(target=pool).start()
elif how == "exec-in-thread":
    threading.Thread(target=lifeline.run, args=(["sleep", "600"],),
                     kwargs={"started": lambda: print("ready", flush=True)}).start()
elif how == "kernel-worker-child":  # the Triton worker (exec'd) and its own child, as ptxas
    threading.Thread(target=lifeline.run, args=([sys.executable, "-c", WORKER_CHILD, "kiln/triton/worker.py"],),
                     kwargs={"started": lambda: print("ready", flush=True)}).start()
time.sleep(600)
"""


def _session(sid: int) -> list[str]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_bytes().rpartition(b")")[2].split()
            except OSError:
                continue
            if int(fields[3]) == sid and fields[0] != b"Z":
                found.append(entry)
    return found


@pytest.mark.parametrize("how", ["pool", "pool-in-thread", "exec-in-thread", "kernel-worker-child"])
def test_children_die_with_a_killed_parent(how):
    parent = subprocess.Popen([sys.executable, "-c", PARENT, how], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    try:
        assert parent.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 10
        while len(_session(parent.pid)) < (3 if how.startswith("pool") or how == "kernel-worker-child" else 2):
            assert time.monotonic() < deadline, _session(parent.pid)
            time.sleep(0.05)
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=10)
        deadline = time.monotonic() + 2.0
        while _session(parent.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _session(parent.pid) == [], "children outlived their parent by 2 s"
    finally:
        if _session(parent.pid):
            os.killpg(parent.pid, signal.SIGKILL)
        parent.wait()


def test_a_child_whose_parent_died_before_it_armed_the_signal_exits():
    """``child_of(p)`` in a process whose parent is no longer ``p`` (it died in between) exits 137."""
    code = "import os; from kiln.lifeline import child_of; child_of(os.getppid() + 1); print('survived')"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 137 and "survived" not in result.stdout


def test_run_finds_no_program_as_subprocess_does(tmp_path):
    from kiln import lifeline

    with pytest.raises(FileNotFoundError):
        lifeline.run(["kiln-no-such-program"], env={"PATH": str(tmp_path)})
    done = lifeline.run(["sh", "-c", "cat; echo err >&2; exit 3"], input="in")
    assert (done.returncode, done.stdout, done.stderr) == (3, "in", "err\n")
