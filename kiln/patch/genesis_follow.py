"""Following Genesis forward: what changed in its presets and patch registry since the ledger
(``patchsets/genesis.toml``) was read, read from a LOCAL git repository of Genesis (a checkout
or a bare mirror; never the network).

Two files of Genesis are read at a commit, by ``git show COMMIT:PATH``:

- each preset of ``[genesis.presets]`` (YAML): only its top-level ``patches:`` block, one
  ``NAME: 'value'`` per line (a small line reader: kiln does not depend on a YAML library and
  the block is flat);
- the patch registry, ``sndr/dispatcher/registry.py``: the ``PATCH_REGISTRY`` literal, read with
  ``ast.literal_eval`` (parsed, never imported or run).

Public API:
    read_genesis(git_dir, commit, presets) -> Snapshot
    compare(ledger, old, new) -> Changes   (old: the snapshot at the ledger's commit)
"""

from __future__ import annotations

import ast
import re
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kiln.errors import KilnError
from kiln.patch.genesis_doc import Ledger

REGISTRY = "sndr/dispatcher/registry.py"
# The registry fields a change of is reported (the rest is Genesis's prose and bookkeeping).
FIELDS = ("env_flag", "default_on", "lifecycle", "applies_to", "title")
# The architectures of kiln's two models (Qwen3.6 27B and 35B-A3B): a registry entry limited to
# other architectures (`applies_to.model_arch`) does not reach them.
ARCHS = ("Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration")
_ENTRY = re.compile(r"""^\s+([A-Za-z_][A-Za-z0-9_]*)\s*:\s*(?:'([^']*)'|"([^"]*)"|([^\s#]+))?""")


@dataclass(frozen=True)
class Snapshot:
    commit: str  # the full hash the revision resolved to
    presets: dict[str, dict[str, str]]  # preset key -> {switch: value} of its `patches:` block
    registry: dict[str, dict]  # Genesis patch id -> its registry fields (FIELDS only)


@dataclass
class Changes:
    old: str
    new: str
    switches: dict[str, dict[str, list]] = field(default_factory=dict)  # preset -> added/removed/changed
    patches: dict[str, list] = field(default_factory=lambda: {"added": [], "removed": [], "changed": []})
    unjudged: list[str] = field(default_factory=list)  # switches on at `new` (preset or default) with no row

    def empty(self) -> bool:
        return not (any(v for d in self.switches.values() for v in d.values())
                    or any(self.patches.values()) or self.unjudged)

    def as_json(self) -> dict:
        return {"old": self.old, "new": self.new, "switches": self.switches, "patches": self.patches,
                "unjudged": self.unjudged}


def _git(git_dir: Path, *args: str) -> str:
    try:
        done = subprocess.run(["git", f"--git-dir={git_dir}", *args], capture_output=True, text=True, check=False)
    except FileNotFoundError:
        raise KilnError("genesis: git is not installed") from None
    if done.returncode:
        why = (done.stderr.strip().splitlines() or ["failed"])[-1]
        raise KilnError(f"genesis: git {' '.join(args)} in {git_dir}: {why}")
    return done.stdout


def git_dir_of(path: Path) -> Path:
    """The git directory of a checkout (``path/.git``) or a bare repository (``path``)."""
    if not path.exists():
        raise KilnError(f"genesis: {path}: not found (a local checkout or bare git directory of Genesis)")
    return path / ".git" if (path / ".git").exists() else path


def preset_patches(text: str, where: str) -> dict[str, str]:
    """The top-level ``patches:`` block of a preset: NAME -> value as a string."""
    lines = text.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if re.match(r"^patches:\s*(#.*)?$", line))
    except StopIteration:
        raise KilnError(f"genesis: {where}: no top-level `patches:` block") from None
    found: dict[str, str] = {}
    for line in lines[start + 1:]:
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if not line[0].isspace():  # the next top-level key ends the block
            break
        match = _ENTRY.match(line)
        if not match:
            raise KilnError(f"genesis: {where}: unreadable `patches:` line {line.strip()[:60]!r}")
        value = next((g for g in match.groups()[1:] if g is not None), "")
        found[match.group(1)] = value
    return found


def registry_entries(text: str, where: str) -> dict[str, dict]:
    try:
        tree = ast.parse(text)
    except SyntaxError as err:
        raise KilnError(f"genesis: {where}: not Python: {err.msg} (line {err.lineno})") from None
    for node in tree.body:
        target = node.target if isinstance(node, ast.AnnAssign) else (
            node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None)
        if isinstance(target, ast.Name) and target.id == "PATCH_REGISTRY" and node.value is not None:
            try:
                data = ast.literal_eval(node.value)
            except ValueError:
                raise KilnError(f"genesis: {where}: PATCH_REGISTRY is not a literal") from None
            if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
                raise KilnError(f"genesis: {where}: PATCH_REGISTRY is not a table of patch entries")
            return {pid: {k: _plain(entry.get(k)) for k in FIELDS} for pid, entry in data.items()}
    raise KilnError(f"genesis: {where}: no PATCH_REGISTRY")


def _plain(value):
    """Tuples as lists, so a snapshot compares and prints as JSON does."""
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def read_genesis(git_dir: Path, commit: str, presets: Mapping[str, str]) -> Snapshot:
    full = _git(git_dir, "rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}").strip()
    found = {key: preset_patches(_git(git_dir, "show", f"{full}:{path}"), f"{path}@{full[:12]}")
             for key, path in presets.items()}
    return Snapshot(full, found, registry_entries(_git(git_dir, "show", f"{full}:{REGISTRY}"), f"{REGISTRY}@{full[:12]}"))


def default_on(snapshot: Snapshot) -> dict[str, str]:
    """Genesis patch id -> switch, for every registry entry that applies without a switch set
    and is not limited to other architectures than kiln's models'."""
    def ours(entry) -> bool:
        archs = (entry["applies_to"] or {}).get("model_arch") if isinstance(entry["applies_to"], dict) else None
        return not archs or bool(set(archs) & set(ARCHS))
    return {pid: e["env_flag"] for pid, e in snapshot.registry.items() if e["default_on"] and e["env_flag"] and ours(e)}


def compare(ledger: Ledger, old: Snapshot, new: Snapshot) -> Changes:
    changes = Changes(old.commit, new.commit)
    for key in ledger.presets:
        before, after = old.presets[key], new.presets[key]
        changes.switches[key] = {
            "added": [{"switch": s, "value": after[s]} for s in sorted(set(after) - set(before))],
            "removed": [{"switch": s, "value": before[s]} for s in sorted(set(before) - set(after))],
            "changed": [{"switch": s, "old": before[s], "new": after[s]}
                        for s in sorted(set(before) & set(after)) if before[s] != after[s]],
        }
    changes.patches["added"] = [{"id": p, **new.registry[p]} for p in sorted(set(new.registry) - set(old.registry))]
    changes.patches["removed"] = [{"id": p, **old.registry[p]} for p in sorted(set(old.registry) - set(new.registry))]
    for pid in sorted(set(old.registry) & set(new.registry)):
        diff = {k: {"old": old.registry[pid][k], "new": new.registry[pid][k]}
                for k in FIELDS if old.registry[pid][k] != new.registry[pid][k]}
        if diff:
            changes.patches["changed"].append({"id": pid, "fields": diff})
    rows = {row.switch for row in ledger.rows}
    defaults = set(default_on(new).values())
    on = set()  # per preset: what it sets to "1", and what is on by default that it does not set otherwise
    for patches in new.presets.values():
        on |= {s for s, v in patches.items() if v == "1"} | {s for s in defaults if patches.get(s, "1") == "1"}
    changes.unjudged = sorted(s for s in on - rows if s.startswith(("GENESIS_", "SNDR_")))
    return changes
