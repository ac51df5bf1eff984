"""Runs against real fake servers: warm-up, interleaving, concurrency, noise and verdicts."""

from __future__ import annotations

import statistics

import pytest

from kiln.bench.client import connect
from kiln.bench.prompts import select_prompts
from kiln.bench.run import OVERALL, BenchSettings, run_speed
from kiln.bench.stats import BETTER, WITHIN_NOISE, WORSE, Summary
from kiln.report import Recorder

TWO = select_prompts(["short-prose", "long-code"])
SLACK = 0.25  # seconds a loaded 2-core machine may add between a server's write and our read


def test_warmup_is_excluded_and_every_figure_comes_from_the_samples(serve):
    server = serve(ttft=0.02, token_delay=0.004, delay_cycle=(0.002, 0.006, 0.012), tokens=15)
    settings = BenchSettings(runs=4, warmup=1, prompts=TWO)
    run = run_speed({"A": connect(server.url)}, settings)
    posts = server.posts()
    assert len(posts) == 2 + 4 * 2  # one warm-up pass, then 4 runs of 2 prompts
    warm = [s for s in run.samples if s.phase == "warmup"]
    assert [s.prompt for s in warm] == ["short-prose", "long-code"]
    measured = run.measured("A", 1)
    assert len(measured) == 8 and all(s.result.ok for s in measured)
    for prompt in ("short-prose", "long-code"):
        want = [s.result.wall_tps for s in measured if s.prompt == prompt]
        assert run.values("A", 1, prompt, "wall_tps") == want
        summary = run.summary("A", 1, prompt, "wall_tps")
        assert summary.n == 4 and summary.mean == pytest.approx(statistics.fmean(want))
        assert summary.median == pytest.approx(statistics.median(want))
        assert summary.cv == pytest.approx(statistics.stdev(want) / statistics.fmean(want))
    # overall: one figure per round, the round's tokens over its requests' wall time
    round_0 = [s for s in measured if s.round == 0]
    assert run.values("A", 1, OVERALL, "wall_tps")[0] == pytest.approx(
        sum(s.result.completion_tokens for s in round_0) / sum(s.result.wall for s in round_0))
    assert len(run.values("A", 1, OVERALL, "ttft")) == 4


def test_the_cv_is_the_noise_the_server_made(serve):
    """Token delays cycle 4/8/16 ms per request: kiln's CV of TPOT must be the server's CV."""
    server = serve(ttft=0.02, delay_cycle=(0.004, 0.008, 0.016), tokens=40)
    settings = BenchSettings(runs=6, warmup=0, prompts=select_prompts(["short-prose"]))
    run = run_speed({"A": connect(server.url)}, settings)
    logged = server.posts()
    server_tpot = [(e.last - e.first) / (e.tokens - 1) for e in logged]
    client = run.summary("A", 1, "short-prose", "tpot")
    truth = Summary.of(server_tpot)
    assert truth.cv > 0.4  # the designed noise is large
    assert client.cv == pytest.approx(truth.cv, abs=0.1)
    for sample, entry in zip(run.measured("A", 1), logged, strict=True):
        assert sample.value("tpot") == pytest.approx((entry.last - entry.first) / 39, abs=SLACK / 39)


def test_concurrent_batches_overlap_and_report_their_aggregate_throughput(serve):
    server = serve(ttft=0.05, token_delay=0.01, tokens=20)
    settings = BenchSettings(runs=2, warmup=0, concurrency=(1, 3), prompts=select_prompts(["short-code"]))
    run = run_speed({"A": connect(server.url)}, settings)
    assert [len(run.measured("A", c)) for c in (1, 3)] == [2, 6]
    logged = server.posts()
    assert len(logged) == 2 + 6
    for start in (2, 5):  # each batch of 3: all were received before any of them finished
        batch = logged[start:start + 3]
        assert max(e.received for e in batch) < min(e.last for e in batch)
    for batch in (b for b in run.batches if b.concurrency == 3):
        samples = [s for s in run.samples if s.batch == run.batches.index(batch)]
        assert len(samples) == 3 and batch.tokens == 60
        assert batch.wall >= max(s.result.wall for s in samples)
        assert batch.throughput == pytest.approx(60 / batch.wall)
    assert "throughput" in run.metrics(3) and "throughput" not in run.metrics(1)
    assert len(run.values("A", 3, "short-code", "throughput")) == 2


def test_endpoints_are_interleaved_and_alternate_who_goes_first(serve):
    a, b = serve(tokens=5), serve(tokens=5)
    settings = BenchSettings(runs=3, warmup=0, prompts=TWO)
    run_speed({"A": connect(a.url), "B": connect(b.url)}, settings)
    timeline = sorted([(e.received, "A", e.body["messages"][1]["content"][:10]) for e in a.posts()]
                      + [(e.received, "B", e.body["messages"][1]["content"][:10]) for e in b.posts()])
    order = [label for _, label, _ in timeline]
    assert order == ["A", "B", "A", "B",  # round 1: A first for each prompt
                     "B", "A", "B", "A",  # round 2: B first
                     "A", "B", "A", "B"]
    prompts = [text for _, _, text in timeline]
    assert prompts[0] == prompts[1] and prompts[2] == prompts[3] and prompts[0] != prompts[2]


def test_a_faster_server_is_better_and_equal_servers_are_within_noise(serve):
    # the same designed noise (TTFT and token delay cycles) on both sides of each pair
    noise = {"ttft_cycle": (0.02, 0.05, 0.09), "tokens": 20}
    fast = serve(delay_cycle=(0.003, 0.004, 0.005), **noise)
    slow = serve(delay_cycle=(0.012, 0.016, 0.020), **noise)
    settings = BenchSettings(runs=6, warmup=0, prompts=select_prompts(["short-prose"]))
    run = run_speed({"A": connect(fast.url), "B": connect(slow.url)}, settings)
    for prompt in ("short-prose", OVERALL):
        assert run.compare(1, prompt, "wall_tps").verdict == BETTER
        assert run.compare(1, prompt, "tpot").verdict == BETTER  # lower is better
    assert run.compare(1, "short-prose", "wall_tps").change > 0.5
    assert run.compare(1, "short-prose", "ttft").verdict == WITHIN_NOISE

    run = run_speed({"A": connect(slow.url), "B": connect(fast.url)}, settings)
    assert run.compare(1, "short-prose", "wall_tps").verdict == WORSE
    assert run.compare(1, "short-prose", "tpot").verdict == WORSE

    twin_a, twin_b = serve(delay_cycle=(0.004, 0.008, 0.016), **noise), serve(delay_cycle=(0.004, 0.008, 0.016), **noise)
    run = run_speed({"A": connect(twin_a.url), "B": connect(twin_b.url)}, settings)
    for metric in ("wall_tps", "ttft", "tpot"):
        comparison = run.compare(1, "short-prose", metric)
        assert comparison.verdict == WITHIN_NOISE, (metric, comparison)
        assert comparison.change_low < 0 < comparison.change_high


def test_a_dropped_stream_is_reported_and_the_run_goes_on(serve):
    server = serve(tokens=20, drop_requests=frozenset({3}), drop_after_chunks=5)
    recorder = Recorder()
    settings = BenchSettings(runs=3, warmup=0, prompts=TWO)
    run = run_speed({"A": connect(server.url)}, settings, recorder)
    assert len(run.samples) == 6  # every request was made
    (failed,) = run.failures()
    assert (failed.round, failed.prompt) == (1, "long-code")
    assert failed.result.error == "the stream broke off after 6 chunk(s), before [DONE]"
    assert recorder.warnings == [f"{server.url} (A), long-code, measure round 2, concurrency 1: "
                                 "the stream broke off after 6 chunk(s), before [DONE]"]
    assert len(run.values("A", 1, "long-code", "wall_tps")) == 2  # the others are kept
    assert len(run.values("A", 1, "short-prose", "wall_tps")) == 3
    assert len(run.values("A", 1, OVERALL, "wall_tps")) == 2  # the broken round is left out
    assert run.batches[3].failed == 1 and run.batches[3].throughput is None
    assert recorder.tasks == ["measuring"]  # no warm-up asked for


def test_a_server_that_dies_mid_run_fails_the_remaining_requests(serve):
    server = serve(tokens=5)
    endpoint = connect(server.url)
    server.__exit__(None, None, None)  # stops listening: every request is refused
    run = run_speed({"A": endpoint}, BenchSettings(runs=2, warmup=0, prompts=TWO))
    assert len(run.failures()) == 4
    assert run.failures()[0].result.error == "connection dropped after 0 chunk(s) (ConnectionRefusedError)"
    assert run.summary("A", 1, OVERALL, "wall_tps").n == 0


def test_request_options_reach_the_server(serve):
    server = serve(tokens=5)
    settings = BenchSettings(runs=1, warmup=0, prompts=TWO, max_tokens=3, temperature=0.6,
                             extra_body={"ignore_eos": True}, unique_prefix=True)
    run_speed({"A": connect(server.url)}, settings)
    first, second = (e.body for e in server.posts())
    assert first["max_tokens"] == 3 and first["temperature"] == 0.6 and first["ignore_eos"] is True
    assert first["messages"][0]["content"] != second["messages"][0]["content"]  # unique prefixes
    assert first["messages"][0]["content"].startswith("[request ")
