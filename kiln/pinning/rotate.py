"""Writing a pin bump: ``pins.toml`` rotated and the candidate's verdicts recorded, together.

Public API:
    rotated_pins_text(text, path, current, rollback, candidate) -> str
    updated_image_text(path, dropped, replacement) -> (text, pins)   an image's pins list, the dropped pin replaced
    write_bump(pins_path, record_path, preflight) -> None    both files (and the images --update-images
                                                             updates), or none

The pins rotate (current -> rollback, the old rollback dropped, the candidate added as
``current`` with its digest) and the candidate's verdicts are recorded under the new pin's
name (the dropped pin's table removed): both files are staged, checked by reading them back,
and committed together (``kiln.staging.commit_all``), or neither is.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

import tomlkit

from kiln.errors import KilnError
from kiln.patch.record import accepted_text, load_record
from kiln.pinning.bump import Candidate, Preflight
from kiln.pins import Pin, load_pins
from kiln.staging import commit_all, discard_all, stage_bytes

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


def updated_image_text(path: Path, dropped: str, replacement: str) -> tuple[str, list[str]]:
    """The image definition with ``replacement`` in ``dropped``'s place in its ``pins`` list
    (tomlkit: comments and layout kept), and the list it then holds."""
    text = path.read_text()
    document = tomlkit.parse(text)
    pins = document.get("pins")
    if pins is None or dropped not in list(pins):
        raise KilnError(f"{path}: pins does not list {dropped!r}; nothing to update")
    if replacement in list(pins):
        pins.remove(dropped)
    else:
        pins[list(pins).index(dropped)] = replacement
    return tomlkit.dumps(document), [str(p) for p in pins]


def write_bump(pins_path: Path, record_path: Path, pre: Preflight) -> None:
    """Rotate the pins, record the candidate's verdicts and update the images ``--update-images``
    chose (``pre.updated_images``): every file, or none."""
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

    images = []
    for impact in pre.updated_images:
        path = Path(impact.path)
        image_text, expected = updated_image_text(path, impact.names_dropped_pin, impact.replaced_by)

        def check_image(staged: Path, path=path, expected=expected) -> None:
            if tomllib.loads(staged.read_text()).get("pins") != expected:
                raise KilnError(f"{path}: the updated pins list does not read back as intended; nothing written")

        images.append((path, image_text, check_image))

    stages = []
    try:
        stages.append(stage_bytes(pins_path.resolve(), pins_text.encode(), check_pins))
        stages.append(stage_bytes(record_path.resolve(), record_text.encode(), check_record))
        for path, image_text, check_image in images:
            stages.append(stage_bytes(path.resolve(), image_text.encode(), check_image))
    except BaseException:
        discard_all(stages)
        raise
    commit_all(stages)


