"""``build.py patches``: the catalogue, with families, gates, requires and conflicts."""

from __future__ import annotations

from rich.markup import escape
from rich.table import Table

from kiln.commands.options import add_json_option, repo_files
from kiln.patch.catalog import load_catalogue


def register(sub) -> None:
    p = sub.add_parser("patches", help="list the patch catalogue")
    add_json_option(p, "the catalogue as JSON")
    p.set_defaults(run=run_patches)


def run_patches(args, out) -> int:
    catalogue = load_catalogue(repo_files(args).patchsets)
    rows = [{
        "id": patch.id, "family": patch.family, "title": patch.title, "targets": list(patch.targets),
        "gates": patch.gates.describe(), "requires": list(patch.requires), "conflicts": list(patch.conflicts),
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
        table.add_row(row["id"], row["family"], escape(title), escape(row["gates"]), rel or "-")
    out.stdout.print(table)
    return 0
