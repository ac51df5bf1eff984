"""``build.py genesis``: what changed in Genesis's presets and patch registry between the commit
the ledger (``patchsets/genesis.toml``) was read at and another commit, read from a local git
repository of Genesis (``--genesis-repo``: a checkout or a bare mirror; never the network).

Exit 0 when nothing changed and every switch on at that commit has a row; 1 when something
changed or a switch on there (set to "1" by a preset, or on by default in the registry) has no
row; 2 on an error (no such repository, commit or file)."""

from __future__ import annotations

from pathlib import Path

from rich.markup import escape

from kiln.commands.options import add_json_option, repo_files
from kiln.patch.genesis_doc import load_ledger
from kiln.patch.genesis_follow import compare, git_dir_of, read_genesis

GENESIS_LEDGER = "genesis.toml"  # beside the catalogue (patchsets/), as `patches --genesis-doc` reads it


def register(sub) -> None:
    p = sub.add_parser("genesis", help="what changed in Genesis since the ledger was read (a local git repository)")
    p.add_argument("--genesis-repo", type=Path, required=True, metavar="DIR",
                   help="a local checkout or bare git directory of Genesis's repository")
    p.add_argument("--at", default="HEAD", metavar="REV",
                   help="the commit (or branch) to compare the ledger's commit with (default HEAD)")
    add_json_option(p, "the changes as JSON")
    p.set_defaults(run=run_genesis)


def run_genesis(args, out) -> int:
    ledger = load_ledger(repo_files(args).patchsets / GENESIS_LEDGER)
    git_dir = git_dir_of(args.genesis_repo)
    old = read_genesis(git_dir, ledger.commit, ledger.presets)
    new = read_genesis(git_dir, args.at, ledger.presets)
    changes = compare(ledger, old, new)
    if args.json:
        out.json(changes.as_json())
        return 1 if not changes.empty() else 0
    say = out.stdout.print
    say(f"genesis: ledger read at {old.commit[:12]}, compared with {new.commit[:12]}", highlight=False)
    for key, kinds in changes.switches.items():
        for item in kinds["added"]:
            say(f"  preset {key}: added {item['switch']} = {item['value']!r}", highlight=False, markup=False)
        for item in kinds["removed"]:
            say(f"  preset {key}: removed {item['switch']} (was {item['value']!r})", highlight=False, markup=False)
        for item in kinds["changed"]:
            say(f"  preset {key}: changed {item['switch']} {item['old']!r} -> {item['new']!r}",
                highlight=False, markup=False)
    for item in changes.patches["added"]:
        on = "on by default" if item["default_on"] else "off by default"
        say(f"  registry: added {item['id']} ({item['env_flag']}, {on}): {escape(str(item['title']))}", highlight=False)
    for item in changes.patches["removed"]:
        say(f"  registry: removed {item['id']} ({item['env_flag']})", highlight=False, markup=False)
    for item in changes.patches["changed"]:
        fields = ", ".join(f"{k} {v['old']!r} -> {v['new']!r}" for k, v in item["fields"].items())
        say(f"  registry: changed {item['id']}: {escape(fields)}", highlight=False)
    for switch in changes.unjudged:
        say(f"  no row: {switch} is on at {new.commit[:12]} and patchsets/genesis.toml has no row for it",
            highlight=False, markup=False)
    if changes.empty():
        say("  nothing changed; every switch on there has a row", highlight=False)
        return 0
    return 1
