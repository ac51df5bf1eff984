"""``build.py bench URL [--against URL2]``: speed and tool-call cleanliness of a served model.

The method (what each figure means, warm-up, interleaving, the Welch verdict) is in
docs/BENCH.md; the measuring is ``kiln.bench``. This module parses the options, shows tables
and progress, writes the evidence and the plot, and maps the outcome to an exit code:
0 measured, nothing failed and every tool call of URL was clean; 1 a request failed, the run
reached its --run-timeout, or a tool call of URL was dirty; 2 bad input (an endpoint that does
not answer or is not OpenAI-compatible, a bad option). Whatever it shows or writes is scrubbed
of the API key (``kiln.secrets``): a server may echo it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import replace
from pathlib import Path

from rich.markup import escape
from rich.table import Table

from kiln.bench import battery as battery_cases
from kiln.bench.client import connect
from kiln.bench.evidence import evidence, image_info, machine_info
from kiln.bench.prompts import PROMPT_SET_VERSION, select_prompts
from kiln.bench.run import METRICS, OVERALL, BenchSettings, run_battery, run_speed
from kiln.bench.stats import BETTER, WORSE
from kiln.bench.wire import DEFAULT_BOUNDS, quote
from kiln.commands.options import add_progress_option, command_inputs
from kiln.commands.output import Output
from kiln.errors import KilnError
from kiln.oci.limits import parse_seconds, parse_size, size_text
from kiln.publish.destinations import check_distinct, check_output_path
from kiln.secrets import scrub, scrub_data
from kiln.staging import write_atomic

VERDICT_COLOUR = {BETTER: "green", WORSE: "red"}
# the bounds on what a server may cost a run: dest -> (option, environment variable, parser)
BOUNDS = {
    "max_line": ("--max-line-bytes", "KILN_BENCH_MAX_LINE_BYTES", parse_size),
    "max_body": ("--max-body-bytes", "KILN_BENCH_MAX_BODY_BYTES", parse_size),
    "max_stream": ("--max-stream-bytes", "KILN_BENCH_MAX_STREAM_BYTES", parse_size),
    "run_timeout": ("--run-timeout", "KILN_BENCH_RUN_TIMEOUT", parse_seconds),
}


def _bound(args, dest: str):
    """The option's value, else the environment's, else None; a bad one is a one-line error."""
    option, env, parse = BOUNDS[dest]
    given = getattr(args, dest)
    text = given if given is not None else os.environ.get(env)
    if text is None:
        return None
    return parse(text, option if given is not None else f"${env}={text!r}")


def _int_list(option: str, text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise KilnError(f"{option} {text!r}: expected positive integers separated by commas, e.g. 1,2,4") from None
    if not values or any(v < 1 for v in values):
        raise KilnError(f"{option} {text!r}: expected positive integers separated by commas, e.g. 1,2,4")
    return tuple(dict.fromkeys(values))


def _ids(text: str | None) -> list[str] | None:
    return [part.strip() for part in text.split(",") if part.strip()] if text else None


def _settings(args) -> BenchSettings:
    if args.runs < 1:
        raise KilnError(f"--runs {args.runs}: at least 1 (2 or more for CV and a verdict)")
    if args.warmup < 0:
        raise KilnError(f"--warmup {args.warmup}: cannot be negative")
    if args.battery_runs < 0:
        raise KilnError(f"--battery-runs {args.battery_runs}: cannot be negative")
    if not 0.5 <= args.confidence < 1.0:
        raise KilnError(f"--confidence {args.confidence}: a fraction between 0.5 and 1, e.g. 0.95")
    if args.max_tokens is not None and args.max_tokens < 1:
        raise KilnError(f"--max-tokens {args.max_tokens}: at least 1")
    if not 0 < args.timeout < math.inf:
        raise KilnError(f"--timeout {args.timeout:g}: seconds one request may take, more than 0")
    found = {dest: value for dest in BOUNDS if (value := _bound(args, dest)) is not None}
    run_timeout = found.pop("run_timeout", BenchSettings.run_timeout)
    bounds = replace(DEFAULT_BOUNDS, **found)
    extra = {}
    if args.extra_body:
        try:
            extra = json.loads(args.extra_body)
        except ValueError as err:
            raise KilnError(f"--extra-body: not JSON ({err})") from None
        if not isinstance(extra, dict):
            raise KilnError("--extra-body: must be a JSON object, e.g. '{\"ignore_eos\": true}'")
    return BenchSettings(runs=args.runs, warmup=args.warmup, concurrency=_int_list("--concurrency", args.concurrency),
                         prompts=select_prompts(_ids(args.prompts)), max_tokens=args.max_tokens,
                         temperature=args.temperature, extra_body=extra, unique_prefix=args.unique_prefix,
                         timeout=args.timeout, confidence=args.confidence, run_timeout=run_timeout, bounds=bounds)


def _fmt(value: float | None, metric: str) -> str:
    if value is None:
        return "-"
    if metric in ("ttft", "tpot"):
        return f"{value * 1000:.1f} ms"
    return f"{value:.1f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.1f}%"


def _speed_tables(out: Output, run, names: dict[str, str]) -> None:
    for concurrency in run.settings.concurrency:
        if len(run.labels) == 1:
            (label,) = run.labels
            table = Table(title=f"{names[label]} at concurrency {concurrency} "
                                f"({run.settings.runs} runs per prompt; mean / median / CV)")
            table.add_column("prompt")
            table.add_column("ok", justify="right")
            for metric in run.metrics(concurrency):
                table.add_column(f"{metric} ({METRICS[metric][0]})", justify="right")
            for prompt in run.rows():
                cells = []
                for metric in run.metrics(concurrency):
                    s = run.summary(label, concurrency, prompt, metric)
                    cells.append(f"{_fmt(s.mean, metric)} / {_fmt(s.median, metric)} / {_pct(s.cv)}")
                samples = run.measured(label, concurrency)
                ok = ("" if prompt == OVERALL else
                      f"{sum(s.result.ok for s in samples if s.prompt == prompt)}/"
                      f"{sum(1 for s in samples if s.prompt == prompt)}")
                table.add_row(prompt, ok, *cells)
            out.stdout.print(table)
            continue
        first, second = run.labels
        confidence = f"{run.settings.confidence * 100:g}%"
        table = Table(title=f"{names[first]} against {names[second]} at concurrency {concurrency} "
                            f"(mean, median, CV; Welch's t-test at {confidence})")
        for column in ("prompt", "metric", first, second, "change", f"{confidence} interval", "p", "verdict"):
            table.add_column(column, justify="left" if column in ("prompt", "metric", "verdict") else "right")
        for prompt in run.rows():
            for metric in run.metrics(concurrency):
                cells = []
                for label in (first, second):
                    s = run.summary(label, concurrency, prompt, metric)
                    cells.append(f"{_fmt(s.mean, metric)}  {_fmt(s.median, metric)}  {_pct(s.cv)}")
                c = run.compare(concurrency, prompt, metric)
                interval = "-" if c.change_low is None else f"{_pct(c.change_low)} .. {_pct(c.change_high)}"
                colour = VERDICT_COLOUR.get(c.verdict)
                shown = f"[{colour}]{c.verdict}[/]" if colour else c.verdict
                table.add_row(prompt, metric, *cells, _pct(c.change), interval,
                              "-" if c.p is None else f"{c.p:.3g}", shown)
            table.add_section()
        out.stdout.print(table)


def _battery_table(out: Output, battery, names: dict[str, str]) -> None:
    table = Table(title=f"tool-call battery {battery_cases.BATTERY_VERSION}: clean / attempts")
    table.add_column("case")
    table.add_column("aim")
    for label in battery.labels:
        table.add_column(names[label], justify="right")
    table.add_column("first problem", overflow="fold")
    for case in battery.cases:
        counts = []
        problem = ""
        for label in battery.labels:
            clean, total = battery.clean(label, case.id)
            colour = "green" if clean == total else "red"
            counts.append(f"[{colour}]{clean}/{total}[/]")
            dirty = next((j for j in battery.judgements(label, case.id) if not j.clean), None)
            if dirty and not problem:
                problem = f"{label}: {dirty.problems[0]}"
        # scrubbed before rich folds the cell: a secret split over two lines would pass the stream's scrubbing
        table.add_row(case.id, escape(case.aim), *counts, escape(scrub(problem)))
    totals = [f"{c}/{t}" for c, t in (battery.clean(label) for label in battery.labels)]
    table.add_section()
    table.add_row("all", "", *totals, "")
    out.stdout.print(table)


def _check_outputs(args) -> None:
    """``--evidence`` and ``--plot`` checked before any request (never an input of kiln's, a
    device or FIFO, or one path twice), each then resolved."""
    inputs = command_inputs(args)
    chosen = [(option, getattr(args, name)) for option, name in (("--evidence", "evidence"), ("--plot", "plot"))
              if getattr(args, name) is not None]
    for option, path in chosen:
        setattr(args, option.removeprefix("--"), check_output_path(path, option, False, inputs))
    check_distinct((option, getattr(args, option.removeprefix("--"))) for option, _ in chosen)


def run_bench(args, out: Output) -> int:
    settings = _settings(args)
    _check_outputs(args)
    cases = battery_cases.select_cases(_ids(args.cases))
    if args.plot is not None:
        if args.only == "battery":
            raise KilnError("--plot shows the speed samples: it cannot go with --only battery")
        from kiln.bench.plot import require_matplotlib

        require_matplotlib()  # fail before an hour of measuring, not after
    api_key = args.api_key or os.environ.get("KILN_BENCH_API_KEY")
    bounds = settings.bounds
    endpoints = {"A": connect(args.url, args.model, api_key, args.connect_timeout, bounds)}
    images = {"A": image_info(args.image) if args.image else None}
    if args.against:
        endpoints["B"] = connect(args.against, args.against_model, api_key, args.connect_timeout, bounds)
        images["B"] = image_info(args.against_image) if args.against_image else None
    elif args.against_image or args.against_model:
        raise KilnError("--against-image / --against-model need --against URL2")
    names = {label: f"{label} {e.url}" for label, e in endpoints.items()}
    if not out.json_mode:
        for label, e in endpoints.items():
            image = f", image {images[label].reference}" if images[label] else ""
            out.stderr.print(escape(scrub(f"{label}: {e.url} serves {quote(e.model, 120)} (vLLM "
                                          f"{e.server_version or 'version unknown'}{image}); prompt set "
                                          f"{PROMPT_SET_VERSION}")), soft_wrap=True)
    reporter = out.reporter()
    deadline = settings.deadline()  # one for the whole run: the speed part and the battery
    speed = run_speed(endpoints, settings, reporter, deadline) if args.only != "battery" else None
    battery = run_battery(endpoints, cases, args.battery_runs, settings, reporter, deadline) \
        if args.only != "speed" and args.battery_runs else None
    # what the servers sent is in the evidence: scrubbed of the key before it is written anywhere
    data = scrub_data(evidence(endpoints, images, settings, speed, battery, machine_info()))
    if args.evidence:
        args.evidence.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(args.evidence, (json.dumps(data, indent=2) + "\n").encode())
    if args.plot is not None and speed is not None:
        from kiln.bench.plot import write_plot

        write_plot(speed, args.plot, names)
    if out.json_mode:
        out.json(data)
    else:
        if speed is not None:
            _speed_tables(out, speed, names)
        if battery is not None:
            _battery_table(out, battery, names)
    failed = len(speed.failures()) if speed else 0
    dirty = battery.clean("A")[1] - battery.clean("A")[0] if battery else 0
    unsent = (speed.unsent if speed else 0) + (battery.unsent if battery else 0)
    if failed:
        out.warn(f"{failed} request(s) failed; the figures use the requests that completed")
    if dirty:
        out.warn(f"{dirty} tool call(s) of {args.url} were not clean")
    return 1 if failed or dirty or unsent else 0


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "bench", help="measure a served model: speed (TPS, TTFT, TPOT) and tool-call cleanliness",
        description="Measure an OpenAI-compatible endpoint (e.g. `vllm serve` of a kiln image), "
                    "optionally against a second one, with a verdict per metric. See docs/BENCH.md.")
    p.add_argument("url", help="the endpoint, e.g. http://127.0.0.1:8000 (a trailing /v1 is fine)")
    p.add_argument("--against", metavar="URL2", help="a second endpoint to compare with, interleaved")
    p.add_argument("--model", help="the model to ask URL for (default: the first GET /v1/models lists)")
    p.add_argument("--against-model", help="the model to ask URL2 for")
    p.add_argument("--api-key", help="bearer token (default: $KILN_BENCH_API_KEY)")
    p.add_argument("--image", metavar="REF", help="the image URL serves, recorded in the evidence (tag or @digest)")
    p.add_argument("--against-image", metavar="REF", help="the image URL2 serves")
    p.add_argument("--runs", type=int, default=5, help="measured runs per prompt and level (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured passes over the prompts first (default: %(default)s)")
    p.add_argument("--concurrency", default="1", help="concurrent requests, a sweep such as 1,2,4 (default: 1)")
    p.add_argument("--prompts", metavar="IDS", help="only these prompts of the set, comma-separated")
    p.add_argument("--max-tokens", type=int, help="completion cap for every prompt (default: each prompt's own)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default: %(default)s)")
    p.add_argument("--extra-body", metavar="JSON", help='merged into every request, e.g. \'{"ignore_eos": true}\'')
    p.add_argument("--unique-prefix", action="store_true", help="a fresh first line per request: no prefix-cache hits")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds one request may take, all of it: connecting, waiting and the whole stream "
                        "(default: %(default)s)")
    defaults = {"max_line": size_text(DEFAULT_BOUNDS.max_line), "max_body": size_text(DEFAULT_BOUNDS.max_body),
                "max_stream": size_text(DEFAULT_BOUNDS.max_stream),
                "run_timeout": f"{BenchSettings.run_timeout / 3600:g} h"}
    what = {"max_line": "one event-stream line or event", "max_body": "a JSON answer (the model list, an error)",
            "max_stream": "everything one streamed answer sends", "run_timeout": "the whole run (e.g. 2h, 90m)"}
    for dest, (option, env, parse) in BOUNDS.items():
        p.add_argument(option, dest=dest, metavar="TIME" if parse is parse_seconds else "SIZE",
                       help=f"bound on {what[dest]} (default {defaults[dest]}; ${env})")
    p.add_argument("--connect-timeout", type=float, default=10.0, help=argparse.SUPPRESS)
    p.add_argument("--confidence", type=float, default=0.95, help="of the verdicts (default: %(default)s)")
    p.add_argument("--battery-runs", type=int, default=3, help="attempts per tool-call case; 0 skips the battery")
    p.add_argument("--cases", metavar="IDS", help="only these tool-call cases, comma-separated")
    p.add_argument("--only", choices=("speed", "battery"), help="run only the speed part or only the battery")
    p.add_argument("--evidence", type=Path, metavar="FILE", help="also write the JSON evidence to FILE")
    p.add_argument("--plot", type=Path, metavar="FILE", help="PNG of the per-prompt distributions (needs matplotlib)")
    p.add_argument("--json", action="store_true", help="print the evidence (every raw sample) as JSON")
    add_progress_option(p)
    p.set_defaults(run=run_bench)
