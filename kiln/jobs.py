"""How many processes a build may run at once: ``KILN_JOBS``, else the machine's core count.

Patching forks one worker per selection group (``kiln.patch.memo``) and compiling runs one worker
per SM (``kiln.triton.aot``). On a shared machine (a CI runner, several builds or test workers
side by side) the core count oversubscribes it: ``KILN_JOBS=N`` caps both. A caller's own
``jobs`` argument still wins; a value that is not a positive integer is refused in one line.
"""

from __future__ import annotations

import os

from kiln.errors import KilnError

ENV = "KILN_JOBS"


def worker_count(tasks: int, asked: int | None = None) -> int:
    """Workers for ``tasks`` independent tasks: ``asked``, else ``KILN_JOBS``, else the cores."""
    limit = asked or configured() or os.cpu_count() or 1
    return max(1, min(tasks, limit))


def configured() -> int | None:
    """``KILN_JOBS`` as a positive integer, None when unset or empty."""
    text = os.environ.get(ENV, "").strip()
    if not text:
        return None
    if not text.isdigit() or int(text) < 1:
        raise KilnError(f"{ENV}={text!r}: must be a positive number of processes")
    return int(text)
