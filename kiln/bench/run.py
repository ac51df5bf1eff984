"""Running the measurements: warm-up, rounds, interleaved endpoints, concurrent batches.

Order of a speed run, for each concurrency level ``c`` in turn:

    for round in 1..runs:
        for prompt in the prompt set:
            for endpoint in (A, B) on even rounds, (B, A) on odd rounds:
                send c identical requests at once and wait for all of them

so the two endpoints see the same load, alternately first, and a drift of the machine (heat,
a neighbour's job) falls on both. Each request is one ``Sample``; each batch also gives the
aggregate throughput (the batch's completion tokens / the batch's wall time). Before the
rounds, every endpoint answers ``warmup`` passes over the prompt set at concurrency 1, whose
samples are kept in the evidence but never in a figure.

A failed request (HTTP error, dropped connection, a malformed chunk, no answer within
``timeout``) becomes a failed sample: the run goes on, the failure is reported, and the figures
use the samples that completed. The whole run has a deadline (``run_timeout``): no request is
sent after it and none runs past it; the requests left are counted as ``unsent``.

Public API:
    BenchSettings                     runs, warmup, concurrency levels, prompts, request options
    Sample, Batch                     one request / one concurrent batch
    SpeedRun                          samples and batches, with ``figures(...)`` per prompt and overall
    run_speed(endpoints, settings, reporter, deadline=None) -> SpeedRun
    BatteryRun, run_battery(endpoints, cases, runs, settings, reporter, deadline=None) -> BatteryRun
    OutOfTime                         raised inside a run when its deadline passes (caught there)
    METRICS                           name -> (unit, higher_is_better)
"""

from __future__ import annotations

import statistics
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from kiln.bench.battery import ToolCase, judge
from kiln.bench.client import Endpoint, StreamResult, stream_chat
from kiln.bench.prompts import PROMPTS, Prompt
from kiln.bench.stats import Comparison, Summary, verdict
from kiln.bench.wire import DEFAULT_BOUNDS, Bounds
from kiln.report import SILENT, Reporter

# metric -> (unit, higher is better)
METRICS = {
    "wall_tps": ("tok/s", True),
    "ttft": ("s", False),
    "tpot": ("s", False),
    "throughput": ("tok/s", True),  # aggregate of a concurrent batch
}
OVERALL = "overall"


@dataclass(frozen=True)
class BenchSettings:
    runs: int = 5
    warmup: int = 1
    concurrency: tuple[int, ...] = (1,)
    prompts: tuple[Prompt, ...] = PROMPTS
    max_tokens: int | None = None  # overrides every prompt's own
    temperature: float = 0.0
    extra_body: dict = field(default_factory=dict)  # merged into every request (e.g. ignore_eos)
    unique_prefix: bool = False  # a fresh first line per request, so no prefix-cache hit
    timeout: float = 600.0  # one request, all of it
    confidence: float = 0.95
    run_timeout: float = 6 * 3600.0  # the whole run: the speed part and the battery together
    bounds: Bounds = DEFAULT_BOUNDS

    def body(self, prompt: Prompt) -> dict:
        prefix = f"[request {uuid.uuid4().hex}]\n" if self.unique_prefix else ""
        return {"messages": prompt.messages(prefix), "temperature": self.temperature,
                "max_tokens": self.max_tokens or prompt.max_tokens, **self.extra_body}

    def to_json(self) -> dict:
        return {"runs": self.runs, "warmup": self.warmup, "concurrency": list(self.concurrency),
                "prompts": [p.id for p in self.prompts], "max_tokens": self.max_tokens,
                "temperature": self.temperature, "extra_body": self.extra_body,
                "unique_prefix": self.unique_prefix, "timeout": self.timeout, "confidence": self.confidence,
                "run_timeout": self.run_timeout, **self.bounds.to_json()}

    def deadline(self) -> float:
        """The ``time.perf_counter()`` the run must end by, from now."""
        return time.perf_counter() + self.run_timeout


class OutOfTime(Exception):
    """The run reached its deadline: nothing more is sent."""


@dataclass
class Sample:
    endpoint: str  # the endpoint's label: "A" (URL) or "B" (--against)
    phase: str  # "warmup" or "measure"
    concurrency: int
    round: int
    prompt: str
    slot: int  # the request's place in its concurrent batch
    batch: int  # index into SpeedRun.batches
    result: StreamResult

    def value(self, metric: str) -> float | None:
        return {"wall_tps": self.result.wall_tps, "ttft": self.result.ttft, "tpot": self.result.tpot}.get(metric)

    def to_json(self) -> dict:
        return {"endpoint": self.endpoint, "phase": self.phase, "concurrency": self.concurrency,
                "round": self.round, "prompt": self.prompt, "slot": self.slot, "batch": self.batch,
                **self.result.to_json()}


@dataclass
class Batch:
    endpoint: str
    phase: str
    concurrency: int
    round: int
    prompt: str
    wall: float
    tokens: int  # completion tokens of its completed requests
    failed: int

    @property
    def throughput(self) -> float | None:
        return self.tokens / self.wall if self.wall > 0 and not self.failed else None

    def to_json(self) -> dict:
        return {"endpoint": self.endpoint, "phase": self.phase, "concurrency": self.concurrency,
                "round": self.round, "prompt": self.prompt, "wall": self.wall, "tokens": self.tokens,
                "failed": self.failed, "throughput": self.throughput}


@dataclass
class SpeedRun:
    labels: tuple[str, ...]
    settings: BenchSettings
    samples: list[Sample] = field(default_factory=list)
    batches: list[Batch] = field(default_factory=list)
    unsent: int = 0  # requests the run's deadline left unsent

    def measured(self, label: str, concurrency: int) -> list[Sample]:
        return [s for s in self.samples
                if s.phase == "measure" and s.endpoint == label and s.concurrency == concurrency]

    def failures(self) -> list[Sample]:
        return [s for s in self.samples if not s.result.ok]

    def values(self, label: str, concurrency: int, prompt: str, metric: str) -> list[float]:
        """The metric's samples: one per request for a prompt; one per round for OVERALL."""
        if prompt == OVERALL:
            return self._round_values(label, concurrency, metric)
        if metric == "throughput":
            return [b.throughput for b in self.batches if b.phase == "measure" and b.endpoint == label
                    and b.concurrency == concurrency and b.prompt == prompt and b.throughput is not None]
        return [v for s in self.measured(label, concurrency) if s.prompt == prompt
                and (v := s.value(metric)) is not None]

    def _round_values(self, label: str, concurrency: int, metric: str) -> list[float]:
        """Per round over the whole prompt set: tokens / time for rates, the mean for latencies.

        A round in which a request failed is left out: it would weigh the prompts differently.
        """
        values = []
        for number in range(self.settings.runs):
            samples = [s for s in self.measured(label, concurrency) if s.round == number]
            batches = [b for b in self.batches if b.phase == "measure" and b.endpoint == label
                       and b.concurrency == concurrency and b.round == number]
            if not samples or any(not s.result.ok for s in samples):
                continue
            if metric == "wall_tps":
                values.append(sum(s.result.completion_tokens for s in samples) / sum(s.result.wall for s in samples))
            elif metric == "throughput":
                values.append(sum(b.tokens for b in batches) / sum(b.wall for b in batches))
            else:
                found = [v for s in samples if (v := s.value(metric)) is not None]
                if found:
                    values.append(statistics.fmean(found))
        return values

    def rows(self) -> list[str]:
        return [p.id for p in self.settings.prompts] + [OVERALL]

    def metrics(self, concurrency: int) -> list[str]:
        return [m for m in METRICS if m != "throughput" or concurrency > 1]

    def summary(self, label: str, concurrency: int, prompt: str, metric: str) -> Summary:
        return Summary.of(self.values(label, concurrency, prompt, metric))

    def compare(self, concurrency: int, prompt: str, metric: str) -> Comparison:
        """The first endpoint against the second, by Welch's test."""
        first, second = self.labels[:2]
        return verdict(self.values(first, concurrency, prompt, metric),
                       self.values(second, concurrency, prompt, metric),
                       METRICS[metric][1], self.settings.confidence)


def _batch(pool: ThreadPoolExecutor, endpoint: Endpoint, bodies: list[dict], settings: BenchSettings,
           deadline: float):
    start = time.perf_counter()
    if start >= deadline:
        raise OutOfTime
    futures = [pool.submit(stream_chat, endpoint, body, settings.timeout, settings.bounds, deadline)
               for body in bodies]
    results = [future.result() for future in futures]
    return results, time.perf_counter() - start


def _out_of_time(reporter: Reporter, settings: BenchSettings, what: str, unsent: int) -> None:
    reporter.warn(f"the {what} reached its --run-timeout of {settings.run_timeout:g} s: {unsent} request(s) "
                  "not sent; the figures use the requests that completed")


def run_speed(endpoints: dict[str, Endpoint], settings: BenchSettings, reporter: Reporter = SILENT,
              deadline: float | None = None) -> SpeedRun:
    """Warm up, then measure every endpoint (label -> Endpoint) at every concurrency level.

    ``deadline`` (``time.perf_counter()``; default: ``run_timeout`` from now) ends the run.
    """
    labels = tuple(endpoints)
    run = SpeedRun(labels, settings)
    levels = settings.concurrency
    deadline = settings.deadline() if deadline is None else deadline
    planned = len(settings.prompts) * len(labels) * (settings.warmup + settings.runs * sum(levels))
    with ThreadPoolExecutor(max_workers=max(levels)) as pool:

        def measure(label: str, phase: str, concurrency: int, number: int, prompt: Prompt) -> None:
            results, wall = _batch(pool, endpoints[label], [settings.body(prompt) for _ in range(concurrency)],
                                   settings, deadline)
            index = len(run.batches)
            run.batches.append(Batch(label, phase, concurrency, number, prompt.id, wall,
                                     sum(r.completion_tokens or 0 for r in results if r.ok),
                                     sum(not r.ok for r in results)))
            for slot, result in enumerate(results):
                run.samples.append(Sample(label, phase, concurrency, number, prompt.id, slot, index, result))
                if not result.ok:
                    reporter.warn(f"{endpoints[label].url} ({label}), {prompt.id}, {phase} round {number + 1}, "
                                  f"concurrency {concurrency}: {result.error}")

        try:
            _speed_rounds(run, settings, labels, levels, measure, reporter)
        except OutOfTime:
            run.unsent = planned - len(run.samples)
            _out_of_time(reporter, settings, "speed run", run.unsent)
    return run


def _speed_rounds(run: SpeedRun, settings: BenchSettings, labels, levels, measure, reporter: Reporter) -> None:
    if settings.warmup:
        with reporter.task("warm-up", total=settings.warmup * len(settings.prompts) * len(labels),
                           unit="items") as task:
            for number in range(settings.warmup):
                for prompt in settings.prompts:
                    for label in labels:
                        measure(label, "warmup", 1, number, prompt)
                        task.advance(1)
    total = settings.runs * len(settings.prompts) * len(labels) * sum(levels)
    with reporter.task("measuring", total=total, unit="items") as task:
        for concurrency in levels:
            task.update(description=f"measuring at concurrency {concurrency}")
            for number in range(settings.runs):
                order = labels if number % 2 == 0 else labels[::-1]
                for prompt in settings.prompts:
                    for label in order:
                        measure(label, "measure", concurrency, number, prompt)
                        task.advance(concurrency)


# -- the tool-call battery ------------------------------------------------------------------------


@dataclass
class BatteryRun:
    labels: tuple[str, ...]
    cases: tuple[ToolCase, ...]
    runs: int
    results: list[tuple[str, str, int, StreamResult, object]] = field(default_factory=list)
    # (label, case id, attempt, the streamed answer, its Judgement)
    unsent: int = 0  # attempts the run's deadline left unsent

    def judgements(self, label: str, case: str | None = None) -> list:
        return [j for lab, cid, _, _, j in self.results if lab == label and (case is None or cid == case)]

    def clean(self, label: str, case: str | None = None) -> tuple[int, int]:
        found = self.judgements(label, case)
        return sum(j.clean for j in found), len(found)

    def to_json(self) -> dict:
        return {
            "runs": self.runs,
            "cases": [{"id": c.id, "aim": c.aim, "user": c.user,
                       "expected": [{"name": e.name, "arguments": {k: v.describe() for k, v in e.arguments.items()}}
                                    for e in c.expected]} for c in self.cases],
            "clean": {label: {"clean": self.clean(label)[0], "total": self.clean(label)[1],
                              "by_case": {c.id: list(self.clean(label, c.id)) for c in self.cases}}
                      for label in self.labels},
            "attempts": [{"endpoint": label, "case": cid, "attempt": attempt, **judgement.to_json(),
                          "answer": result.to_json()} for label, cid, attempt, result, judgement in self.results],
            "unsent": self.unsent,
        }


def run_battery(endpoints: dict[str, Endpoint], cases: Sequence[ToolCase], runs: int,
                settings: BenchSettings, reporter: Reporter = SILENT, deadline: float | None = None) -> BatteryRun:
    """Every case ``runs`` times on every endpoint, endpoints interleaved, one request at a time."""
    labels = tuple(endpoints)
    battery = BatteryRun(labels, tuple(cases), runs)
    deadline = settings.deadline() if deadline is None else deadline
    total = runs * len(cases) * len(labels)
    with reporter.task("tool-call battery", total=total, unit="items") as task:
        for attempt in range(runs):
            order = labels if attempt % 2 == 0 else labels[::-1]
            for case in cases:
                for label in order:
                    if time.perf_counter() >= deadline:
                        battery.unsent = total - len(battery.results)
                        _out_of_time(reporter, settings, "battery", battery.unsent)
                        return battery
                    body = {**case.request_body(), **settings.extra_body}
                    result = stream_chat(endpoints[label], body, settings.timeout, settings.bounds, deadline)
                    battery.results.append((label, case.id, attempt, result, judge(case, result)))
                    if not result.ok:
                        reporter.warn(f"{endpoints[label].url} ({label}), tool-call case {case.id}: {result.error}")
                    task.advance(1)
    return battery
