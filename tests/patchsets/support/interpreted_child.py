"""Run a test module's ``child_main`` in a fresh Python under Triton's interpreter.

``TRITON_INTERPRET=1`` must be set before any kernel is decorated, so the kernels run in a child
process the test starts: ``child_main()`` of ``module`` reads the files the parent wrote to
``where`` and prints its results as JSON on its last stdout line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def run_child(module: str, where: Path, timeout: float):
    """``module``'s ``child_main()`` run on ``where`` with ``TRITON_INTERPRET=1``: its JSON result."""
    proc = subprocess.run(
        [sys.executable, "-c", f"from {module} import child_main; child_main()", str(where)],
        cwd=REPO, env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
