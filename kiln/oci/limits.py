"""Bounds on the work a base image or a registry can cause: bytes, layers, time.

Public API:
    Limits(layer_bytes, build_bytes, layers, deadline, connect_timeout, read_timeout, stall_warning)
        Limits.from_env(**overrides) -> Limits     the environment, then ``overrides`` (options) win
        .raise_hint(name) -> str                   "--max-layers or KILN_MAX_LAYERS"
    KNOBS            field -> Knob(option, env, what, kind): the one list of every limit's names
    Budget(limits, clock=time.monotonic)          one build's (or command's) use of its limits
        .timeouts() -> (connect, read)            the read timeout never outlives the deadline
        .check_deadline(doing)                    LimitExceeded once the deadline has passed
        .remaining() -> float                     .sleep(seconds)   a retry's wait, cut at the deadline
        .check_layers(name, count)                LimitExceeded above ``limits.layers``
        .inflated(name, layer_bytes, added)       count decompressed bytes; LimitExceeded above
                                                  the per-layer or per-build limit
        .bytes_inflated                           decompressed bytes counted so far
    LimitExceeded(KilnError)                      one line: what, the limit, how to raise it
    parse_size(text) -> int  ("32GiB", "512M", "1000")    parse_seconds(text) -> float ("2h", "90m", "30")

Why these defaults (a real base is never refused; a hostile one is stopped early):
- ``layer_bytes`` 32 GiB: vllm/vllm-openai is ~28 GB uncompressed in ~30 layers, its largest
  layer (CUDA and torch libraries) several GB; no real layer comes near 32 GiB. A gzip bomb
  (8 MB that inflates to many GiB) stops there instead of at the disk's or the clock's end.
- ``build_bytes`` 64 GiB: every layer a build may read, together (kiln reads only the top
  layers holding vLLM; twice the whole real image still fits).
- ``layers`` 256: Docker's overlay2 refuses images of more than 128 layers, so no runtime would
  start more; a manifest listing thousands (each a request and a decompression) is refused
  before the first is fetched. The cap sits above 128 so a base a runtime can start is kept.
- ``deadline`` 2 h: a cold build of the real image takes minutes; a registry trickling bytes
  just above the read timeout would otherwise hold a CI job forever. Checked at every registry
  request, every read of a layer and between the build's steps.
- ``connect_timeout`` 30 s, ``read_timeout`` 300 s: per request, as before; a read that times
  out is resumed (``kiln.oci.resumable``), bounded by the retries.
- ``stall_warning`` 30 s: a download without a byte for this long says, through the
  ``Reporter``, that it is waiting (and on what), rather than looking hung.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, fields, replace

from kiln.errors import KilnError

GiB = 1 << 30


@dataclass(frozen=True)
class Knob:
    option: str
    env: str
    what: str  # for --help and messages
    kind: str  # "size", "count" or "seconds"


KNOBS = {
    "layer_bytes": Knob("--max-layer-bytes", "KILN_MAX_LAYER_BYTES", "decompressed bytes of one base layer", "size"),
    "build_bytes": Knob("--max-build-bytes", "KILN_MAX_BUILD_BYTES", "decompressed bytes of all base layers a build reads",
                        "size"),
    "layers": Knob("--max-layers", "KILN_MAX_LAYERS", "layers of a base image", "count"),
    "deadline": Knob("--deadline", "KILN_BUILD_DEADLINE", "time a build may take", "seconds"),
    "connect_timeout": Knob("--connect-timeout", "KILN_REGISTRY_CONNECT_TIMEOUT", "seconds to connect to a registry",
                            "seconds"),
    "read_timeout": Knob("--read-timeout", "KILN_REGISTRY_READ_TIMEOUT", "seconds a registry may leave a read unanswered",
                         "seconds"),
    "stall_warning": Knob("--stall-warning", "KILN_STALL_WARNING", "seconds without a byte before a download says it waits",
                          "seconds"),
}


class LimitExceeded(KilnError):
    """A limit of ``Limits`` was reached; the message names it and how to raise it."""


@dataclass(frozen=True)
class Limits:
    layer_bytes: int = 32 * GiB
    build_bytes: int = 64 * GiB
    layers: int = 256
    deadline: float = 2 * 3600.0
    connect_timeout: float = 30.0
    read_timeout: float = 300.0
    stall_warning: float = 30.0

    @classmethod
    def from_env(cls, **overrides) -> Limits:
        values = {}
        for f in fields(cls):
            knob = KNOBS[f.name]
            text = os.environ.get(knob.env, "").strip()
            if text:
                values[f.name] = parse_knob(text, knob, f"${knob.env}={text!r}")
        values.update({name: value for name, value in overrides.items() if value is not None})
        return replace(cls(), **values)

    @staticmethod
    def raise_hint(name: str) -> str:
        knob = KNOBS[name]
        return f"raise it with {knob.option} or {knob.env}"


def parse_knob(text: str, knob: Knob, where: str) -> float:
    if knob.kind == "size":
        return parse_size(text, where)
    if knob.kind == "count":
        if not text.isdigit() or int(text) < 1:
            raise KilnError(f"{where}: expected a whole number of at least 1")
        return int(text)
    return parse_seconds(text, where)


_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B?)", re.IGNORECASE)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*(h|m|s|ms)?", re.IGNORECASE)
_SECONDS = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001, None: 1.0}


def parse_size(text: str, where: str = "size") -> int:
    """``32GiB``, ``32G``, ``512M``, ``1000`` (bytes); units are binary (K = 1024)."""
    match = _SIZE.fullmatch(text.strip())
    if not match or float(match.group(1)) <= 0:
        raise KilnError(f"{where}: expected a size like 32GiB, 512M or a number of bytes")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


def parse_seconds(text: str, where: str = "duration") -> float:
    """``2h``, ``90m``, ``30s``, ``500ms``, ``30`` (seconds)."""
    match = _DURATION.fullmatch(text.strip())
    if not match or float(match.group(1)) <= 0:
        raise KilnError(f"{where}: expected a duration like 2h, 90m, 30s or a number of seconds")
    unit = match.group(2).lower() if match.group(2) else None
    return float(match.group(1)) * _SECONDS[unit]


def size_text(n: float) -> str:
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:g} {unit}"
    return f"{n:g} bytes"


def seconds_text(s: float) -> str:
    if s >= 3600 and s % 3600 == 0:
        return f"{s / 3600:g} h"
    if s >= 60 and s % 60 == 0:
        return f"{s / 60:g} min"
    return f"{s:g} s"


class Budget:
    """What one build (or one command's registry work) has used of its ``Limits``.

    The deadline runs from the budget's creation. Shared by every client and layer reader of a
    build, so the per-build byte count covers all the layers it reads.
    """

    def __init__(self, limits: Limits | None = None, clock: Callable[[], float] = time.monotonic):
        self.limits = limits or Limits.from_env()
        self._clock = clock
        self.started = clock()
        self.bytes_inflated = 0

    def remaining(self) -> float:
        return self.limits.deadline - (self._clock() - self.started)

    def check_deadline(self, doing: str) -> None:
        if self.remaining() <= 0:
            raise LimitExceeded(f"{doing}: the build ran past its deadline of {seconds_text(self.limits.deadline)} "
                                f"({self.limits.raise_hint('deadline')})")

    def sleep(self, seconds: float) -> None:
        """Wait before a retry, but not past the deadline (the next request then reports it)."""
        time.sleep(max(min(seconds, self.remaining()), 0.0))

    def timeouts(self) -> tuple[float, float]:
        """(connect, read) for one request: neither waits past the deadline (plus a second, so
        the deadline, not a timeout, is what gets reported)."""
        left = max(self.remaining(), 0.0) + 1.0
        return min(self.limits.connect_timeout, left), min(self.limits.read_timeout, left)

    def check_layers(self, name: str, count: int) -> None:
        if count > self.limits.layers:
            raise LimitExceeded(f"{name}: {count} layers, over kiln's limit of {self.limits.layers} (no container "
                                f"runtime starts an image that deep; {self.limits.raise_hint('layers')})")

    def inflated(self, name: str, layer_bytes: int, added: int) -> None:
        """``added`` more decompressed bytes of a layer now at ``layer_bytes`` in all."""
        self.bytes_inflated += added
        limits = self.limits
        if layer_bytes > limits.layer_bytes:
            raise LimitExceeded(f"{name}: decompresses to more than {size_text(limits.layer_bytes)}, kiln's limit "
                                f"for one layer ({limits.raise_hint('layer_bytes')})")
        if self.bytes_inflated > limits.build_bytes:
            raise LimitExceeded(f"{name}: the layers read decompress to more than {size_text(limits.build_bytes)}, "
                                f"kiln's limit for one build ({limits.raise_hint('build_bytes')})")
