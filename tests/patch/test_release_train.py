"""The catalogue on a spread of real vLLM releases equals the reviewed release train.

Each release's pristine source is its PyPI wheel through kiln's own ``WheelSource`` (cached in
the kiln cache, one wheel per release), every patch runs in isolated mode as ``verify`` does,
with the verdict memo (a rerun on unchanged inputs reads the memo). The releases are the two
pins' neighbours of the record, 0.20.1 and 0.33.0, and the releases on both sides of every
verdict change recorded in ``patchsets/release-train.toml`` (see docs/RELEASE_TRAIN.md).
"""

from __future__ import annotations

import pytest
from packaging.version import Version

from kiln import paths
from kiln.patch.memo import VerdictMemo
from kiln.patch.record import load_record
from kiln.patch.train import TRAIN_RECORD, compare_with_record, release_label, run_train
from kiln.source.wheel import WheelSource

pytestmark = pytest.mark.network

RECORD = paths.PATCHSETS / TRAIN_RECORD

# 0.20.1 and 0.33.0, and every release where a recorded verdict changes, with the one before:
#   0.21.0  P4, P5, P5b upstream; P22 drift (half upstream); PN353A, K4 ungated; K2 drift; K3 upstream
#   0.22.0  P44 upstream (zero fill gone); P60 target gone, P60b gated; K2 upstream
#   0.23.0  PN91 upstream (developer messages converted before rendering); PN92 upstream (trial import);
#           P34 drift (the waiting loop's split also tests `not load_kv_async`)
#   0.24.0  P22, PN353A upstream (reserved workspace); P64 upstream (parser engine); P61c gated, K1 ungated
#   0.25.0  P62 drift (half upstream)
#   0.26.0  PN346 upstream (no extra search block for Mamba groups)
#   0.27.0  P62 upstream (the accepted-token window); P14 upstream (move_row zeroes the vacated row)
#   0.28.0  P34 upstream (aligned before the encoder cap; a mid-block chunk stops at the boundary)
#   0.29.0  P66, P109, PN73 upstream (uniform decode sizes; stop-token validation; guarded tool-call arguments)
#   0.30.0  PN390 out of range (its kernels launch through warm-up dispatchers)
#   0.32.0  P60 upstream (draftless rows on the spec path)
RELEASES = ["0.20.1", "0.21.0", "0.22.0", "0.23.0", "0.24.0", "0.25.0", "0.26.0", "0.27.0", "0.28.0", "0.29.0", "0.30.0", "0.32.0", "0.33.0"]


def test_the_spread_covers_every_recorded_change():
    """Each flip in the record falls between two releases this test runs (or on one of them)."""
    record = load_record(RECORD)
    labels = sorted(record, key=lambda label: Version(label.removeprefix("vllm-")))
    chosen = {release_label(Version(v)) for v in RELEASES}
    for before, after in zip(labels, labels[1:], strict=False):
        for pid in record[after]:
            if record[before].get(pid) != record[after][pid]:
                assert after in chosen, f"{pid} changes at {after}, which this test does not run"
                earlier = [x for x in labels if x in chosen and labels.index(x) < labels.index(after)]
                assert earlier, f"{pid}: no release before {after} in the spread"
                assert record[earlier[-1]].get(pid) == record[before].get(pid), (
                    f"{pid} changes between {earlier[-1]} and {before} too: add a release"
                )


def test_verdicts_on_the_spread_equal_the_recorded_train(catalogue):
    matrix = run_train(catalogue, [Version(v) for v in RELEASES], WheelSource, memo=VerdictMemo())
    assert compare_with_record(matrix, RECORD) == {}, {
        label: [(d.patch_id, d.expected, d.actual, matrix.outcomes[label][d.patch_id].detail if d.actual else "") for d in diffs]
        for label, diffs in compare_with_record(matrix, RECORD).items()
    }


def test_the_record_covers_the_catalogue_on_every_release(catalogue):
    for label, table in load_record(RECORD).items():
        assert set(table) == set(catalogue.patches), label


def test_verify_command_on_a_range(capsys):
    """``build.py verify --vllm A..B --json``: every release of the index in the range, compared
    with the record (exit 0: it equals the record)."""
    import json

    from kiln.commands import main

    code = main(["verify", "--vllm", "0.20.1..0.21.0", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["releases"] == ["vllm-0.20.1", "vllm-0.20.2", "vllm-0.21.0"]
    assert out["differences"] == {} and code == 0
    p4 = out["patches"]["P4"]
    assert [p4[label]["verdict"] for label in out["releases"]] == ["APPLIES", "APPLIES", "UPSTREAM"]
    assert "turboquant/config.py:187" in p4["vllm-0.21.0"]["detail"]


def test_verify_one_release_of_the_train_compares_with_its_train_record(capsys):
    """``verify --vllm 0.21.0``: a release recorded only in the train is compared with its table
    there (it used to be 'unrecorded' against verdicts.toml, exit 1), and equals it."""
    import json

    from kiln.commands import main

    code = main(["verify", "--vllm", "0.21.0", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["source"] == "vllm-0.21.0" and out["record"] == str(RECORD)
    assert out["differences"] == [] and code == 0
    recorded = load_record(RECORD)["vllm-0.21.0"]
    assert {p["patch"]: p["expected"] for p in out["patches"]} == recorded
    assert {p["patch"]: p["verdict"] for p in out["patches"]} == recorded


def test_verify_one_release_names_a_train_difference_and_accepts_into_the_train(capsys, tmp_path):
    """A train table that differs fails naming release-train.toml; ``--accept`` rewrites that
    table (not the verdict record) and the next run is equal."""
    import shutil

    from kiln.commands import main

    patchsets = tmp_path / "patchsets"
    shutil.copytree(paths.PATCHSETS, patchsets, ignore=shutil.ignore_patterns("__pycache__"))
    train = patchsets / TRAIN_RECORD
    section = train.read_text().index('["vllm-0.21.0"]')
    text = train.read_text()
    start = text.index('P4 = "UPSTREAM"', section)
    train.write_text(text[:start] + 'P4 = "APPLIES"' + text[start + len('P4 = "UPSTREAM"'):])
    record = tmp_path / "verdicts.toml"
    shutil.copy(paths.RECORD, record)
    argv = ["--patchsets", patchsets, "--record", record, "verify", "--vllm", "0.21.0"]

    code = main([str(a) for a in argv])
    _, err = capsys.readouterr()
    assert code == 1
    assert f"1 verdict(s) differ from {train}" in " ".join(err.split()) and "P4 APPLIES -> UPSTREAM" in err, err

    assert main([str(a) for a in [*argv, "--accept"]]) == 0
    capsys.readouterr()
    assert train.read_text() == RECORD.read_text()  # the table is the reviewed one again, in place
    assert record.read_bytes() == paths.RECORD.read_bytes()  # the verdict record untouched
    assert main([str(a) for a in argv]) == 0
    assert capsys.readouterr().out.strip().endswith("equal to the release train")
