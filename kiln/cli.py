"""``python build.py <command>``: the kiln command line.

Every command returns an exit code; a ``KilnError`` anywhere becomes one line on stderr and
exit code 2, with nothing half-written (outputs are staged and renamed at the end).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from packaging.version import InvalidVersion, Version
from rich.markup import escape
from rich.table import Table

from kiln import paths, ui
from kiln.build import add_build_parser
from kiln.commands import bench as bench_command
from kiln.commands.output import Output
from kiln.context import add_context_parser
from kiln.errors import KilnError
from kiln.helm import add_values_parser
from kiln.images import image_pins, load_image
from kiln.patch.catalog import Catalogue, load_catalogue
from kiln.patch.engine import Session, run_isolated, run_selection
from kiln.patch.memo import VerdictMemo
from kiln.patch.model import BuildTarget, Outcome, Verdict
from kiln.patch.output import unified_diff, write_tree
from kiln.patch.record import accept, compare, load_record
from kiln.pinlock import add_pin_parser
from kiln.pins import get_pin, load_pins
from kiln.plan import add_plan_parser
from kiln.source.tree import SourceProvider
from kiln.source.wheel import WheelSource

VERDICT_STYLE = {
    Verdict.APPLIES: "green",
    Verdict.ALREADY_PATCHED: "green",
    Verdict.UPSTREAM: "cyan",
    Verdict.GATED: "yellow",
    Verdict.DRIFTED: "red",
    Verdict.TARGET_GONE: "red",
    Verdict.CONFLICT: "red",
}


@dataclass
class SourceChoice:
    label: str  # key in the verdict record: the pin name, or vllm-X for a candidate
    version: Version
    provider: SourceProvider


def _source(args) -> SourceChoice:
    if getattr(args, "vllm", None):
        try:
            version = Version(args.vllm)
        except InvalidVersion:
            raise KilnError(f"--vllm {args.vllm!r} is not a version") from None
        return SourceChoice(f"vllm-{version}", version, WheelSource(version))
    if not getattr(args, "pin", None):
        raise KilnError("say which source: --pin NAME (from pins.toml) or --vllm VERSION")
    pin = get_pin(load_pins(args.pins), args.pin, args.pins)
    return SourceChoice(pin.name, pin.vllm, WheelSource(pin.vllm))


def _selection(catalogue: Catalogue, ids: list[str] | None) -> list[str]:
    if not ids:
        return catalogue.default_selection()
    for pid in ids:
        catalogue.get(pid)  # unknown id -> error naming it
    return list(dict.fromkeys(ids))


def _target(args, version: Version) -> BuildTarget:
    return BuildTarget(vllm_version=version, sm=getattr(args, "sm", None))


# ---------------------------------------------------------------- commands


def cmd_patches(args) -> int:
    catalogue = load_catalogue(args.patchsets)
    rows = []
    for patch in catalogue.patches.values():
        rows.append(
            {
                "id": patch.id,
                "family": patch.family,
                "title": patch.title,
                "targets": list(patch.targets),
                "gates": patch.gates.describe(),
                "requires": list(patch.requires),
                "conflicts": list(patch.conflicts),
                "upstream_refs": list(patch.upstream_refs),
                "variant": patch.variant,
                "perf_critical": patch.perf_critical,
            }
        )
    if args.json:
        print(json.dumps({"patches": rows}, indent=2))
        return 0
    table = Table(title=f"kiln patch catalogue ({len(rows)} patches)")
    for column in ("id", "family", "title", "gates", "requires / conflicts"):
        table.add_column(column)
    for row in rows:
        rel = " ".join([*(f"+{r}" for r in row["requires"]), *(f"!{c}" for c in row["conflicts"])])
        title = row["title"] + (" (variant)" if row["variant"] else "")
        table.add_row(row["id"], row["family"], escape(title), escape(row["gates"]), rel or "-")
    ui.stdout.print(table)
    return 0


def cmd_verify(args) -> int:
    catalogue = load_catalogue(args.patchsets)
    if args.image:
        return _verify_image(args, catalogue)
    choice = _source(args)
    tree = choice.provider.fetch()
    session = Session(tree)
    memo = None if args.no_memo else VerdictMemo()
    outcomes = run_isolated(catalogue, session, _target(args, choice.version), list(catalogue.patches), memo)
    record = load_record(args.record)
    expected = record.get(choice.label, {})
    if args.accept:
        accept(args.record, choice.label, outcomes)
        expected = {pid: str(o.verdict) for pid, o in outcomes.items()}
    differences = compare(expected, outcomes)
    _print_verdicts(args, choice, tree.origin, catalogue, outcomes, expected, differences)
    if differences:
        if not args.json:
            ui.stderr.print(
                f"[red]{len(differences)} verdict(s) differ from {escape(str(args.record))} ({choice.label})[/]: "
                + ", ".join(f"{d.patch_id} {d.expected or 'unrecorded'} -> {d.actual or 'removed'}" for d in differences)
                + " (review, then `verify --accept`)"
            )
        return 1
    return 0


def _verify_image(args, catalogue: Catalogue) -> int:
    """Every patch the image selects must APPLY on each of its pins (cumulatively, as built)."""
    if args.pin or args.vllm or args.accept:
        raise KilnError("verify --image takes no --pin/--vllm/--accept: it checks the image's own pins")
    pins = load_pins(args.pins)
    image = load_image(args.images, args.image, catalogue, pins)
    failures: list[str] = []
    report = []
    for pin in image_pins(image, pins):
        tree = WheelSource(pin.vllm).fetch()
        result = run_selection(catalogue, Session(tree), image.target(pin), list(image.patches))
        for pid, outcome in result.outcomes.items():
            report.append({"pin": pin.name, **outcome.to_json()})
            if outcome.verdict is not Verdict.APPLIES:
                failures.append(f"{pid} on {pin.name}: {outcome.verdict} {outcome.detail}".strip())
    if args.json:
        print(json.dumps({"image": image.name, "patches": report, "failures": failures}, indent=2))
    else:
        table = Table(title=f"image {image.name}: {len(image.patches)} patches x {len(image_pins(image, pins))} pin(s)")
        for column in ("pin", "patch", "verdict", "detail"):
            table.add_column(column, overflow="fold")
        for row in report:
            style = VERDICT_STYLE[Verdict(row["verdict"])]
            table.add_row(row["pin"], row["patch"], f"[{style}]{row['verdict']}[/]", escape(row["detail"]))
        ui.stdout.print(table)
        if failures:
            ui.stderr.print(f"[red]{image.path}: {len(failures)} selected patch(es) do not apply:[/] " + escape("; ".join(failures)))
    return 1 if failures else 0


def _print_verdicts(args, choice, origin, catalogue, outcomes: dict[str, Outcome], expected, differences) -> None:
    if args.json:
        payload = {
            "source": choice.label,
            "vllm_version": str(choice.version),
            "origin": origin,
            "patches": [
                {
                    **o.to_json(),
                    "family": catalogue.get(pid).family,
                    "expected": expected.get(pid, ""),
                }
                for pid, o in outcomes.items()
            ],
            "differences": [d.__dict__ for d in differences],
        }
        print(json.dumps(payload, indent=2))
        return
    different = {d.patch_id for d in differences}
    table = Table(title=f"verdicts on {choice.label} ({origin})")
    for column in ("patch", "family", "verdict", "recorded", "detail"):
        table.add_column(column, overflow="fold")
    for pid, outcome in outcomes.items():
        style = VERDICT_STYLE[outcome.verdict]
        recorded = expected.get(pid, "unrecorded")
        mark = f"[red]{recorded} ≠[/]" if pid in different else recorded
        table.add_row(pid, catalogue.get(pid).family, f"[{style}]{outcome.verdict}[/]", mark, escape(outcome.detail))
    ui.stdout.print(table)


def _run_selection(args):
    catalogue = load_catalogue(args.patchsets)
    ids = _selection(catalogue, args.patch)
    choice = _source(args)
    tree = choice.provider.fetch()
    result = run_selection(catalogue, Session(tree), _target(args, choice.version), ids)
    conflicts = [o for o in result.outcomes.values() if o.verdict is Verdict.CONFLICT]
    if conflicts:
        raise KilnError(f"patch {conflicts[0].patch_id}: {conflicts[0].detail}")
    broken = [o for o in result.outcomes.values() if o.verdict in (Verdict.DRIFTED, Verdict.TARGET_GONE)]
    if broken:
        o = broken[0]
        raise KilnError(
            f"patch {o.patch_id} is {o.verdict} on {choice.label}: {o.detail} "
            "(re-anchor it, or leave it out with --patch)"
        )
    return tree, choice, result


def cmd_diff(args) -> int:
    tree, _, result = _run_selection(args)
    sys.stdout.write(unified_diff(tree, result))
    return 0


def cmd_apply(args) -> int:
    tree, choice, result = _run_selection(args)
    data = write_tree(tree, choice.label, result, args.out, args.force)
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        applied = [p["patch"] for p in data["patches"] if p["verdict"] == Verdict.APPLIES]
        ui.stdout.print(
            f"wrote {args.out}: {len(data['files'])} file(s) changed by {', '.join(applied) or 'no patch'}; "
            f"report in {args.out / 'kiln-report.json'}"
        )
    return 0


# ---------------------------------------------------------------- parser


def _add_source_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--pin", help="a pin from pins.toml, e.g. v0.20.1")
    group.add_argument("--vllm", help="an unpinned vLLM release as a candidate, e.g. 0.33.0")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="build.py", description="kiln: build-time patched vLLM images")
    parser.add_argument("--pins", type=Path, default=paths.PINS, help="pins file (default: %(default)s)")
    parser.add_argument("--patchsets", type=Path, default=paths.PATCHSETS, help="patch catalogue directory")
    parser.add_argument("--record", type=Path, default=paths.RECORD, help="expected-verdict record")
    parser.add_argument("--images", type=Path, default=paths.IMAGES, help="image definitions directory")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("patches", help="list the patch catalogue")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_patches)

    p = sub.add_parser("verify", help="compute every patch's verdict on a pin and compare with the record")
    _add_source_args(p)
    p.add_argument("--image", help="check that every patch this image selects applies on its pins")
    p.add_argument("--sm", type=int, help="also evaluate SM gates for this arch (e.g. 86)")
    p.add_argument("--accept", action="store_true", help="rewrite the record for this source")
    p.add_argument("--no-memo", action="store_true", help="recompute every verdict (ignore the verdict cache)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("diff", help="unified diff of the patched source")
    _add_source_args(p)
    p.add_argument("--patch", action="append", metavar="ID", help="only these patches (and what they require)")
    p.add_argument("--sm", type=int)
    p.set_defaults(func=cmd_diff)

    p = sub.add_parser("apply", help="write the patched vllm/ tree and a JSON report")
    _add_source_args(p)
    p.add_argument("--patch", action="append", metavar="ID", help="only these patches (and what they require)")
    p.add_argument("--sm", type=int)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_apply)
    add_build_parser(sub)
    add_context_parser(sub)
    add_pin_parser(sub)
    add_plan_parser(sub)
    add_values_parser(sub)
    bench_command.register(sub)  # the commands package's first command (kiln/commands/)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    ui.set_quiet(bool(getattr(args, "json", False)))
    try:
        if hasattr(args, "run"):  # a kiln/commands/ command: run(args, out)
            return args.run(args, Output(json_mode=bool(getattr(args, "json", False))))
        return args.func(args)
    except KilnError as err:
        ui.stderr.print(f"[red]error:[/] {escape(str(err))}", soft_wrap=True, highlight=False)
        return 2
    except KeyboardInterrupt:
        ui.stderr.print("interrupted")
        return 130
