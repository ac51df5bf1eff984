"""``bench --evidence/--plot``: checked before the first request like every output of kiln's
(``kiln.publish.destinations``): never an input kiln reads, never a FIFO or device, never one
path twice."""

from __future__ import annotations

import os

import pytest

from kiln.commands import main

pytestmark = [pytest.mark.reliability, pytest.mark.isolated]

QUICK = ["--runs", "1", "--warmup", "0", "--prompts", "short-prose", "--battery-runs", "0", "--only", "speed"]


@pytest.mark.parametrize("case", ["--evidence the pins file", "--evidence a FIFO", "--evidence and --plot one file"])
def test_bench_outputs_are_refused_before_the_first_request(serve, capsys, tmp_path, case):
    """The pins file used to be replaced by the evidence after the whole measurement; a FIFO
    blocked the command forever once measured."""
    server = serve(tokens=4)
    pins = tmp_path / "pins.toml"
    pins.write_text("[pins]\n")
    os.mkfifo(tmp_path / "fifo")
    argv, expected = {
        "--evidence the pins file": (["--evidence", str(pins)], f"--evidence {pins}: is kiln's pins file (an input)"),
        "--evidence a FIFO": (["--evidence", str(tmp_path / "fifo")], "is a FIFO, not a regular file"),
        "--evidence and --plot one file": (["--evidence", str(tmp_path / "a.png"), "--plot", str(tmp_path / "a.png")],
                                           "two outputs of one command cannot write the same place"),
    }[case]
    reader = os.open(tmp_path / "fifo", os.O_RDONLY | os.O_NONBLOCK)  # so a write into it (today's) cannot hang
    try:
        code = main(["--pins", str(pins), "bench", server.url, *QUICK, *argv])
    finally:
        os.close(reader)
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and expected in err, err
    assert server.log == []  # before any request
    assert pins.read_text() == "[pins]\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo", "pins.toml"]


def test_evidence_is_written_whole_or_not_at_all(serve, capsys, tmp_path):
    """Written with ``write_atomic``: no staging file left beside it, the previous file replaced."""
    server = serve(tokens=4)
    evidence = tmp_path / "bench.json"
    evidence.write_text("previous\n")
    assert main(["bench", server.url, *QUICK, "--evidence", str(evidence)]) == 0
    assert evidence.read_text().startswith("{")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.json"]
