"""``build.py verify``, ``diff`` and ``apply``: verdicts, the patched source as a diff or a tree."""

from __future__ import annotations

import sys
from pathlib import Path

from rich.markup import escape
from rich.table import Table

from kiln import verify as checks
from kiln.commands.options import (
    add_json_option,
    add_registry_options,
    add_source_options,
    command_inputs,
    registry_config,
    repo_files,
    sm_option,
)
from kiln.commands.output import styled
from kiln.definitions import load_definition
from kiln.errors import KilnError
from kiln.patch.catalog import load_catalogue
from kiln.patch.memo import SelectionMemo, VerdictMemo
from kiln.patch.outcome import Verdict
from kiln.patch.output import unified_diff
from kiln.patch.record import load_record
from kiln.patch.train import (
    TRAIN_RECORD,
    accepted_train_text,
    compare_with_record,
    is_release_range,
    releases_in,
    run_train,
)
from kiln.pins import load_pins
from kiln.publish.tree import TreePublisher
from kiln.source.wheel import WheelSource, list_releases
from kiln.staging import commit_all, write_atomic


def register(sub) -> None:
    p = sub.add_parser("verify", help="compute every patch's verdict on a pin and compare with the record")
    add_source_options(p, train=True)
    p.add_argument("--image", help="check that every patch this image selects can be built on its pins")
    p.add_argument("--sm", type=sm_option, help="also evaluate SM gates for this arch (e.g. 86)")
    p.add_argument("--accept", action="store_true", help="rewrite the record for this source")
    p.add_argument("--no-memo", action="store_true", help="recompute every verdict (ignore the verdict cache)")
    p.add_argument("--maintainer", action="store_true",
                   help="also say what to change in patchsets/ (a patch's written_for, its gates)")
    add_registry_options(p)  # a pin with no release wheel (a nightly) is read from its image
    add_json_option(p, "the verdicts as JSON")
    p.set_defaults(run=run_verify)

    p = sub.add_parser("diff", help="unified diff of the patched source")
    add_source_options(p)
    p.add_argument("--patch", action="append", metavar="ID", help="only these patches (and what they require)")
    p.add_argument("--sm", type=sm_option)
    add_registry_options(p)
    p.set_defaults(run=run_diff)

    p = sub.add_parser("apply", help="write the patched vllm/ tree and a JSON report")
    add_source_options(p)
    p.add_argument("--patch", action="append", metavar="ID", help="only these patches (and what they require)")
    p.add_argument("--sm", type=sm_option)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    add_registry_options(p)
    add_json_option(p, "the report as JSON")
    p.set_defaults(run=run_apply)


def run_verify(args, out) -> int:
    files = repo_files(args)
    catalogue = load_catalogue(files.patchsets)
    if args.image:
        if args.pin or args.vllm or args.accept:
            raise KilnError("verify --image takes no --pin/--vllm/--accept: it checks the image's own pins")
        pins = load_pins(files.pins)
        definition = load_definition(files.images, args.image, catalogue, pins)
        memo = None if args.no_memo else SelectionMemo()
        result = checks.verify_definition(definition, pins, catalogue, out.reporter(), registry_config(args), memo)
        _show_definition(args, out, result)
        return 1 if result.failures else 0
    if args.vllm and is_release_range(args.vllm):
        return _verify_train(args, out, catalogue, files)
    choice = checks.choose_source(files, args.pin, args.vllm, out.reporter(), registry_config(args))
    memo = None if args.no_memo else VerdictMemo()
    train = files.patchsets / TRAIN_RECORD if args.vllm else None  # a release the train covers
    result = checks.verify_source(catalogue, choice, files.record, args.sm, args.accept, memo, train)
    _show_source(args, out, catalogue, result)
    return 1 if result.differences else 0


def _verify_train(args, out, catalogue, files) -> int:
    """``verify --vllm FIRST..LAST``: the catalogue on every release of the range, compared
    with ``release-train.toml`` beside the catalogue (exit 1 on any difference)."""
    if args.sm is not None:
        raise KilnError("verify --vllm FIRST..LAST takes no --sm: the train is per release, not per arch")
    record_path = files.patchsets / TRAIN_RECORD
    load_record(record_path)  # a broken record fails before any download
    reporter = out.reporter()
    releases = releases_in(args.vllm, list_releases())
    memo = None if args.no_memo else VerdictMemo()
    matrix = run_train(catalogue, releases, lambda v: WheelSource(v, reporter=reporter), memo=memo, reporter=reporter)
    if args.accept:
        write_atomic(record_path, accepted_train_text(record_path, matrix).encode())
    differences = compare_with_record(matrix, record_path)
    if args.json:
        out.json({**matrix.to_json(),
                  "differences": {label: [d.__dict__ for d in diffs] for label, diffs in differences.items()}})
        return 1 if differences else 0
    table = Table(title=f"verdicts on {len(matrix.labels)} releases ({args.vllm})")
    table.add_column("patch")
    for label in matrix.labels:
        table.add_column(label.removeprefix("vllm-"), no_wrap=True)
    for pid in matrix.patch_ids:
        cells = []
        for label in matrix.labels:
            verdict = matrix.verdict(pid, label)
            mark = "≠" if any(d.patch_id == pid for d in differences.get(label, [])) else ""
            cells.append(f"{styled(verdict, SHORT[verdict]) if verdict else '[red]-[/]'}{mark}")
        table.add_row(pid, *cells)
    out.stdout.print(table)
    out.stdout.print("  ".join(f"{short} = {verdict}" for verdict, short in SHORT.items()))
    for label, diffs in differences.items():
        out.stderr.print(
            f"[red]{label}: {len(diffs)} verdict(s) differ from {escape(str(record_path))}[/]: "
            + escape(", ".join(f"{d.patch_id} {d.expected or 'unrecorded'} -> {d.actual or 'removed'}" for d in diffs)))
    if not differences:
        out.stdout.print(f"{len(matrix.patch_ids)} patches x {len(matrix.labels)} releases: equal to {record_path}")
    return 1 if differences else 0


# One letter a verdict, so a row of 18 releases fits a terminal.
SHORT = {str(v): v.letter for v in Verdict}


def _show_source(args, out, catalogue, result: checks.SourceVerdicts) -> None:
    choice, record = result.choice, result.record
    if args.json:
        out.json({
            "source": choice.label, "vllm_version": str(choice.version), "origin": result.origin,
            "record": str(record),
            "patches": [{**o.to_json(), "family": catalogue.get(pid).family, "expected": result.expected.get(pid, "")}
                        for pid, o in result.outcomes.items()],
            "counts": result.counts(),
            "differences": [d.__dict__ for d in result.differences],
        })
        return
    different = {d.patch_id for d in result.differences}
    table = Table(title=f"verdicts on {choice.label} ({result.origin})")
    for column in ("patch", "family", "verdict", "recorded", "detail"):
        table.add_column(column, overflow="fold")
    for pid, outcome in result.outcomes.items():
        recorded = result.expected.get(pid, "unrecorded")
        mark = f"[red]{recorded} ≠[/]" if pid in different else recorded
        table.add_row(pid, catalogue.get(pid).family, styled(outcome.verdict), mark, escape(outcome.detail))
    out.stdout.print(table)
    note = checks.out_of_range_note(result.outcomes.values(), choice.label, args.maintainer)
    if note:
        out.stdout.print(escape(note))
    summary = ", ".join(f"{n} {v}" for v, n in result.counts().items())
    if not result.differences:
        which = "the release train" if record.name == TRAIN_RECORD else "the record"
        out.stdout.print(f"{len(result.outcomes)} patches on {escape(choice.label)}: {summary}; equal to {which}")
        return
    out.stdout.print(f"{len(result.outcomes)} patches on {escape(choice.label)}: {summary}")
    out.stderr.print(
        f"[red]{len(result.differences)} verdict(s) differ from {escape(str(record))} ({escape(choice.label)})[/]: "
        + escape(", ".join(f"{d.patch_id} {d.expected or 'unrecorded'} -> {d.actual or 'removed'}"
                           for d in result.differences))
        + " (review, then `verify --accept`)"
    )


def _show_definition(args, out, result: checks.DefinitionVerdicts) -> None:
    definition = result.definition
    rows = [{"pin": pin.name, **outcome.to_json()} for pin, outcome in result.rows]
    if args.json:
        out.json({"image": definition.name, "patches": rows, "failures": result.failures})
        return
    table = Table(title=f"image {definition.name}: {len(definition.patches)} patches x {len(result.pins)} pin(s)")
    for column in ("pin", "patch", "verdict", "detail"):
        table.add_column(column, overflow="fold")
    for row in rows:
        table.add_row(row["pin"], row["patch"], styled(row["verdict"]), escape(row["detail"]))
    out.stdout.print(table)
    for pin in result.pins:
        note = checks.out_of_range_note((o for p, o in result.rows if p is pin), pin.name, args.maintainer)
        if note:
            out.stdout.print(escape(note))
    if result.failures:
        out.stderr.print(f"[red]{escape(str(definition.path))}: {len(result.failures)} selected patch(es) cannot be "
                         "built:[/] " + escape("; ".join(result.failures)))
    else:
        left_out = sum(1 for _, o in result.rows if not o.verdict.ok)
        out.stdout.print(f"image {escape(definition.name)} builds on {', '.join(p.name for p in result.pins)}"
                         + (f" ({left_out} patch verdict(s) leave a patch out: UPSTREAM, GATED or OUT_OF_RANGE)" if left_out else ""))


def run_diff(args, out) -> int:
    files = repo_files(args)
    catalogue = load_catalogue(files.patchsets)
    choice = checks.choose_source(files, args.pin, args.vllm, out.reporter(), registry_config(args))
    tree, result = checks.patch_selection(catalogue, choice, args.patch, args.sm)
    sys.stdout.write(unified_diff(tree, result))
    return 0


def run_apply(args, out) -> int:
    files = repo_files(args)
    publisher = TreePublisher(args.out, args.force)
    publisher.check(command_inputs(args))  # before any work: a taken --out fails now, not after the patching
    catalogue = load_catalogue(files.patchsets)
    choice = checks.choose_source(files, args.pin, args.vllm, out.reporter(), registry_config(args))
    tree, result = checks.patch_selection(catalogue, choice, args.patch, args.sm)
    commit_all([publisher.stage(tree, choice.label, result)])
    data = publisher.report
    if args.json:
        out.json(data)
        return 0
    applied = [p["patch"] for p in data["patches"] if p["verdict"] == Verdict.APPLIES]
    out.stdout.print(escape(
        f"wrote {publisher.path}: {len(data['files'])} file(s) changed by {', '.join(applied) or 'no patch'}; "
        f"report in {publisher.path / 'kiln-report.json'}"))
    return 0
