"""What a new user meets first: ``apply``'s --out check, ``verify``'s summary line, the progress bar.

Each checks the behaviour the user saw go wrong: ``apply`` with a taken ``--out`` patched for
seconds before refusing; ``verify`` printed a table and no verdict line; the download progress
bar lost its byte figures on an 80-column terminal.
"""

from __future__ import annotations

import io
import re

import pytest
from rich.console import Console

from kiln import paths
from kiln.commands import verify as verify_command
from kiln.commands.output import Output
from tests.support.cli import run

# releases' wheels from PyPI on a machine whose kiln cache lacks them (tests/conftest.py keeps this true)
pytestmark = pytest.mark.network


@pytest.mark.isolated
def test_apply_refuses_a_taken_out_before_fetching_or_patching(tmp_path, capsys, monkeypatch):
    taken = tmp_path / "out"
    taken.mkdir()
    (taken / "mine.txt").write_text("keep me\n")
    fetched = []
    monkeypatch.setattr(verify_command.checks, "choose_source",
                        lambda *a, **k: fetched.append(a) or pytest.fail("fetched"))
    code, out, err = run(capsys, "apply", "--pin", "v0.20.1", "--out", taken)
    assert code == 2 and out == ""
    assert err.strip() == f"error: --out {taken}: already exists (use --force to replace it)"
    assert fetched == []  # no source was chosen, fetched or patched
    assert (taken / "mine.txt").read_text() == "keep me\n"
    assert not list((tmp_path / "kiln-cache").glob("sources*"))


def test_verify_ends_with_a_summary_equal_to_the_record(capsys):
    code, out, _ = run(capsys, "verify", "--pin", "v0.20.1")
    assert code == 0
    last = out.strip().splitlines()[-1]
    assert re.fullmatch(r"\d+ patches on v0\.20\.1: \d+ APPLIES(, \d+ [A-Z_]+)*; equal to the record", last), last
    total = int(last.split()[0])
    assert total == sum(int(n) for n in re.findall(r"(\d+) [A-Z_]+", last.split(":", 1)[1]))


def test_verify_summary_without_equal_when_the_record_differs(tmp_path, capsys):
    record = tmp_path / "verdicts.toml"
    text = paths.RECORD.read_text()
    section = text.index('["v0.20.1"]')
    record.write_text(text[:section] + text[section:].replace('P65 = "APPLIES"', 'P65 = "UPSTREAM"', 1))
    code, out, err = run(capsys, "--record", record, "verify", "--pin", "v0.20.1")
    assert code == 1
    last = out.strip().splitlines()[-1]
    assert re.fullmatch(r"\d+ patches on v0\.20\.1: \d+ APPLIES(, \d+ [A-Z_]+)*", last), last
    assert "1 verdict(s) differ from" in err and "P65 UPSTREAM -> APPLIES" in err


@pytest.mark.parametrize("description", [
    "download vllm-0.20.1-cp38-abi3-manylinux_2_31_x86_64.whl",  # the longest a user sees
    "fetching Triton 3.6.0 (cp311)",
    "layer 0123456789ab",
])
def test_progress_line_keeps_its_byte_figures_at_80_columns(description):
    output = Output()
    output.stderr = Console(file=io.StringIO(), width=80, force_terminal=True, color_system=None)
    reporter = output.reporter()
    screen = Console(file=io.StringIO(), width=80, color_system=None)
    with reporter.task(description, total=250 * 2**20) as task:
        task.advance(100 * 2**20)
        screen.print(reporter._progress.get_renderable())
    [line] = [line for line in screen.file.getvalue().splitlines() if line.strip()]
    assert len(line) <= 80
    assert re.search(r"104\.9/262\.1 MB", line), line  # done / total
    assert re.search(r"MB (\?|[\d.]+ [kMG]?B/s) ", line), line  # the speed column follows (? until measured)
    assert description[:20] in line
