"""``build.py patches``: the catalogue, with families, gates, requires and conflicts;
``--doc`` writes docs/PATCHES.md from it, ``--genesis-doc`` docs/GENESIS.md from
``patchsets/genesis.toml`` (the Genesis ledger)."""

from __future__ import annotations

from pathlib import Path

from rich.markup import escape
from rich.table import Table

from kiln import paths
from kiln.commands.options import add_json_option, command_inputs, repo_files
from kiln.definitions import load_definitions
from kiln.errors import KilnError
from kiln.patch.catalog import load_catalogue
from kiln.patch.catalogue_doc import doc_notes, render_patches_doc
from kiln.patch.genesis_doc import load_ledger, render_genesis_doc
from kiln.patch.record import load_record
from kiln.patch.train import TRAIN_RECORD
from kiln.paths import RepoFiles
from kiln.pins import load_pins
from kiln.publish.destinations import check_output_path
from kiln.staging import write_atomic

DOC = paths.REPO / "docs" / "PATCHES.md"
GENESIS_DOC = paths.REPO / "docs" / "GENESIS.md"
GENESIS_LEDGER = "genesis.toml"  # beside the catalogue (patchsets/)


def register(sub) -> None:
    p = sub.add_parser("patches", help="list the patch catalogue")
    add_json_option(p, "the catalogue as JSON")
    p.add_argument("--doc", nargs="?", type=Path, const=DOC, metavar="FILE",
                   help=f"write the catalogue document (default {DOC.relative_to(paths.REPO)}), keeping its notes")
    p.add_argument("--genesis-doc", nargs="?", type=Path, const=GENESIS_DOC, metavar="FILE",
                   help="write the Genesis ledger from patchsets/genesis.toml "
                        f"(default {GENESIS_DOC.relative_to(paths.REPO)})")
    p.set_defaults(run=run_patches)


def patches_doc(files: RepoFiles, notes: str) -> str:
    """docs/PATCHES.md's text for the catalogue, records and image definitions in ``files``."""
    catalogue = load_catalogue(files.patchsets)
    pins = load_pins(files.pins)
    selections = {d.name: d.patches for d in load_definitions(files.images, catalogue, pins)}
    return render_patches_doc(catalogue, load_record(files.record), load_record(files.patchsets / TRAIN_RECORD),
                              selections, notes)


def genesis_doc(files: RepoFiles) -> str:
    """docs/GENESIS.md's text for the ledger, catalogue and records in ``files``."""
    ledger = load_ledger(files.patchsets / GENESIS_LEDGER)  # a bad ledger fails before the catalogue loads
    return render_genesis_doc(ledger, load_catalogue(files.patchsets), load_record(files.record))


def run_patches(args, out) -> int:
    files = repo_files(args)
    if args.doc and args.genesis_doc:
        raise KilnError("patches: --doc and --genesis-doc write one document each; run them one at a time")
    if args.genesis_doc:
        write_atomic(args.genesis_doc, genesis_doc(files).encode())
        out.stderr.print(f"wrote {escape(str(args.genesis_doc))}")
        return 0
    if args.doc:
        args.doc = check_output_path(args.doc, "--doc", False, command_inputs(args))
        notes = doc_notes(args.doc.read_text()) if args.doc.is_file() else ""
        write_atomic(args.doc, patches_doc(files, notes).encode())
        out.stderr.print(f"wrote {escape(str(args.doc))}")
        return 0
    catalogue = load_catalogue(files.patchsets)
    rows = [{
        "id": patch.id, "family": patch.family, "title": patch.title, "targets": list(patch.targets),
        "written_for": patch.written_for, "gates": patch.gates.describe(), "requires": list(patch.requires), "conflicts": list(patch.conflicts),
        "upstream_refs": list(patch.upstream_refs), "variant": patch.variant, "perf_critical": patch.perf_critical,
    } for patch in catalogue.patches.values()]
    if args.json:
        out.json({"patches": rows})
        return 0
    table = Table(title=f"kiln patch catalogue ({len(rows)} patches)")
    for column in ("id", "family", "title", "gates", "requires / conflicts"):
        table.add_column(column)
    for row in rows:
        rel = " ".join([*(f"+{r}" for r in row["requires"]), *(f"!{c}" for c in row["conflicts"])])
        title = row["title"] + (" (variant)" if row["variant"] else "")
        gates = "; ".join([*([f"written for vllm{row['written_for']}"] if row["written_for"] else []),
                           *([row["gates"]] if row["gates"] != "-" else [])]) or "-"
        table.add_row(row["id"], row["family"], escape(title), escape(gates), rel or "-")
    out.stdout.print(table)
    return 0
