"""Named points in a build where a crash test can freeze it to kill it: ``KILN_TEST_PAUSE_AT``.

``tests/oci/test_crash_recovery.py`` runs ``build.py build`` with ``KILN_TEST_PAUSE_AT=<phase>``;
when the build reaches that point it prints ``kiln: paused at <phase>`` on stderr and sleeps
until killed, so the SIGKILL lands at a known point instead of after a timing guess. With the
variable unset (always, outside that test) a pause point only reads one environment variable.

Phases, in build order:
    pull    the top base layer is verified and cached; lower layers not read yet
    patch   the patches ran; nothing baked
    bake    kiln's layer is written in the work directory; nothing published
    push    every blob is in the registry; no manifest PUT yet (no tag)
"""

from __future__ import annotations

import os
import sys
import time

PHASES = ("pull", "patch", "bake", "push")


def pause_point(phase: str) -> None:
    assert phase in PHASES, phase
    if os.environ.get("KILN_TEST_PAUSE_AT") != phase:
        return
    sys.stderr.write(f"kiln: paused at {phase}\n")
    sys.stderr.flush()
    while True:
        time.sleep(60)
