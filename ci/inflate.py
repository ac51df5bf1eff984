"""Inflate speed of a gzip blob with each library that could read kiln's layers (benchmarks only).

    inflate_rates(path, runs=3) -> {name: {"seconds", "in", "out", "bytes"} | {"error"}}

``in``/``out``: MB/s (10^6 bytes) of compressed input and of inflated output; the median of
``runs``. 1 MiB reads from the file, one thread, as kiln's pull reads a layer; rapidgzip (a
parallel decoder that needs a seekable file, which a network stream is not) also with 2 threads.
"""

from __future__ import annotations

import importlib
import statistics
import time
import zlib
from pathlib import Path


def _stream(path: Path, decompressobj) -> int:
    inflate, size = decompressobj(31), 0
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 20):
            size += len(inflate.decompress(chunk))
    return size


def _rapidgzip(path: Path, threads: int) -> int:
    import rapidgzip

    size = 0
    with rapidgzip.open(str(path), parallelization=threads) as handle:
        while chunk := handle.read(1 << 20):
            size += len(chunk)
    return size


def inflate_rates(path: Path, runs: int = 3) -> dict[str, dict]:
    candidates = {
        "zlib": lambda: _stream(path, zlib.decompressobj),
        "isal": lambda: _stream(path, importlib.import_module("isal.isal_zlib").decompressobj),
        "zlib-ng": lambda: _stream(path, importlib.import_module("zlib_ng.zlib_ng").decompressobj),
        "rapidgzip (1 thread)": lambda: _rapidgzip(path, 1),
        "rapidgzip (2 threads)": lambda: _rapidgzip(path, 2),
    }
    compressed = path.stat().st_size
    rates: dict[str, dict] = {}
    for name, inflate in candidates.items():
        try:
            samples = []
            for _ in range(runs):
                start = time.perf_counter()
                size = inflate()
                samples.append(time.perf_counter() - start)
        except ImportError as err:
            rates[name] = {"error": f"not installed ({err.name})"}
            continue
        seconds = statistics.median(samples)
        rates[name] = {"seconds": seconds, "in": compressed / seconds / 1e6, "out": size / seconds / 1e6,
                       "bytes": size}
    return rates
