"""``build.py pin lock`` / ``build.py pin list``: lock pins to their base image's digest.

Public API:
    LockResult(name, image, digest, previous)   .status -> "unchanged" | "locked" | "re-locked"
    resolve_pin(pin, config) -> str             the digest the pin's ``image`` names now
    lock_pins(path, names, config) -> list[LockResult]   resolve, then rewrite ``pins.toml``
    write_digests(path, digests)                the tomlkit writer (comments and order kept)
    verdict_counts(table) -> dict | None        a pin's recorded verdicts counted (``pin list``)
    add_pin_parser(subparsers)                  registers ``pin lock``, ``pin list`` and ``pin bump``
                                                (``kiln/pinbump.py``)

A lock resolves the reference exactly as ``build`` does (one manifest HEAD through the same
registry client, mirrors and insecure hosts), so a freshly locked pin builds without
``--allow-unlocked``. For a manifest list / OCI index the digest is the index's, as the build
checks it. Every pin named is resolved before anything is written; the file is then rewritten
with tomlkit (comments, order and formatting kept) to a temporary file beside it, checked by
``load_pins`` and renamed over the original. Any error leaves the file untouched; a lock that
changes nothing does not rewrite it.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import tomlkit
from rich.markup import escape
from rich.table import Table

from kiln import ui
from kiln.errors import KilnError
from kiln.oci.endpoints import RegistryConfig, add_registry_options, config_from_options
from kiln.oci.reference import parse_reference
from kiln.oci.registry import RegistryClient
from kiln.patch.record import load_record
from kiln.pins import Pin, get_pin, load_pins


@dataclass(frozen=True)
class LockResult:
    name: str
    image: str
    digest: str
    previous: str  # "" when the pin was unlocked

    @property
    def status(self) -> str:
        if self.previous == self.digest:
            return "unchanged"
        return "re-locked" if self.previous else "locked"

    def to_json(self) -> dict:
        return {**asdict(self), "status": self.status}


def resolve_pin(pin: Pin, config: RegistryConfig, clients: dict | None = None) -> str:
    """The manifest digest ``pin.image`` names now; errors name the pin."""
    try:
        ref = parse_reference(pin.image)
        clients = {} if clients is None else clients
        host = config.endpoint(ref.registry).host
        client = clients.get(host) or clients.setdefault(host, RegistryClient.for_registry(ref.registry, config))
        digest = client.resolve(ref.repository, ref.ref)
        if ref.digest and digest != ref.digest:
            raise KilnError(f"{pin.image} answers with digest {digest}")
        return digest
    except KilnError as err:
        raise KilnError(f"pin {pin.name}: {err}") from None


def lock_pins(path: Path, names: list[str], config: RegistryConfig) -> list[LockResult]:
    """Resolve the named pins (all when ``names`` is empty) and write their digests."""
    pins = load_pins(path)
    chosen = [get_pin(pins, name, path) for name in dict.fromkeys(names)] if names else list(pins.values())
    clients: dict = {}
    results = [LockResult(pin.name, pin.image, resolve_pin(pin, config, clients), pin.digest) for pin in chosen]
    changed = {r.name: r.digest for r in results if r.status != "unchanged"}
    if changed:
        write_digests(path, changed)
    return results


def write_digests(path: Path, digests: dict[str, str]) -> None:
    """Set ``pins.<name>.digest`` for each entry, keeping everything else byte-for-byte."""
    target = path.resolve()
    text = target.read_text()
    try:
        document = tomlkit.parse(text)
    except tomlkit.exceptions.TOMLKitError as err:
        raise KilnError(f"{path}: not valid TOML: {err}") from None
    for name, digest in digests.items():
        document["pins"][name]["digest"] = digest
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(tomlkit.dumps(document))
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, target.stat().st_mode & 0o7777)
        written = load_pins(Path(tmp))  # never install a file kiln could not read back
        for name, digest in digests.items():
            if written[name].digest != digest:
                raise KilnError(f"{path}: pins.{name}.digest did not round-trip")
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# -- command line ----------------------------------------------------------------------------


def cmd_pin_lock(args) -> int:
    results = lock_pins(args.pins, args.names, config_from_options(args))
    if args.json:
        print(json.dumps({"pins_file": str(args.pins), "pins": [r.to_json() for r in results]}, indent=2))
        return 0
    for r in results:
        style = {"unchanged": "dim", "locked": "green", "re-locked": "yellow"}[r.status]
        was = f" (was {r.previous})" if r.status == "re-locked" else ""
        ui.stdout.print(f"[{style}]{r.status:>9}[/] {escape(r.name)}  {escape(r.image)}@{r.digest}{was}")
    return 0


def cmd_pin_list(args) -> int:
    pins = load_pins(args.pins)
    record = load_record(args.record)
    rows = [{"name": p.name, "role": p.role, "image": p.image, "vllm": str(p.vllm), "cuda": p.cuda,
             "digest": p.digest or None, "verdicts": verdict_counts(record.get(p.name))} for p in pins.values()]
    if args.json:
        print(json.dumps({"pins_file": str(args.pins), "pins": rows}, indent=2))
        return 0
    table = Table(title=f"pins ({args.pins})")
    for column in ("name", "role", "image", "vllm", "cuda", "digest", "recorded verdicts"):
        table.add_column(column, overflow="fold")
    for row in rows:
        digest = row["digest"] or "[yellow]unlocked[/]"
        counts = row["verdicts"]
        verdicts = ", ".join(f"{n} {v}" for v, n in counts.items()) if counts else "[yellow]unrecorded[/]"
        table.add_row(escape(row["name"]), row["role"], escape(row["image"]), row["vllm"], row["cuda"], digest,
                      verdicts)
    ui.stdout.print(table)
    return 0


def verdict_counts(table: dict[str, str] | None) -> dict[str, int] | None:
    """``{"APPLIES": 9, "UPSTREAM": 3}`` from a pin's table in the verdict record (None: none)."""
    if table is None:
        return None
    counts: dict[str, int] = {}
    for verdict in table.values():
        counts[verdict] = counts.get(verdict, 0) + 1
    return dict(sorted(counts.items(), key=lambda item: (-item[1], item[0])))


def add_pin_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("pin", help="list pins, lock them to their base image's digest, bump to a new vLLM")
    sub = p.add_subparsers(dest="pin_command", required=True, metavar="PIN_COMMAND")
    lock = sub.add_parser("lock", help="resolve each pin's image to its digest and write it to the pins file")
    lock.add_argument("names", nargs="*", metavar="NAME", help="pins to lock (default: all)")
    add_registry_options(lock)
    lock.add_argument("--json", action="store_true", help="print a JSON summary on stdout")
    lock.set_defaults(func=cmd_pin_lock)
    listing = sub.add_parser("list", help="the pins, with their digest or 'unlocked'")
    listing.add_argument("--json", action="store_true")
    listing.set_defaults(func=cmd_pin_list)
    from kiln.pinbump import add_bump_parser  # here: pinbump itself builds on this module

    add_bump_parser(sub)
    return p
