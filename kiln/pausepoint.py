"""Named points in a build where a crash test can freeze it to kill it: ``KILN_TEST_PAUSE_AT``.

``tests/image/test_crash_recovery.py`` and ``tests/image/test_killed_builds.py`` run ``build.py
build`` with ``KILN_TEST_PAUSE_AT=<phase>``; when the build reaches that point it prints ``kiln:
paused at <phase>`` on stderr and sleeps until killed, so the signal lands at a known point
instead of after a timing guess. With the variable unset (always, outside those tests) a pause
point only reads one environment variable.

Phases, in build order:
    pull      the top base layer is verified and cached; lower layers not read yet
    patching  inside a patch group's run (in a forked worker when the groups run in parallel)
    kernels   a Triton kernel worker process runs (compiling one SM's kernels)
    patch     the patches ran; nothing baked
    bake      kiln's layer is written in the work directory; nothing published
    push      every blob is in the registry; no manifest PUT yet (no tag)
    commit    the local outputs are committed; the manifest PUT (the tag) not sent yet

With ``KILN_TEST_RESUME=FILE`` the build goes on once FILE exists (``tests/image/test_no_space.py``
fills the disk while the build waits, so the next stage meets a full disk).

A paused build still stops on SIGTERM/SIGINT (``kiln.lifeline``): the pause raises
``Interrupted`` in whichever thread it holds.
"""

from __future__ import annotations

import os
import sys
import time

from kiln.lifeline import check

PHASES = ("pull", "patching", "kernels", "patch", "bake", "push", "commit")


def pause_point(phase: str) -> None:
    assert phase in PHASES, phase
    if os.environ.get("KILN_TEST_PAUSE_AT") != phase:
        return
    sys.stderr.write(f"kiln: paused at {phase}\n")
    sys.stderr.flush()
    resume = os.environ.get("KILN_TEST_RESUME")
    while not (resume and os.path.exists(resume)):
        check()
        time.sleep(0.1)
