"""What the command line shows: rich tables and progress on stderr, JSON or tables on stdout.

Public API:
    Output(json_mode=False, progress="auto")
        .stdout / .stderr      rich Consoles (wide pages outside a terminal, so CI logs keep rows)
        .json(data)            ``data`` as indented JSON on stdout
        .warn(message)         ``warning: ...`` on stderr
        .error(message)        ``error: ...`` on stderr (one line)
        .reporter() -> Reporter   progress of library calls on stderr, by ``--progress``:
                               ``tty`` rich bars (``auto`` on a terminal; none under --json),
                               ``plain`` one line per finished stage, transfer or step with its
                               bytes and seconds (``auto`` elsewhere: CI logs), ``quiet`` none;
                               warnings reach stderr in every mode
    PROGRESS_MODES             ``auto``, ``plain``, ``tty``, ``quiet``
    VERDICT_STYLE              the colour of each verdict in tables

Only ``kiln/commands/`` uses this module: library code reports through ``kiln.report``.
Everything it shows is scrubbed of the secrets kiln knows (``kiln.secrets``): messages and
JSON before they are rendered, and whatever else reaches stdout/stderr as it is written.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    SpinnerColumn,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.text import Text

from kiln.patch.outcome import Verdict
from kiln.report import Reporter, Status, Task
from kiln.secrets import scrub, scrub_data

VERDICT_STYLE = {
    Verdict.APPLIES: "green",
    Verdict.ALREADY_PATCHED: "green",
    Verdict.UPSTREAM: "cyan",
    Verdict.GATED: "yellow",
    Verdict.OUT_OF_RANGE: "magenta",
    Verdict.DRIFTED: "red",
    Verdict.TARGET_GONE: "red",
    Verdict.CONFLICT: "red",
}

_PAGE = 200  # columns outside a terminal: rich would otherwise fold tables at 80
PROGRESS_MODES = ("auto", "plain", "tty", "quiet")


def styled(verdict: Verdict | str, text: str | None = None) -> str:
    """``verdict`` (or ``text`` in its place) in the verdict's colour, as rich markup."""
    verdict = Verdict(verdict)
    return f"[{VERDICT_STYLE[verdict]}]{text or verdict}[/]"


class _Scrubbed:
    """``sys.stdout`` / ``sys.stderr`` (looked up at each write, as rich does), scrubbed of secrets."""

    def __init__(self, name: str) -> None:
        self._name = name

    @property
    def _stream(self):
        stream = getattr(sys, self._name)
        # while a progress display runs, rich puts a proxy there that prints through this console
        return getattr(stream, "rich_proxied_file", stream)

    @property
    def rich_proxied_file(self):  # rich unwraps its proxies with this name: never past the scrubbing
        return self

    def write(self, text: str) -> int:
        return self._stream.write(scrub(text))

    def __getattr__(self, attr: str):
        return getattr(self._stream, attr)


class Output:
    def __init__(self, json_mode: bool = False, progress: str = "auto") -> None:
        self.json_mode = json_mode
        self.progress = progress
        forced = True if progress == "tty" else None
        self.stdout = Console(file=_Scrubbed("stdout"), highlight=False, soft_wrap=True,
                              width=None if sys.stdout.isatty() else _PAGE)
        self.stderr = Console(file=_Scrubbed("stderr"), highlight=False, force_terminal=forced,
                              width=None if sys.stderr.isatty() or forced else _PAGE)

    def json(self, data) -> None:
        sys.stdout.write(json.dumps(scrub_data(data), indent=2) + "\n")
        sys.stdout.flush()

    def warn(self, message: str) -> None:
        self.stderr.print(f"[yellow]warning:[/] {escape(scrub(message))}", soft_wrap=True)

    def error(self, message: str) -> None:
        self.stderr.print(f"[red]error:[/] {escape(scrub(message))}", soft_wrap=True)

    def reporter(self) -> RichReporter | PlainReporter:
        mode = self.progress
        if mode == "auto":
            mode = "tty" if self.stderr.is_terminal else "plain"
        if mode == "plain":
            return PlainReporter(self)
        # tty: bars (asked for, or on a terminal without --json); quiet: warnings only
        return RichReporter(self, bars=self.progress == "tty" or (mode == "tty" and not self.json_mode))


class _Figures(ProgressColumn):
    """Bytes (size and speed) for transfers, ``n/m`` for counted items, nothing for a status."""

    def __init__(self) -> None:
        super().__init__()
        self._bytes = DownloadColumn()
        self._speed = TransferSpeedColumn()
        self._items = MofNCompleteColumn()

    def render(self, task) -> Text:
        unit = task.fields.get("unit")
        if unit == "bytes":
            return Text.assemble(self._bytes.render(task), " ", self._speed.render(task))
        if unit == "items" and task.total is not None:
            return self._items.render(task)
        return Text("")


class _RichTask(Task):
    def __init__(self, progress: Progress, task_id) -> None:
        self._progress, self._id = progress, task_id

    def advance(self, amount: float) -> None:
        self._progress.advance(self._id, amount)

    def update(self, total: float | None = None, description: str | None = None) -> None:
        changes = {}
        if total is not None:
            changes["total"] = total
        if description is not None:
            changes["description"] = _short(description)
        self._progress.update(self._id, **changes)


def _short(description: str, width: int = 32) -> str:
    """Descriptions are cut so the figures fit an 80-column terminal."""
    return description if len(description) <= width else description[: width - 1] + "…"


class RichReporter(Reporter):
    """One rich ``Progress`` on stderr shared by every task and status of a command."""

    def __init__(self, output: Output, bars: bool = True) -> None:
        self._output = output
        self._bars = bars
        self._progress: Progress | None = None
        self._open = 0
        self._lock = threading.Lock()  # a build compiles its kernels beside the patching
        self.warnings: list[str] = []

    @property
    def enabled(self) -> bool:
        return self._bars and self._output.stderr.is_terminal

    def _start(self) -> Progress:
        with self._lock:
            return self._start_locked()

    def _start_locked(self) -> Progress:
        if self._progress is None:
            self._progress = Progress(
                SpinnerColumn(),
                TextColumn("{task.description}"),
                BarColumn(bar_width=24),
                _Figures(),
                TimeRemainingColumn(),
                console=self._output.stderr,
                transient=True,
                disable=not self.enabled,
            )
            self._progress.start()
        self._open += 1
        return self._progress

    def _stop(self, task_id) -> None:
        with self._lock:
            self._stop_locked(task_id)

    def _stop_locked(self, task_id) -> None:
        assert self._progress is not None
        self._progress.remove_task(task_id)
        self._open -= 1
        if self._open == 0:
            self._progress.stop()
            self._progress = None

    @contextmanager
    def task(self, description: str, total: float | None = None, unit: str = "bytes") -> Iterator[Task]:
        progress = self._start()
        task_id = progress.add_task(_short(description), total=total, unit=unit)
        try:
            yield _RichTask(progress, task_id)
        finally:
            self._stop(task_id)

    @contextmanager
    def status(self, message: str) -> Iterator[Status]:
        progress = self._start()
        task_id = progress.add_task(_short(message, 60), total=None, unit="status")
        try:
            yield Status()
        finally:
            self._stop(task_id)

    def warn(self, message: str) -> None:
        message = scrub(message)
        with self._lock:
            self.warnings.append(message)
            if self._progress is not None:
                self._progress.console.print(f"[yellow]warning:[/] {escape(message)}", soft_wrap=True)
            else:
                self._output.warn(message)

    def note(self, message: str) -> None:
        if self.enabled:
            self._output.stderr.print(escape(scrub(message)), soft_wrap=True)


def _size(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    raise AssertionError


class _PlainTask(Task):
    def __init__(self, description: str) -> None:
        self.description, self.done = description, 0.0

    def advance(self, amount: float) -> None:
        self.done += amount

    def update(self, total: float | None = None, description: str | None = None) -> None:
        if description is not None:
            self.description = description


class PlainReporter(Reporter):
    """One line on stderr per finished stage, transfer or step, for logs (BuildKit's
    ``--progress=plain``): what, how many bytes (or items), how many seconds. Nothing is redrawn."""

    def __init__(self, output: Output) -> None:
        self._output = output
        self._lock = threading.Lock()  # lines from the kernels' thread never interleave
        self.warnings: list[str] = []

    def _line(self, text: str) -> None:
        with self._lock:
            self._output.stderr.print(text, markup=False, highlight=False, soft_wrap=True)

    @contextmanager
    def task(self, description: str, total: float | None = None, unit: str = "bytes") -> Iterator[Task]:
        task, started = _PlainTask(description), time.monotonic()
        yield task  # a failed transfer prints nothing here: its error says what happened
        seconds = time.monotonic() - started
        if unit == "bytes":
            self._line(f"{task.description}: {int(task.done)} bytes ({_size(task.done)}) in {seconds:.2f}s")
        else:
            self._line(f"{task.description}: {int(task.done)} done in {seconds:.2f}s")

    @contextmanager
    def status(self, message: str) -> Iterator[Status]:
        started, status = time.monotonic(), Status()
        yield status
        self._line(f"{message}: {status.outcome or 'done'} in {time.monotonic() - started:.2f}s")

    def stage(self, name: str, seconds: float, nbytes: int | None = None) -> None:
        moved = "" if nbytes is None else f"{nbytes} bytes ({_size(nbytes)}) in "
        self._line(f"stage {name}: {moved}{seconds:.2f}s")

    def warn(self, message: str) -> None:
        with self._lock:
            self.warnings.append(message)
        self._line(f"warning: {message}")

    def note(self, message: str) -> None:
        self._line(message)
