"""The release train as a library: range specs, the release listing, the matrix, the record.

Offline: the index is a PEP 503 page served on loopback, the sources are small trees in
``tmp_path`` (one per release, the shape of the code changing between them), and the patches
are ordinary ``Patch`` classes. The real releases are in ``test_release_train.py``.
"""

from __future__ import annotations

import http.server
import textwrap
import threading
from contextlib import contextmanager
from pathlib import Path

import pytest
from packaging.version import Version

from kiln.errors import KilnError
from kiln.patch.catalog import Catalogue
from kiln.patch.memo import VerdictMemo
from kiln.patch.model import Codemod, Patch
from kiln.patch.record import load_record
from kiln.patch.shapes import cls, func, marked, statements, with_marker
from kiln.patch.train import (
    accepted_train_text,
    compare_with_record,
    parse_release_range,
    release_label,
    releases_in,
    run_train,
)
from kiln.report import Reporter, Task
from kiln.source.tree import SourceTree
from kiln.source.wheel import list_releases
from tests.patch.test_engine import AddHelper  # the engine tests' codemod: adds Builder.helper

V = Version

# --- range specs -------------------------------------------------------------------------------


def test_range_spec_is_inclusive_and_ordered():
    assert parse_release_range("0.20.1..0.33.0") == (V("0.20.1"), V("0.33.0"))
    assert parse_release_range(" 0.21.0 .. 0.21.0 ") == (V("0.21.0"), V("0.21.0"))


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("0.20.1", "expected FIRST..LAST"),
        ("..0.33.0", "expected FIRST..LAST"),
        ("0.20.1..", "expected FIRST..LAST"),
        ("0.33.0..0.20.1", "0.20.1 is before 0.33.0"),
        ("0.20.x..0.33.0", "Invalid version"),
    ],
)
def test_bad_range_spec_is_a_one_line_error(spec, message):
    with pytest.raises(KilnError, match=message):
        parse_release_range(spec)


def test_releases_in_a_range_are_the_final_ones_available():
    available = [V(v) for v in ("0.19.1", "0.20.1", "0.20.2", "0.21.0rc1", "0.21.0", "0.22.0.dev3", "0.33.0", "0.34.0")]
    assert releases_in("0.20.1..0.33.0", available) == [V("0.20.1"), V("0.20.2"), V("0.21.0"), V("0.33.0")]
    with pytest.raises(KilnError, match="no final vLLM release on the index"):
        releases_in("0.23.0..0.24.0", available)


# --- the release listing, from a real HTTP index on loopback -----------------------------------


@pytest.fixture
def index(tmp_path, monkeypatch):
    www = tmp_path / "www"
    (www / "vllm").mkdir(parents=True)
    handler = lambda *a, **k: http.server.SimpleHTTPRequestHandler(*a, directory=str(www), **k)  # noqa: E731
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("KILN_PYPI_INDEX", f"http://127.0.0.1:{server.server_port}")

    def publish(anchors: list[str]) -> None:
        (www / "vllm" / "index.html").write_text("<html><body>" + "".join(anchors) + "</body></html>")

    yield publish
    server.shutdown()


def _a(filename: str, yanked: bool = False) -> str:
    attr = ' data-yanked=""' if yanked else ""
    return f'<a href="../{filename}#sha256={"0" * 64}"{attr}>{filename}</a>'


def test_list_releases_reads_the_index(index):
    index(
        [
            _a("vllm-0.20.1-cp38-abi3-manylinux_2_28_x86_64.whl"),
            _a("vllm-0.20.1.tar.gz"),
            _a("vllm-0.20.2-cp38-abi3-manylinux_2_28_aarch64.whl"),  # no x86_64 wheel: no source
            _a("vllm-0.21.0-cp38-abi3-manylinux_2_28_x86_64.whl", yanked=True),
            _a("vllm-0.22.0rc1-cp38-abi3-manylinux_2_28_x86_64.whl"),  # pre-release
            _a("vllm-0.23.0-2-cp38-abi3-manylinux_2_28_x86_64.whl"),  # a build-tagged rebuild
            _a("vllm-0.23.0-cp38-abi3-manylinux_2_28_x86_64.whl"),
            _a("vllm-0.24.0.tar.gz"),  # sdist only
            _a("vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl"),
        ]
    )
    assert list_releases() == [V("0.20.1"), V("0.23.0"), V("0.33.0")]


def test_list_releases_names_an_unreachable_index(monkeypatch):
    monkeypatch.setenv("KILN_PYPI_INDEX", "http://127.0.0.1:9")
    with pytest.raises(KilnError, match="cannot reach the package index"):
        list_releases()


# --- the matrix on small trees whose shape moves between releases ------------------------------


class RaisesOnNewShape(Codemod):
    target = "mod.py"
    anchor = (cls("Builder"),)
    patched = (cls("Builder"), func("other", leading_lines=marked("P2")))

    def rewrite(self, node):
        if "upstream_helper" in str(node.body.body):
            raise ValueError("shape moved")
        (method,) = statements("def other(self):\n    return 2\n")
        return node.with_changes(body=node.body.with_changes(body=[*node.body.body, with_marker(method, "P2", "t")]))


def _patch(pid, edits):
    return type(pid, (Patch,), {"id": pid, "family": "t", "title": pid, "why": pid, "edits": edits, "source_file": __file__})()


SOURCES = {
    "0.1.0": "class Builder:\n    support = 1\n",
    "0.2.0": "class Builder:\n    support = 1\n",
    "0.3.0": "class Builder:\n    def upstream_helper(self):\n        return 1\n",
}


class FakeWheel:
    def __init__(self, root: Path, version: Version):
        self.root, self.version = root, version

    def describe(self) -> str:
        return f"test tree {self.version}"

    def fetch(self) -> SourceTree:
        base = self.root / str(self.version)
        (base / "vllm").mkdir(parents=True, exist_ok=True)
        (base / "vllm" / "mod.py").write_text(textwrap.dedent(SOURCES[str(self.version)]))
        return SourceTree(base, self.version, f"test:{self.version}", f"tree {self.version}")


class Progress(Reporter):
    """Keeps what the train reports: its task and each update and advance."""

    def __init__(self) -> None:
        self.events: list[tuple] = []

    @contextmanager
    def task(self, description, total=None, unit="bytes"):
        events = self.events
        events.append(("task", description, total, unit))

        class Recorded(Task):
            def advance(self, amount):
                events.append(("advance", amount))

            def update(self, total=None, description=None):
                events.append(("update", description))

        yield Recorded()


@pytest.fixture
def matrix(tmp_path):
    catalogue = Catalogue(Path("."), {p.id: p for p in (_patch("P1", (AddHelper,)), _patch("P2", (RaisesOnNewShape,)))}, {"P1": "1", "P2": "2"})
    progress = Progress()
    result = run_train(
        catalogue,
        [V("0.3.0"), V("0.1.0"), V("0.2.0")],  # any order: the train runs them oldest first
        lambda version: FakeWheel(tmp_path / "src", version),
        memo=VerdictMemo(tmp_path / "cache"),
        reporter=progress,
    )
    return result, progress.events, catalogue


def test_train_gives_a_patch_by_release_matrix(matrix):
    result, calls, _ = matrix
    assert result.labels == ["vllm-0.1.0", "vllm-0.2.0", "vllm-0.3.0"]
    assert {(pid, label): result.verdict(pid, label) for pid in result.patch_ids for label in result.labels} == {
        ("P1", "vllm-0.1.0"): "APPLIES",
        ("P1", "vllm-0.2.0"): "APPLIES",
        ("P1", "vllm-0.3.0"): "UPSTREAM",
        ("P2", "vllm-0.1.0"): "APPLIES",
        ("P2", "vllm-0.2.0"): "APPLIES",
        ("P2", "vllm-0.3.0"): "DRIFTED",  # its rewrite raised: a verdict, the train goes on
    }
    assert result.outcomes["vllm-0.3.0"]["P1"].detail == "AddHelper: upstream shape present in mod.py:2"
    assert result.outcomes["vllm-0.3.0"]["P2"].detail == "RaisesOnNewShape: mod.py:1: rewrite raised ValueError: shape moved"
    assert result.changes("P1") == [("vllm-0.2.0", "vllm-0.3.0", "APPLIES", "UPSTREAM")]
    assert calls == [("task", "release train", 3, "items"),
                     ("update", "verify vllm-0.1.0"), ("advance", 1),
                     ("update", "verify vllm-0.2.0"), ("advance", 1),
                     ("update", "verify vllm-0.3.0"), ("advance", 1)]
    assert result.to_json()["patches"]["P2"]["vllm-0.3.0"]["verdict"] == "DRIFTED"


def test_a_rerun_comes_from_the_verdict_memo(matrix, tmp_path):
    _, _, catalogue = matrix

    class Unfetchable(FakeWheel):
        def fetch(self):
            tree = super().fetch()
            (tree.package / "mod.py").write_text("syntax error here (\n")  # would not parse if read
            return tree

    again = run_train(
        catalogue, [V("0.1.0")], lambda v: Unfetchable(tmp_path / "src", v), memo=VerdictMemo(tmp_path / "cache")
    )
    assert again.verdict("P1", "vllm-0.1.0") == "APPLIES"  # same tree identity: memo, no parse


def test_train_record_round_trip_and_comparison(matrix, tmp_path):
    result, _, _ = matrix
    record = tmp_path / "release-train.toml"
    record.write_text('# reviewed\n\n["vllm-0.9.0"]\nP1 = "GATED"\n\n["vllm-0.2.0"]\nP1 = "DRIFTED"\n')
    assert compare_with_record(result, record)["vllm-0.2.0"][0].__dict__ == {
        "patch_id": "P1", "expected": "DRIFTED", "actual": "APPLIES"
    }
    assert set(compare_with_record(result, record)) == {"vllm-0.1.0", "vllm-0.2.0", "vllm-0.3.0"}  # unrecorded
    record.write_text(accepted_train_text(record, result))
    assert compare_with_record(result, record) == {}
    tables = load_record(record)
    assert list(tables) == ["vllm-0.1.0", "vllm-0.2.0", "vllm-0.3.0", "vllm-0.9.0"]  # by release, others kept
    assert tables["vllm-0.3.0"] == {"P1": "UPSTREAM", "P2": "DRIFTED"}
    assert record.read_text().startswith("# The release train")


def test_release_label_matches_verify_vllm():
    assert release_label(V("0.33.0")) == "vllm-0.33.0"


def test_a_release_recorded_only_in_the_train_is_compared_with_the_train(tmp_path):
    from kiln.verify import record_for

    record, train = tmp_path / "verdicts.toml", tmp_path / "release-train.toml"
    record.write_text('["v0.20.1"]\nP1 = "APPLIES"\n["vllm-0.34.0"]\nP1 = "APPLIES"\n')
    train.write_text('["vllm-0.21.0"]\nP1 = "UPSTREAM"\n["vllm-0.34.0"]\nP1 = "UPSTREAM"\n')
    assert record_for("vllm-0.21.0", record, train) == train  # in the train only
    assert record_for("vllm-0.34.0", record, train) == record  # a candidate in the verdict record wins
    assert record_for("v0.20.1", record, train) == record  # a pin
    assert record_for("vllm-0.22.0", record, train) == record  # nowhere: --accept records a candidate
    assert record_for("vllm-0.21.0", record, None) == record  # --pin: the train is not consulted
    assert record_for("vllm-0.21.0", record, tmp_path / "absent.toml") == record
    train.write_text('["vllm-0.21.0"]\nP1 = "NOPE"\n')
    with pytest.raises(KilnError, match="vllm-0.21.0.P1: 'NOPE' is not a verdict"):
        record_for("vllm-0.21.0", record, train)  # a broken train fails before any fetch
