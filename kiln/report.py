"""How library code tells the user what it is doing, without printing.

Library calls that take long (downloads, pulls, pushes, kernel compiles) or have something to
say (a warning about an unlocked pin) take a ``Reporter`` argument, the way
go-containerregistry passes ``WithProgress``: the command line passes one that draws rich
progress bars on stderr; tests and scripts pass nothing and get ``SILENT``. Nothing below
``kiln/commands/`` writes to stdout or stderr itself.

Public API:
    Reporter        the do-nothing base: ``task(description, total)``, ``status(message)``,
                    ``stage(name, seconds, nbytes)``, ``warn(message)``, ``note(message)``;
                    subclass to show them
    Task            ``advance(amount)``, ``update(total=None, description=None)``
    Status          what ``status`` yields: ``finish(outcome)`` says how it ended ("from the cache"),
                    which a log line prints instead of a bare "done"
    SILENT          a shared ``Reporter()``
    Recorder        a Reporter that keeps what it was told (tests, ``--json`` warnings)
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


class Task:
    """One unit of progress (bytes of a transfer, files of a walk). Does nothing by itself."""

    def advance(self, amount: float) -> None:
        return None

    def update(self, total: float | None = None, description: str | None = None) -> None:
        return None


class Status:
    """One ``Reporter.status``: ``finish(outcome)`` records how it ended, so the line a log gets
    tells what happened (a cache hit is not reported as the work it replaced)."""

    def __init__(self) -> None:
        self.outcome: str | None = None

    def finish(self, outcome: str) -> None:
        self.outcome = outcome


class Reporter:
    """Progress and messages from library code; every method may be overridden, none must be."""

    @contextmanager
    def task(self, description: str, total: float | None = None, unit: str = "bytes") -> Iterator[Task]:
        """A progress task for the duration of the block; ``unit`` is "bytes" or "items"."""
        yield Task()

    @contextmanager
    def status(self, message: str) -> Iterator[Status]:
        """Something slow without a measurable total (a compile, a resolve); say what it did
        with the ``Status`` it yields."""
        yield Status()

    def stage(self, name: str, seconds: float, nbytes: int | None = None) -> None:
        """A stage of a long command finished (a build's resolve, pull, patch, ...): how long it
        took and, where the stage moves data, how many bytes (pulled, written or pushed)."""
        return None

    def warn(self, message: str) -> None:
        """Something the user should know that does not stop the work (one line)."""
        return None

    def note(self, message: str) -> None:
        """Something informative (one line)."""
        return None


SILENT = Reporter()


class Recorder(Reporter):
    """Keeps the messages and tasks it is given, for tests and for ``--json`` summaries."""

    def __init__(self) -> None:
        self.warnings: list[str] = []
        self.notes: list[str] = []
        self.tasks: list[str] = []
        self.statuses: list[str] = []
        self.outcomes: list[str | None] = []  # each status's ``finish``, in order
        self.stages: list[tuple[str, float, int | None]] = []

    @contextmanager
    def task(self, description: str, total: float | None = None, unit: str = "bytes") -> Iterator[Task]:
        self.tasks.append(description)
        yield Task()

    @contextmanager
    def status(self, message: str) -> Iterator[Status]:
        self.statuses.append(message)
        status = Status()
        yield status
        self.outcomes.append(status.outcome)

    def stage(self, name: str, seconds: float, nbytes: int | None = None) -> None:
        self.stages.append((name, seconds, nbytes))

    def warn(self, message: str) -> None:
        self.warnings.append(message)

    def note(self, message: str) -> None:
        self.notes.append(message)
