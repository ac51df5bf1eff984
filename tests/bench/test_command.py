"""``build.py bench`` end to end through ``kiln.commands.main``, against real fake servers."""

from __future__ import annotations

import json
import sys

import pytest

from kiln.bench.battery import CASES
from kiln.bench.prompts import PROMPT_SET_VERSION, prompt_set_sha256, select_prompts
from kiln.commands import main

DIGEST = "sha256:" + "ab" * 32
QUICK = ["--runs", "3", "--warmup", "1", "--prompts", "short-prose,gen-code", "--battery-runs", "1"]


def run_json(capsys, *argv) -> tuple[int, dict]:
    code = main(["bench", *argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_json_evidence_records_what_ran_and_every_sample(serve, capsys):
    server = serve(tokens=12)
    image = f"docker.io/kiln/vllm-qwen3.6-27b-tq@{DIGEST}"
    code, data = run_json(capsys, server.url, *QUICK, "--image", image)
    assert code == 0
    (endpoint,) = data["endpoints"]
    assert endpoint["url"] == server.url and endpoint["model"] == "fake-model"
    assert endpoint["server_version"] == "0.20.1+fake"
    assert endpoint["image"] == {"reference": image, "digest": DIGEST}
    assert data["prompt_set"]["version"] == PROMPT_SET_VERSION
    assert data["prompt_set"]["sha256"] == prompt_set_sha256(select_prompts(["short-prose", "gen-code"]))
    machine = data["machine"]
    assert machine["hostname"] and machine["os"] and machine["cpu"] and isinstance(machine["gpus"], list)
    samples = data["speed"]["samples"]
    assert len(samples) == 2 + 3 * 2 == len(server.posts()) - len(CASES)
    assert sum(s["phase"] == "warmup" for s in samples) == 2
    assert all(s["ok"] and s["completion_tokens"] == 12 and len(s["chunk_offsets"]) == 12 for s in samples)
    figures = {(f["prompt"], f["metric"]): f for f in data["speed"]["figures"]}
    tps = [s["wall_tps"] for s in samples if s["phase"] == "measure" and s["prompt"] == "gen-code"]
    summary = figures[("gen-code", "wall_tps")]["summaries"]["A"]
    assert summary["n"] == 3 and summary["mean"] == pytest.approx(sum(tps) / 3, abs=1e-5)
    assert "comparison" not in figures[("overall", "ttft")]
    assert data["battery"]["clean"]["A"]["clean"] == len(CASES) == data["battery"]["clean"]["A"]["total"]
    assert len(data["battery"]["attempts"]) == len(CASES)


def test_against_gives_a_verdict_per_metric(serve, capsys):
    fast = serve(ttft_cycle=(0.02, 0.04), delay_cycle=(0.002, 0.004), tokens=15)
    slow = serve(ttft_cycle=(0.02, 0.04), delay_cycle=(0.010, 0.014), tokens=15, tool_mode="p64")
    code, data = run_json(capsys, fast.url, "--against", slow.url, *QUICK, "--concurrency", "1,2",
                          "--against-image", "vllm/vllm-openai:v0.20.1")
    assert code == 0  # URL's tool calls are clean; URL2's are not, which is the point of comparing
    assert data["compared"] == "A against B"
    assert data["endpoints"][1]["image"] == {"reference": "docker.io/vllm/vllm-openai:v0.20.1", "digest": None}
    figures = {(f["concurrency"], f["prompt"], f["metric"]): f for f in data["speed"]["figures"]}
    assert figures[(1, "overall", "wall_tps")]["comparison"]["verdict"] == "better"
    assert figures[(2, "overall", "throughput")]["comparison"]["verdict"] == "better"
    assert figures[(1, "overall", "tpot")]["comparison"]["verdict"] == "better"
    assert (1, "overall", "throughput") not in figures
    assert figures[(1, "overall", "wall_tps")]["comparison"]["confidence"] == 0.95
    clean = data["battery"]["clean"]
    assert clean["A"]["clean"] == len(CASES) and clean["B"]["clean"] == 1


def test_dirty_tool_calls_of_url_exit_1(serve, capsys):
    server = serve(tool_mode="leak")
    code = main(["bench", server.url, "--only", "battery", "--cases", "weather,timer-integer-last",
                 "--battery-runs", "2"])
    captured = capsys.readouterr()
    assert code == 1
    assert "4 tool call(s) of " + server.url + " were not clean" in captured.err
    assert "0/2" in captured.out and "leaked into content" in captured.out


def test_tables_evidence_file_and_plot(serve, capsys, tmp_path):
    a, b = serve(tokens=10), serve(tokens=10)
    evidence, plot = tmp_path / "out" / "bench.json", tmp_path / "bench.png"
    code = main(["bench", a.url, "--against", b.url, *QUICK, "--only", "speed",
                 "--evidence", str(evidence), "--plot", str(plot)])
    out = capsys.readouterr().out
    assert code == 0
    assert f"A {a.url} against B {b.url} at concurrency 1" in out
    assert "Welch's t-test at 95%" in out and "verdict" in out and "overall" in out
    data = json.loads(evidence.read_text())
    assert data["battery"] is None and len(data["speed"]["samples"]) == 2 * (2 + 3 * 2)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_fails_in_one_line_before_measuring(serve, capsys, monkeypatch, tmp_path):
    server = serve()
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    code = main(["bench", server.url, "--plot", str(tmp_path / "x.png")])
    assert code == 2
    assert error_line(capsys) == "error: --plot needs matplotlib, which is not installed (pip install 'kiln[plot]')"
    assert server.log == []


def test_a_dropped_stream_is_reported_and_the_run_kept(serve, capsys):
    server = serve(tokens=20, drop_requests=frozenset({4}), drop_after_chunks=5)
    code, data = run_json(capsys, server.url, *QUICK, "--only", "speed")
    assert code == 1
    failed = [s for s in data["speed"]["samples"] if not s["ok"]]
    assert len(failed) == 1 and failed[0]["error"] == "the stream broke off after 6 chunk(s), before [DONE]"
    assert data["speed"]["failed_requests"] == 1
    assert len(data["speed"]["samples"]) == 8  # the run went on


def test_an_endpoint_that_is_not_openai_compatible_is_refused_in_one_line(serve, capsys):
    server = serve(models_status=404, models_body="<html>Not Found</html>")
    assert main(["bench", server.url]) == 2
    assert error_line(capsys) == (
        f"error: {server.url}: not an OpenAI-compatible endpoint (GET /v1/models answered HTTP 404)")
    good = serve()
    assert main(["bench", good.url, "--against", server.url]) == 2
    assert server.url in error_line(capsys)
    assert good.posts() == []  # nothing measured before both endpoints answered


@pytest.mark.parametrize("argv, message", [
    (["--concurrency", "1,x"], "--concurrency '1,x': expected positive integers separated by commas, e.g. 1,2,4"),
    (["--runs", "0"], "--runs 0: at least 1 (2 or more for CV and a verdict)"),
    (["--extra-body", "[1]"], "--extra-body: must be a JSON object, e.g. '{\"ignore_eos\": true}'"),
    (["--confidence", "95"], "--confidence 95.0: a fraction between 0.5 and 1, e.g. 0.95"),
    (["--prompts", "poem"], "--prompts: unknown prompt 'poem'"),
    (["--image", "Not A Reference"], "--image 'Not A Reference': "),
    (["--against-image", "vllm/vllm-openai:v0.20.1"], "--against-image / --against-model need --against URL2"),
])
def test_bad_options_are_one_line_errors(serve, capsys, argv, message):
    server = serve()
    assert main(["bench", server.url, *argv]) == 2
    assert error_line(capsys).startswith(f"error: {message}")
    assert server.posts() == []


def test_an_unknown_option_is_an_argparse_error():
    with pytest.raises(SystemExit) as caught:
        main(["bench", "http://127.0.0.1:1", "--no-such-option"])
    assert caught.value.code == 2
