"""``build.py bench`` against hostile servers: bounded in time and memory, one line per failure.

Each bench runs as a subprocess under ``ulimit -v`` (``RLIMIT_AS`` of ``MEMORY``), so a client
that reads a 3 GB line or a 4 GB model list whole dies of MemoryError (a traceback) instead of
passing. The servers (``hostile_openai.py``) stop by themselves after ``TIME_BUDGET`` seconds:
a sample whose wall time reaches it was not bounded by kiln. The rows of docs/RELIABILITY.md
("bench against hostile servers") are these tests.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.bench.hostile_openai import TIME_BUDGET, HostileOpenAI

pytestmark = pytest.mark.reliability

ROOT = Path(__file__).resolve().parents[2]
MEMORY = 512 << 20  # bytes of address space: a run here fits in 250 MiB; a whole 3 GB line does not
TIMEOUT = 3  # --timeout of each request
SLACK = 2.0  # seconds past a bound a loaded 2-core machine may take to notice it
BOUNDS = ["--timeout", str(TIMEOUT), "--max-stream-bytes", "2M"]

# mode -> the one-line reason its sample fails with (the 7th chunk is the bad one: role + 5 tokens first)
STREAM_CASES = {
    "endless": f"no complete answer within the --timeout of {TIMEOUT} s",
    "trickle": f"no complete answer within the --timeout of {TIMEOUT} s",
    "flood": "the stream sent more than 2 MiB (--max-stream-bytes)",
    "long_line": "event-stream line 3 is longer than 1 MiB (--max-line-bytes)",
    "not_utf8": "event-stream line 13 is not UTF-8 (byte 57: b'\\xe9')",
    "choices_string": "chunk 7: choices is a string, not a list",
    "content_int": "chunk 7: choices[0].delta.content is a number, not a string",
    "usage_negative": "chunk 7: usage.completion_tokens is -7: a token count cannot be negative",
    "usage_huge": "chunk 7: usage.completion_tokens is 1e+30, more than the 384 the request allowed",
    "nested": "chunk 7 is not JSON: '[[[[[[[[",
}


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY, MEMORY))


def bench(url: str, *args: str, tmp_path: Path, env: dict | None = None) -> tuple[subprocess.CompletedProcess, float]:
    """``build.py bench URL`` (one prompt, no warm-up, no battery) in a memory-capped subprocess."""
    argv = [sys.executable, str(ROOT / "build.py"), "bench", url, "--warmup", "0", "--battery-runs", "0",
            "--prompts", "short-prose", "--json", "--evidence", str(tmp_path / "evidence.json"), *args]
    started = time.monotonic()
    result = subprocess.run(argv, preexec_fn=_limit_memory, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "NO_COLOR": "1", **(env or {})}, cwd=tmp_path)
    return result, time.monotonic() - started


def assert_clean_lines(result: subprocess.CompletedProcess) -> list[str]:
    """No traceback; stderr is one-line warnings or errors, nothing else."""
    assert "Traceback" not in result.stderr and "MemoryError" not in result.stderr, result.stderr[-3000:]
    lines = result.stderr.splitlines()
    assert lines and all(line.startswith(("warning: ", "error: ")) for line in lines), result.stderr[-3000:]
    return lines


@pytest.fixture(scope="module")
def stream_run(tmp_path_factory):
    """One bench run whose n-th request meets the n-th hostile stream."""
    tmp_path = tmp_path_factory.mktemp("hostile")
    with HostileOpenAI(*STREAM_CASES) as server:
        result, elapsed = bench(server.url, "--runs", str(len(STREAM_CASES)), *BOUNDS, tmp_path=tmp_path)
    return result, elapsed, tmp_path / "evidence.json"


@pytest.mark.parametrize("mode", list(STREAM_CASES))
def test_reliability_bench_hostile_stream_fails_the_sample_in_one_line(stream_run, mode):
    result, elapsed, evidence = stream_run
    assert result.returncode == 1, result.stderr[-3000:]
    lines = assert_clean_lines(result)
    samples = json.loads(result.stdout)["speed"]["samples"]
    assert json.loads(evidence.read_text())["speed"]["samples"] == samples
    sample = samples[list(STREAM_CASES).index(mode)]
    assert not sample["ok"] and sample["error"].startswith(STREAM_CASES[mode]), sample["error"]
    assert sample["wall_tps"] is None and sample["tpot"] is None  # nothing of it counts as measured
    assert any(line.endswith(f"round {sample['round'] + 1}, concurrency 1: {sample['error']}") for line in lines)
    limit = TIMEOUT if mode in ("endless", "trickle") else TIME_BUDGET / 2
    assert sample["wall"] < limit + SLACK, f"{mode}: {sample['wall']:.1f} s"
    assert elapsed < 2 * TIMEOUT + 120  # the whole run: two timeouts, the rest cut at once (and a slow start)


def test_reliability_bench_run_timeout_bounds_the_whole_run(tmp_path):
    with HostileOpenAI("endless") as server:
        result, _ = bench(server.url, "--runs", "3", "--timeout", "600", "--run-timeout", "3", tmp_path=tmp_path)
    assert result.returncode == 1
    lines = assert_clean_lines(result)
    data = json.loads(result.stdout)
    (sample,) = data["speed"]["samples"]
    assert sample["error"].startswith("the run reached its --run-timeout after") and sample["wall"] < 3 + SLACK
    assert data["speed"]["unsent_requests"] == 2 and data["settings"]["run_timeout"] == 3
    assert ("warning: the speed run reached its --run-timeout of 3 s: 2 request(s) not sent; "
            "the figures use the requests that completed") in lines


@pytest.mark.parametrize(("mode", "why"), [
    ("huge_models", "GET /v1/models declares 4294967296 bytes, over the limit of 16 MiB (--max-body-bytes)"),
    ("huge_models_chunked", "GET /v1/models is over the limit of 16 MiB (--max-body-bytes)"),
])
def test_reliability_bench_huge_model_list_is_refused_unread(tmp_path, mode, why):
    with HostileOpenAI(mode) as server:
        result, elapsed = bench(server.url, tmp_path=tmp_path)
        assert result.returncode == 2
        assert assert_clean_lines(result) == [f"error: {server.url}: not an OpenAI-compatible endpoint ({why})"]
        assert [r[1] for r in server.requests] == ["/v1/models"]  # nothing sent after it
    assert elapsed < TIME_BUDGET


def test_reliability_bench_line_limit_from_the_environment(tmp_path):
    with HostileOpenAI("long_line") as server:
        result, _ = bench(server.url, "--runs", "1", tmp_path=tmp_path, env={"KILN_BENCH_MAX_LINE_BYTES": "64K"})
    assert result.returncode == 1
    (sample,) = json.loads(result.stdout)["speed"]["samples"]
    assert sample["error"] == "event-stream line 3 is longer than 64 KiB (--max-line-bytes)"
    assert json.loads(result.stdout)["settings"]["max_line"] == 64 * 1024
    assert_clean_lines(result)


@pytest.mark.parametrize("value", ["--max-line-bytes=lots", "--run-timeout=-1"])
def test_reliability_bench_bad_bound_is_a_usage_error(tmp_path, value):
    with HostileOpenAI("endless") as server:
        result, _ = bench(server.url, value, tmp_path=tmp_path)
        assert result.returncode == 2
        option = value.split("=")[0]
        (line,) = assert_clean_lines(result)
        assert line.startswith(f"error: {option}: expected a ")
        assert server.requests == []  # refused before any request


def test_reliability_bench_api_key_echoed_by_the_server_is_scrubbed(tmp_path):
    key = "sk-kiln-canary-0123456789"
    with HostileOpenAI("echo_key") as server:
        result, _ = bench(server.url, "--runs", "1", "--api-key", key, tmp_path=tmp_path)
        assert server.requests[-1][2]["authorization"] == f"Bearer {key}"  # the server was sent it ...
    assert result.returncode == 1
    (sample,) = json.loads(result.stdout)["speed"]["samples"]
    assert sample["error"] == "HTTP 500: bad credentials: Bearer <redacted>"  # ... and echoed it
    lines = assert_clean_lines(result)
    assert any(line.endswith("HTTP 500: bad credentials: Bearer <redacted>") for line in lines)
    evidence = (tmp_path / "evidence.json").read_text()
    for text in (result.stdout, result.stderr, evidence):
        assert key not in text
