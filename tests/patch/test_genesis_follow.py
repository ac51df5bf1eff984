"""``build.py genesis``: the ledger follows Genesis forward. A small git repository in Genesis's
real layout (two presets under sndr/model_configs/builtin/model/ and the patch registry at
sndr/dispatcher/registry.py), two commits: the command reports the switches and patches added,
removed or changed since the ledger's commit, and the switches on at the new commit that have no
row, from the local repository only (a checkout or a bare mirror)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from kiln.errors import KilnError
from kiln.patch.genesis_follow import preset_patches, registry_entries
from tests.support.cli import one_line_error, run

P27 = "sndr/model_configs/builtin/model/qwen3.6-27b-int4-autoround-tq-k8v4.yaml"
P35 = "sndr/model_configs/builtin/model/qwen3.6-35b-a3b-fp8.yaml"

PRESET = """\
schema_version: 2
id: {id}
override_generation_config:
  temperature: 0.6

patches:
  GENESIS_ENABLE_P58_ASYNC_PLACEHOLDER_FIX: '1'      # a comment
{extra}
  VLLM_TQ_DECODE_NUM_WARPS: '4'

notes:
  - "a note: with a colon"
"""

REGISTRY = """\
from typing import Any

PATCH_REGISTRY: dict[str, dict[str, Any]] = {{
    "P58": {{"title": "placeholders", "env_flag": "GENESIS_ENABLE_P58_ASYNC_PLACEHOLDER_FIX",
             "default_on": False, "lifecycle": "experimental"}},
    "G4_01": {{"title": "a Gemma guard", "env_flag": "GENESIS_ENABLE_G4_01", "default_on": True,
               "applies_to": {{"model_arch": ["Gemma4ForConditionalGeneration"]}}}},
{extra}
}}
"""

LEDGER = """\
[genesis]
repository = "Sandermage/genesis-vllm-patches"
commit = "{commit}"
vllm = "0.33.0"

[genesis.presets]
"27B" = "{p27}"
"35B-A3B" = "{p35}"

[switch.GENESIS_ENABLE_P58_ASYNC_PLACEHOLDER_FIX]
id = "P58"
presets = ["27B", "35B-A3B"]
what = "placeholders"
status = "planned"

[switch.GENESIS_ENABLE_P60_GDN_NGRAM_FIX]
id = "P60"
presets = ["27B"]
what = "GDN rollback"
status = "planned"

[switch.GENESIS_ENABLE_P81]
id = "P81"
presets = ["35B-A3B"]
what = "FP8 small M"
status = "planned"
"""


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          capture_output=True, text=True, check=True).stdout.strip()


def commit(repo: Path, files: dict[str, str], message: str) -> str:
    for rel, text in files.items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(text)
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", message)
    return git(repo, "rev-parse", "HEAD")


@pytest.fixture
def genesis(tmp_path):
    """(repository, first commit, second commit, patchsets dir with a ledger read at the first)."""
    repo = tmp_path / "genesis"
    repo.mkdir()
    git(repo, "init", "-q")
    first = commit(repo, {
        P27: PRESET.format(id="27b", extra="  GENESIS_ENABLE_P60_GDN_NGRAM_FIX: '1'"),
        P35: PRESET.format(id="35b", extra="  GENESIS_ENABLE_P81: '1'"),
        "sndr/dispatcher/registry.py": REGISTRY.format(extra='    "P81": {"title": "FP8 small M", '
                                                             '"env_flag": "GENESIS_ENABLE_P81", "default_on": False},'),
    }, "first")
    second = commit(repo, {
        P27: PRESET.format(id="27b", extra="  GENESIS_ENABLE_P60_GDN_NGRAM_FIX: '0'\n  GENESIS_ENABLE_P99: '1'"),
        P35: PRESET.format(id="35b", extra=""),
        "sndr/dispatcher/registry.py": REGISTRY.format(extra=(
            '    "P81": {"title": "FP8 small M", "env_flag": "GENESIS_ENABLE_P81", "default_on": False,'
            ' "lifecycle": "retired"},\n'
            '    "PN252": {"title": "prompt embeds", "env_flag": "GENESIS_ENABLE_PN252", "default_on": True,'
            ' "applies_to": {"vllm_version_range": (">=0.20.0", "<0.23.0")}},')),
    }, "second")
    patchsets = tmp_path / "patchsets"
    patchsets.mkdir()
    (patchsets / "genesis.toml").write_text(LEDGER.format(commit=first, p27=P27, p35=P35))
    return repo, first, second, patchsets


def test_the_changes_since_the_ledgers_commit_are_reported_and_exit_1(genesis, capsys):
    repo, first, second, patchsets = genesis
    code, out, err = run(capsys, "--patchsets", patchsets, "genesis", "--genesis-repo", repo, "--at", "HEAD", "--json")
    assert code == 1, err
    report = json.loads(out)
    assert (report["old"], report["new"]) == (first, second)
    assert report["switches"] == {
        "27B": {"added": [{"switch": "GENESIS_ENABLE_P99", "value": "1"}], "removed": [],
                "changed": [{"switch": "GENESIS_ENABLE_P60_GDN_NGRAM_FIX", "old": "1", "new": "0"}]},
        "35B-A3B": {"added": [], "removed": [{"switch": "GENESIS_ENABLE_P81", "value": "1"}], "changed": []},
    }
    assert [p["id"] for p in report["patches"]["added"]] == ["PN252"]
    assert report["patches"]["added"][0]["applies_to"] == {"vllm_version_range": [">=0.20.0", "<0.23.0"]}
    assert report["patches"]["removed"] == []
    assert report["patches"]["changed"] == [{"id": "P81", "fields": {"lifecycle": {"old": None, "new": "retired"}}}]
    # P99 is switched on by a preset and PN252 is on by default: neither has a row. The Gemma-only
    # default (G4_01) does not reach kiln's models; P60, now "0", needs none.
    assert report["unjudged"] == ["GENESIS_ENABLE_P99", "GENESIS_ENABLE_PN252"]
    code, out, _ = run(capsys, "--patchsets", patchsets, "genesis", "--genesis-repo", repo, "--at", second)
    assert code == 1
    assert "preset 27B: added GENESIS_ENABLE_P99 = '1'" in out
    assert "preset 35B-A3B: removed GENESIS_ENABLE_P81" in out
    assert "registry: added PN252 (GENESIS_ENABLE_PN252, on by default)" in out
    assert "registry: changed P81: lifecycle None -> 'retired'" in out
    assert "no row: GENESIS_ENABLE_PN252" in out


def test_nothing_changed_is_exit_0_and_a_bare_mirror_reads_the_same(genesis, capsys, tmp_path):
    repo, first, second, patchsets = genesis
    code, out, err = run(capsys, "--patchsets", patchsets, "genesis", "--genesis-repo", repo, "--at", first, "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["unjudged"] == [] and not any(report["patches"].values())
    bare = tmp_path / "mirror.git"
    subprocess.run(["git", "clone", "-q", "--bare", str(repo), str(bare)], check=True)
    code, out, _ = run(capsys, "--patchsets", patchsets, "genesis", "--genesis-repo", bare, "--at", second, "--json")
    assert code == 1 and json.loads(out)["new"] == second


@pytest.mark.parametrize(("at", "where", "message"), [
    ("0" * 40, "repo", "genesis: git rev-parse"),
    ("HEAD", "nowhere", "not found (a local checkout or bare git directory of Genesis)"),
])
def test_an_unknown_commit_or_repository_is_one_line_exit_2(genesis, capsys, tmp_path, at, where, message):
    repo, _, _, patchsets = genesis
    path = repo if where == "repo" else tmp_path / where
    code, _, err = run(capsys, "--patchsets", patchsets, "genesis", "--genesis-repo", path, "--at", at)
    assert code == 2
    assert message in one_line_error(err)


def test_a_preset_file_missing_at_the_commit_is_exit_2(genesis, capsys):
    repo, _, _, patchsets = genesis
    git(repo, "rm", "-q", P35)
    git(repo, "commit", "-q", "-m", "gone")
    code, _, err = run(capsys, "--patchsets", patchsets, "genesis", "--genesis-repo", repo)
    assert code == 2
    assert P35 in one_line_error(err)


def test_the_readers_refuse_what_they_cannot_read():
    assert preset_patches("patches:\n  A_B: '1'  # x\n  C: \"0\"\n  D: plain\nnext: 1\n  E: '1'\n", "p") == \
        {"A_B": "1", "C": "0", "D": "plain"}
    with pytest.raises(KilnError, match="p: no top-level `patches:` block"):
        preset_patches("patch:\n  A: '1'\n", "p")
    with pytest.raises(KilnError, match="unreadable `patches:` line"):
        preset_patches("patches:\n  - A\n", "p")
    with pytest.raises(KilnError, match="r: PATCH_REGISTRY is not a literal"):
        registry_entries("PATCH_REGISTRY = {'A': dict(x=1)}\n", "r")
    with pytest.raises(KilnError, match="r: no PATCH_REGISTRY"):
        registry_entries("OTHER = {}\n", "r")
