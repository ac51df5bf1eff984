"""Console output: rich tables and progress bars on stderr, plain JSON on stdout."""

from __future__ import annotations

import sys

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

# Outside a terminal (CI logs, pipes) rich would fold tables at 80 columns; use a wide page.
stdout = Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 200)
stderr = Console(stderr=True, highlight=False, width=None if sys.stderr.isatty() else 200)

_quiet = False


def set_quiet(quiet: bool) -> None:
    """Silence progress bars (``--json`` output must stay machine-readable)."""
    global _quiet
    _quiet = quiet


def transfer_progress() -> Progress:
    """A progress bar for byte transfers (downloads, pulls, pushes)."""
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=stderr,
        transient=True,
        disable=_quiet or not stderr.is_terminal,
    )
