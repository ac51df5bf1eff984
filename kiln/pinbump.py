"""``build.py pin bump --to REF``: move the pins to a new vLLM, after a preflight.

The maintainers' loop: a release (``0.33.0``) or an image (``docker.io/vllm/vllm-openai:v0.33.0``)
appears. Every patch of the catalogue is evaluated on the current pin's pristine source and on
the candidate's (isolated mode, as ``verify`` does) and the report says what the bump changes:
newly ``UPSTREAM`` (retire the patch), ``DRIFTED`` / ``TARGET_GONE`` (re-anchor it), and the
*retire impact*: patches whose ``requires`` stops applying, and ``perf_critical`` patches that
stop applying. Every image definition is also run as it would be built on the candidate. The
preflight fails (exit 1) on any retire impact, on an image built on every pin that would break,
and on an image that names the pin the bump would drop.

``--write`` then rotates the pins (current -> rollback, the old rollback dropped, the candidate
added as ``current`` with its digest locked) and records the candidate's verdicts under the new
pin's name in the verdict record (the dropped pin's table removed): both files are staged,
checked by reading them back, and renamed together, or neither is.

Public API:
    Candidate                      the pin a bump adds, with the pristine tree it was judged on
    resolve_candidate(ref, current, config, name=None, cuda=None) -> Candidate
    run_preflight(catalogue, images, current, old_tree, candidate, memo=None) -> Preflight
    Preflight                      .rows, .retire, .reanchor, .requires_impact, .perf_lost,
                                   .images, .failures, .blockers, .to_json()
    rotated_pins_text(text, path, current, rollback, candidate) -> str
    write_bump(pins_path, record_path, preflight, rollback) -> None   both files, or neither
    add_bump_parser(pin_subparsers)
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import tomlkit
from packaging.version import InvalidVersion, Version
from rich.markup import escape
from rich.table import Table

from kiln import ui
from kiln.errors import KilnError
from kiln.images import ImageDefinition, load_image
from kiln.oci.endpoints import RegistryConfig, add_registry_options, config_from_options
from kiln.oci.pull import ImageSource
from kiln.oci.reference import ImageReference, parse_reference
from kiln.patch.catalog import Catalogue, load_catalogue
from kiln.patch.engine import Session, run_isolated, run_selection
from kiln.patch.memo import VerdictMemo
from kiln.patch.model import BuildTarget, Outcome, Verdict
from kiln.patch.record import accepted_text, load_record
from kiln.pinlock import resolve_pin
from kiln.pins import _CUDA, Pin, load_pins
from kiln.source.tree import SourceTree
from kiln.source.wheel import WheelSource

RELEASE_IMAGE = "docker.io/vllm/vllm-openai:v{version}"  # where vLLM publishes a release's image
_PIN_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")  # used in image tags
_BROKEN = (Verdict.DRIFTED, Verdict.TARGET_GONE, Verdict.CONFLICT)  # what `build` refuses


# -- the candidate ------------------------------------------------------------------------------


@dataclass
class Candidate:
    ref: str  # what --to said
    name: str  # the new pin's name, e.g. "v0.33.0"
    image: str  # the new pin's image reference
    vllm: Version  # from the wheel's version, or the image's dist-info
    cuda: str
    digest: str  # "" when the image could not be resolved (release REF only)
    digest_note: str  # how the digest was obtained, or why it was not
    tree: SourceTree
    from_image: bool  # True: --to named an image, and sources are read from images

    def pin(self) -> Pin:
        return Pin(self.name, "current", self.image, self.vllm, self.cuda, self.digest)

    def to_json(self) -> dict:
        return {"ref": self.ref, "name": self.name, "image": self.image, "vllm": str(self.vllm),
                "cuda": self.cuda, "digest": self.digest or None, "digest_note": self.digest_note,
                "source": self.tree.origin}


def release_version(ref: str) -> Version | None:
    """``0.33.0`` / ``v0.33.0`` is a release; anything with a registry path is an image."""
    if any(c in ref for c in "/:@"):
        return None
    try:
        return Version(ref)
    except InvalidVersion:
        return None


def _check_name(name: str, current: Pin, pins: dict[str, Pin], path: Path) -> str:
    if not _PIN_NAME.match(name):
        raise KilnError(f"--name {name!r}: a pin name is used in image tags (letters, digits, '_', '.', '-')")
    if name in pins:
        what = "the current pin" if name == current.name else "a pin"
        raise KilnError(f"pin {name!r} is already {what} in {path}; bump to another release/image or pass --name")
    return name


def resolve_candidate(ref: str, current: Pin, pins: dict[str, Pin], pins_path: Path, config: RegistryConfig,
                      name: str | None = None, cuda: str | None = None) -> Candidate:
    """Fetch the candidate's pristine source and decide the new pin's fields."""
    if cuda is not None and not _CUDA.match(cuda):
        raise KilnError(f"--cuda {cuda!r} is not like 'cu130'")
    cuda = cuda or current.cuda
    version = release_version(ref)
    if version is not None:
        name = _check_name(name or f"v{version}", current, pins, pins_path)
        try:
            tree = WheelSource(version).fetch()
        except KilnError as err:
            raise KilnError(f"--to {ref}: {err}") from None
        image = RELEASE_IMAGE.format(version=version)
        try:
            digest = resolve_pin(Pin(name, "current", image, version, cuda, ""), config)
            note = f"resolved {image}"
        except KilnError as err:
            digest, note = "", f"not locked ({err}); run `build.py pin lock {name}` once it is reachable"
        return Candidate(ref, name, image, version, cuda, digest, note, tree, from_image=False)

    reference = parse_reference(ref)
    if name is not None:
        _check_name(name, current, pins, pins_path)
    try:
        found = ImageSource(reference, registry_config=config).pull()
    except KilnError as err:
        raise KilnError(f"--to {ref}: {err}") from None
    version = found.tree.vllm_version
    default = reference.tag if reference.tag and reference.tag != "latest" else f"v{version}".replace("+", "-")
    name = _check_name(name or default, current, pins, pins_path)
    return Candidate(ref, name, str(reference), version, cuda, found.digest, f"resolved {reference}",
                     found.tree, from_image=True)


def old_pin_tree(current: Pin, candidate: Candidate, config: RegistryConfig) -> SourceTree:
    """The current pin's pristine source, read the way the candidate's was (wheel or image)."""
    try:
        if not candidate.from_image:
            return WheelSource(current.vllm).fetch()
        reference: ImageReference = parse_reference(current.image)
        if current.digest:
            reference = reference.pinned(current.digest)
        return ImageSource(reference, expected_version=current.vllm, registry_config=config).fetch()
    except KilnError as err:
        raise KilnError(f"pin {current.name}: {err}") from None


# -- the preflight ------------------------------------------------------------------------------


@dataclass
class PatchRow:
    patch: str
    family: str
    perf_critical: bool
    old: Outcome
    new: Outcome
    action: str  # keep | new | retire | retired | re-anchor | blocked | gated | -

    def to_json(self) -> dict:
        return {"patch": self.patch, "family": self.family, "perf_critical": self.perf_critical,
                "old": str(self.old.verdict), "old_detail": self.old.detail,
                "new": str(self.new.verdict), "new_detail": self.new.detail, "action": self.action}


@dataclass
class ImageImpact:
    image: str
    path: str
    pins: list[str]  # [] = built on every pin, so on the candidate too
    broken: list[Outcome]  # selected patches `build` would refuse on the candidate
    retired: list[Outcome]  # selected patches the build would leave out (UPSTREAM, GATED)
    names_dropped_pin: str  # the dropped rollback pin when the image lists it, else ""

    @property
    def builds_on_candidate(self) -> bool:
        return not self.pins

    def to_json(self) -> dict:
        return {"image": self.image, "path": self.path, "pins": self.pins,
                "builds_on_candidate": self.builds_on_candidate,
                "broken": [o.to_json() for o in self.broken], "retired": [o.to_json() for o in self.retired],
                "names_dropped_pin": self.names_dropped_pin or None}


@dataclass
class Preflight:
    current: Pin
    rollback: Pin | None  # dropped by --write
    candidate: Candidate
    old_origin: str
    rows: list[PatchRow]
    requires_impact: list[dict]  # {"patch", "requires", "verdict"}
    perf_lost: list[PatchRow]
    images: list[ImageImpact]
    failures: list[str] = field(default_factory=list)  # the preflight fails; --force writes anyway
    blockers: list[str] = field(default_factory=list)  # --write refuses even with --force

    @property
    def ok(self) -> bool:
        return not self.failures and not self.blockers

    @property
    def retire(self) -> list[str]:
        return [r.patch for r in self.rows if r.action == "retire"]

    @property
    def reanchor(self) -> list[str]:
        return [r.patch for r in self.rows if r.action == "re-anchor"]

    @property
    def new_outcomes(self) -> dict[str, Outcome]:
        return {r.patch: r.new for r in self.rows}

    def to_json(self) -> dict:
        return {
            "from": {"pin": self.current.name, "image": self.current.image, "vllm": str(self.current.vllm),
                     "digest": self.current.digest or None, "source": self.old_origin},
            "to": self.candidate.to_json(),
            "drops": self.rollback.name if self.rollback else None,
            "patches": [r.to_json() for r in self.rows],
            "retire": self.retire,
            "reanchor": self.reanchor,
            "requires_impact": self.requires_impact,
            "perf_critical_lost": [{"patch": r.patch, "verdict": str(r.new.verdict)} for r in self.perf_lost],
            "images": [i.to_json() for i in self.images],
            "failures": self.failures,
            "blockers": self.blockers,
            "ok": self.ok,
        }


def _action(old: Outcome, new: Outcome, requires_broken: bool) -> str:
    if new.verdict.ok:
        return "keep" if old.verdict.ok else "new"
    if new.verdict is Verdict.UPSTREAM:
        return "retired" if old.verdict is Verdict.UPSTREAM else "retire"
    if new.verdict in (Verdict.DRIFTED, Verdict.TARGET_GONE):
        return "re-anchor"
    if new.verdict is Verdict.GATED:
        return "blocked" if requires_broken else "gated"
    return "-"


def load_images(images_dir: Path, catalogue: Catalogue, pins: dict[str, Pin]) -> list[ImageDefinition]:
    return [load_image(images_dir, p.stem, catalogue, pins) for p in sorted(images_dir.glob("*.toml"))]


def run_preflight(catalogue: Catalogue, images: list[ImageDefinition], current: Pin, rollback: Pin | None,
                  old_tree: SourceTree, candidate: Candidate, memo: VerdictMemo | None = None) -> Preflight:
    ids = list(catalogue.patches)
    old = run_isolated(catalogue, Session(old_tree), BuildTarget(current.vllm), ids, memo)
    session = Session(candidate.tree)
    new = run_isolated(catalogue, session, BuildTarget(candidate.vllm), ids, memo)

    requires_impact: list[dict] = []
    rows: list[PatchRow] = []
    for pid in ids:
        patch = catalogue.get(pid)
        lost_deps = [dep for dep in patch.requires if old[dep].verdict.ok and not new[dep].verdict.ok]
        if lost_deps and old[pid].verdict.ok:
            for dep in lost_deps:
                requires_impact.append({"patch": pid, "requires": dep, "verdict": str(new[dep].verdict)})
        rows.append(PatchRow(pid, patch.family, patch.perf_critical, old[pid], new[pid],
                             _action(old[pid], new[pid], bool(lost_deps))))
    perf_lost = [r for r in rows if r.perf_critical and r.old.verdict.ok and not r.new.verdict.ok]

    impacts: list[ImageImpact] = []
    for image in images:
        result = run_selection(catalogue, session, image.target(candidate.pin()), list(image.patches))
        selected = [result.outcomes[pid] for pid in image.patches]
        dropped = rollback.name if rollback and rollback.name in image.pins else ""
        impacts.append(ImageImpact(image.name, str(image.path), list(image.pins),
                                   [o for o in selected if o.verdict in _BROKEN],
                                   [o for o in selected if o.verdict in (Verdict.UPSTREAM, Verdict.GATED)],
                                   dropped))

    pre = Preflight(current, rollback, candidate, old_tree.origin, rows, requires_impact, perf_lost, impacts)
    for r in perf_lost:
        pre.failures.append(f"{r.patch} is perf_critical and stops applying ({r.new.verdict})")
    for item in requires_impact:
        pre.failures.append(f"{item['patch']} requires {item['requires']}, which is {item['verdict']} on "
                            f"{candidate.name}: {item['patch']} no longer applies")
    for impact in impacts:
        if impact.builds_on_candidate and impact.broken:
            pre.failures.append(f"image {impact.image} builds on every pin and would fail on {candidate.name}: "
                                + ", ".join(f"{o.patch_id} {o.verdict}" for o in impact.broken))
        if impact.names_dropped_pin:
            pre.blockers.append(f"{impact.path}: pins lists {impact.names_dropped_pin!r}, which this bump drops "
                                "(edit the image first)")
    return pre


# -- writing ------------------------------------------------------------------------------------

_TABLE_HEADER = re.compile(r"^\s*\[(?!\[)")


@dataclass
class _Segment:
    """One ``[pins."NAME"]`` table of the file as lines: its comment block, the table, what follows."""

    name: str
    lead: list[str]  # comment lines directly above the header: they describe this pin
    table: list[str]  # header through the last key line
    free: list[str]  # blank lines and comments after it that do not lead the next table


def _split_lead(lines: list[str], first: bool) -> tuple[list[str], list[str]]:
    """(rest, lead): ``lead`` is the run of comment lines at the end of ``lines``.

    Above the first table, a comment block with no blank line above it is the file's header,
    not the pin's.
    """
    cut = len(lines)
    while cut > 0 and lines[cut - 1].lstrip().startswith("#"):
        cut -= 1
    if first and (cut == 0 or lines[cut - 1].strip()):
        return lines, []
    return lines[:cut], lines[cut:]


def _segments(text: str, path: Path) -> tuple[list[str], list[_Segment]]:
    lines = text.splitlines(keepends=True)
    starts = [i for i, line in enumerate(lines) if _TABLE_HEADER.match(line)]
    unsupported = KilnError(f"{path}: pin bump rewrites files laid out as one [pins.\"NAME\"] table per pin")
    if not starts:
        raise unsupported
    preamble = lines[: starts[0]]
    segments: list[_Segment] = []
    for index, start in enumerate(starts):
        end = starts[index + 1] if index + 1 < len(starts) else len(lines)
        try:
            header = tomllib.loads(lines[start])
        except tomllib.TOMLDecodeError:
            raise unsupported from None
        names = list(header.get("pins", {}))
        if set(header) != {"pins"} or len(names) != 1:
            raise unsupported
        body = lines[start:end]
        last = max(i for i, line in enumerate(body) if i == 0 or (line.strip() and not line.lstrip().startswith("#")))
        segments.append(_Segment(names[0], [], body[: last + 1], body[last + 1 :]))
    preamble, segments[0].lead = _split_lead(preamble, first=True)
    for before, after in zip(segments, segments[1:], strict=False):
        before.free, after.lead = _split_lead(before.free, first=False)
    return preamble, segments


def rotated_pins_text(text: str, path: Path, current: Pin, rollback: Pin | None, candidate: Candidate) -> str:
    """``pins.toml`` after the bump, every other line kept as it was.

    The dropped rollback pin leaves with the comment block directly above it; the candidate's
    table goes directly above the old current pin's, which becomes the rollback.
    """
    preamble, segments = _segments(text, path)
    table = tomlkit.table()
    for key, value in (("role", "current"), ("image", candidate.image), ("vllm", str(candidate.vllm)),
                       ("cuda", candidate.cuda), ("digest", candidate.digest)):
        table.add(key, value)
    outer = tomlkit.table(is_super_table=True)
    outer.add(candidate.name, table)
    new_block = tomlkit.dumps({"pins": outer}).lstrip("\n")
    out: list[str] = list(preamble)
    for segment in segments:
        if rollback is not None and segment.name == rollback.name:
            free = list(segment.free)
            while free and not free[0].strip() and (not out or not out[-1].strip()):
                free.pop(0)  # no second blank line where the dropped table was
            out += free
            continue
        if segment.name == current.name:
            if out and out[-1].strip():
                out.append("\n")
            out += [new_block, "\n"]
        out += segment.lead + segment.table + segment.free
    document = tomlkit.parse("".join(out))
    document["pins"][current.name]["role"] = "rollback"
    return tomlkit.dumps(document)


def _expected_pins(text: str, current: Pin, rollback: Pin | None, candidate: Candidate) -> dict:
    pins = tomllib.loads(text)["pins"]
    if rollback is not None:
        del pins[rollback.name]
    pins[current.name]["role"] = "rollback"
    pins[candidate.name] = {"role": "current", "image": candidate.image, "vllm": str(candidate.vllm),
                            "cuda": candidate.cuda, "digest": candidate.digest}
    return pins


def commit_files(files: dict[Path, tuple[str, Callable[[Path], None]]]) -> None:
    """Write every file, or none: stage each beside its target, check it, then rename all.

    ``check`` reads the staged file back and raises when it is not what was meant. A failed
    rename puts the files already replaced back as they were.
    """
    staged: list[tuple[Path, Path]] = []
    try:
        for path, (text, check) in files.items():
            target = path.resolve()
            fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
            staged.append((target, Path(tmp)))
            with os.fdopen(fd, "w") as handle:
                handle.write(text)
                handle.flush()
                os.fsync(handle.fileno())
            if target.exists():
                os.chmod(tmp, target.stat().st_mode & 0o7777)
            check(Path(tmp))
        originals = {target: target.read_bytes() if target.exists() else None for target, _ in staged}
        replaced: list[Path] = []
        try:
            for target, tmp in staged:
                os.replace(tmp, target)
                replaced.append(target)
        except BaseException:
            for target in replaced:
                previous = originals[target]
                if previous is None:
                    target.unlink(missing_ok=True)
                else:
                    target.write_bytes(previous)
            raise
    finally:
        for _, tmp in staged:
            tmp.unlink(missing_ok=True)


def write_bump(pins_path: Path, record_path: Path, pre: Preflight) -> None:
    """Rotate the pins and record the candidate's verdicts: both files, or neither."""
    candidate, current, rollback = pre.candidate, pre.current, pre.rollback
    original = pins_path.read_text()
    pins_text = rotated_pins_text(original, pins_path, current, rollback, candidate)
    expected_pins = _expected_pins(original, current, rollback, candidate)
    drop = (rollback.name,) if rollback else ()
    record_text = accepted_text(record_path, candidate.name, pre.new_outcomes, drop=drop)
    expected_record = {pid: str(o.verdict) for pid, o in pre.new_outcomes.items()}

    def check_pins(staged: Path) -> None:
        load_pins(staged)  # valid as a pins file
        if tomllib.loads(staged.read_text())["pins"] != expected_pins:
            raise KilnError(f"{pins_path}: the rotated file does not read back as intended; nothing written")

    def check_record(staged: Path) -> None:
        record = load_record(staged)
        if record.get(candidate.name) != expected_record or any(name in record for name in drop):
            raise KilnError(f"{record_path}: the updated record does not read back as intended; nothing written")

    commit_files({pins_path: (pins_text, check_pins), record_path: (record_text, check_record)})


# -- command line -------------------------------------------------------------------------------

_ACTION_STYLE = {"keep": "green", "new": "green", "retire": "cyan", "retired": "dim", "re-anchor": "red",
                 "blocked": "red", "gated": "yellow", "-": "red"}
_VERDICT_STYLE = {Verdict.APPLIES: "green", Verdict.ALREADY_PATCHED: "green", Verdict.UPSTREAM: "cyan",
                  Verdict.GATED: "yellow"}


def _verdict(outcome: Outcome) -> str:
    return f"[{_VERDICT_STYLE.get(outcome.verdict, 'red')}]{outcome.verdict}[/]"


def print_report(pre: Preflight) -> None:
    c, out = pre.candidate, ui.stdout
    out.print(f"pin bump: {escape(pre.current.name)} (vLLM {pre.current.vllm}) -> {escape(c.name)} (vLLM {c.vllm})")
    out.print(f"  old: {escape(pre.old_origin)}")
    out.print(f"  new: {escape(c.tree.origin)}")
    out.print(f"  new pin: {escape(c.image)}  digest: {c.digest or '[yellow]' + escape(c.digest_note) + '[/]'}")
    table = Table(title=f"patches: {pre.current.name} vs {c.name}")
    for column in ("patch", "family", "perf", pre.current.name, c.name, "action", f"detail on {c.name}"):
        table.add_column(column, overflow="fold")
    for r in pre.rows:
        detail = "" if r.action == "keep" else r.new.detail
        table.add_row(r.patch, r.family, "yes" if r.perf_critical else "", _verdict(r.old), _verdict(r.new),
                      f"[{_ACTION_STYLE[r.action]}]{r.action}[/]", escape(detail))
    out.print(table)
    out.print(f"retire (newly UPSTREAM): {', '.join(pre.retire) or 'none'}")
    out.print(f"re-anchor (DRIFTED / TARGET_GONE): {', '.join(pre.reanchor) or 'none'}")
    impact = [f"{i['patch']} (requires {i['requires']}, {i['verdict']})" for i in pre.requires_impact]
    out.print(f"retire impact, requires: {', '.join(impact) or 'none'}")
    lost = [f"{r.patch} ({r.new.verdict})" for r in pre.perf_lost]
    out.print(f"retire impact, perf_critical patches that stop applying: {', '.join(lost) or 'none'}")
    if pre.images:
        images = Table(title=f"images on {c.name}")
        for column in ("image", "built on it", "breaks the build", "left out (retired/gated)"):
            images.add_column(column, overflow="fold")
        for i in pre.images:
            built = "yes (every pin)" if i.builds_on_candidate else f"no (pins = {', '.join(i.pins)})"
            images.add_row(escape(i.image), escape(built),
                           ", ".join(f"{o.patch_id} {o.verdict}" for o in i.broken) or "-",
                           ", ".join(f"{o.patch_id} {o.verdict}" for o in i.retired) or "-")
        out.print(images)
    if pre.ok:
        out.print("[green]preflight passed[/]")
    else:
        ui.stderr.print("[red]preflight FAILED:[/] " + escape("; ".join(pre.failures + pre.blockers)))


def cmd_pin_bump(args) -> int:
    if args.force and not args.write:
        raise KilnError("--force only applies with --write")
    pins = load_pins(args.pins)
    current = next((p for p in pins.values() if p.role == "current"), None)
    if current is None:
        raise KilnError(f"{args.pins}: no pin has role 'current'; nothing to bump from")
    rollback = next((p for p in pins.values() if p.role == "rollback"), None)
    catalogue = load_catalogue(args.patchsets)
    images = load_images(args.images, catalogue, pins)
    load_record(args.record)  # a broken record fails now, not after the fetches
    config = config_from_options(args)
    candidate = resolve_candidate(args.to, current, pins, args.pins, config, args.name, args.cuda)
    old_tree = old_pin_tree(current, candidate, config)
    memo = None if args.no_memo else VerdictMemo()
    pre = run_preflight(catalogue, images, current, rollback, old_tree, candidate, memo)

    written, forced = False, []
    if args.write and pre.blockers:
        _emit(args, pre, written, forced)
        raise KilnError(f"--write refused, --force does not cover it: {'; '.join(pre.blockers)}")
    if args.write and (pre.ok or args.force):
        forced = list(pre.failures)
        write_bump(args.pins, args.record, pre)
        written = True
    _emit(args, pre, written, forced)
    if args.write and not written:
        ui.stderr.print(f"[red]not written[/] ({args.pins}, {args.record} untouched): the preflight failed; "
                        "--write --force writes anyway")
    return 0 if pre.ok or written else 1


def _emit(args, pre: Preflight, written: bool, forced: list[str]) -> None:
    if args.json:
        print(json.dumps({**pre.to_json(), "written": written, "forced": forced}, indent=2))
        return
    print_report(pre)
    if written:
        c = pre.candidate
        dropped = f", dropped {pre.rollback.name}" if pre.rollback else ""
        ui.stdout.print(f"[green]wrote[/] {escape(str(args.pins))}: {escape(c.name)} current, "
                        f"{escape(pre.current.name)} rollback{escape(dropped)}; verdicts of {escape(c.name)} "
                        f"recorded in {escape(str(args.record))}")
        if not c.digest:
            ui.stderr.print(f"[yellow]warning:[/] {escape(c.name)} digest {escape(c.digest_note)}")
        if forced:
            ui.stderr.print("[yellow]forced past the failed preflight:[/] " + escape("; ".join(forced)))


def add_bump_parser(pin_subparsers) -> None:
    bump = pin_subparsers.add_parser(
        "bump", help="preflight a new vLLM release or image against the current pin; --write rotates the pins")
    bump.add_argument("--to", required=True, metavar="REF",
                      help="a vLLM release (0.33.0) or an image reference (docker.io/vllm/vllm-openai:v0.33.0)")
    bump.add_argument("--name", help="the new pin's name (default: the image tag, or v<version>)")
    bump.add_argument("--cuda", help="the new pin's CUDA flavour, e.g. cu130 (default: the current pin's)")
    bump.add_argument("--write", action="store_true",
                      help="rotate current -> rollback, add the candidate as current, record its verdicts")
    bump.add_argument("--force", action="store_true", help="with --write: write even though the preflight failed")
    bump.add_argument("--no-memo", action="store_true", help="recompute every verdict (ignore the verdict cache)")
    bump.add_argument("--json", action="store_true", help="print the report as JSON on stdout")
    add_registry_options(bump)
    bump.set_defaults(func=cmd_pin_bump)
