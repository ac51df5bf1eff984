"""``--progress``: bars on a terminal, one plain line per finished stage in logs, or nothing.

A first build took 77 s and printed nothing until its result when stderr was a CI log: now a
build whose stderr is not a terminal prints each stage (resolve, pull, patch, bake, publish)
and each transfer with its bytes and seconds, as BuildKit's ``--progress=plain`` does.
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys

import pytest
from rich.console import Console

from kiln import paths
from kiln.commands.output import Output, PlainReporter, RichReporter
from tests.support.cli import one_line_error, run
from tests.support.registry import VLLM_VERSION

SECONDS = r"\d+\.\d\ds"


def _captured(progress: str, terminal: bool = False) -> Output:
    output = Output(progress=progress)
    output.stderr = Console(file=io.StringIO(), width=200, force_terminal=terminal, color_system=None)
    return output


def test_plain_lines_say_what_how_many_bytes_and_how_long():
    output = _captured("plain")
    reporter = output.reporter()
    assert isinstance(reporter, PlainReporter)
    with reporter.task("pull 0123456789ab", total=3 * 2**20) as task:
        task.advance(2**20)
        task.advance(2 * 2**20)
    with reporter.task("release train", total=2, unit="items") as task:
        task.advance(1)
    with reporter.status("compiling Triton kernels for sm_120"):
        pass
    reporter.stage("pull", 1.5, 3145728)
    reporter.stage("patch", 0.25)
    reporter.warn("pin v0.20.1 is unlocked")
    lines = output.stderr.file.getvalue().splitlines()
    assert len(lines) == 6, lines
    assert re.fullmatch(rf"pull 0123456789ab: 3145728 bytes \(3\.0 MiB\) in {SECONDS}", lines[0]), lines[0]
    assert re.fullmatch(rf"release train: 1 done in {SECONDS}", lines[1]), lines[1]
    assert re.fullmatch(rf"compiling Triton kernels for sm_120: done in {SECONDS}", lines[2]), lines[2]
    assert lines[3] == "stage pull: 3145728 bytes (3.0 MiB) in 1.50s"
    assert lines[4] == "stage patch: 0.25s"
    assert lines[5] == "warning: pin v0.20.1 is unlocked"
    assert reporter.warnings == ["pin v0.20.1 is unlocked"]


def test_a_failed_transfer_prints_no_line_of_its_own():
    output = _captured("plain")
    reporter = output.reporter()
    with pytest.raises(OSError), reporter.task("pull 0123456789ab", total=10) as task:
        task.advance(4)
        raise OSError("connection reset")
    assert output.stderr.file.getvalue() == ""


@pytest.mark.parametrize(("progress", "terminal", "kind", "bars"), [
    ("auto", False, PlainReporter, None),   # a log
    ("auto", True, RichReporter, True),     # a terminal
    ("plain", True, PlainReporter, None),
    ("tty", True, RichReporter, True),
    ("quiet", True, RichReporter, False),
    ("quiet", False, RichReporter, False),
])
def test_the_mode_chooses_the_reporter(progress, terminal, kind, bars):
    reporter = _captured(progress, terminal).reporter()
    assert type(reporter) is kind
    if bars is not None:
        assert reporter.enabled is bars


def test_tty_forces_bars_outside_a_terminal():
    assert Output(progress="tty").stderr.is_terminal


def test_quiet_still_warns():
    output = _captured("quiet")
    reporter = output.reporter()
    with reporter.task("pull x", total=1) as task:
        task.advance(1)
    reporter.stage("pull", 1.0, 1)
    reporter.note("a note")
    reporter.warn("careful")
    assert output.stderr.file.getvalue().splitlines() == ["warning: careful"]


def test_a_bad_kiln_progress_is_one_line(capsys, monkeypatch):
    monkeypatch.setenv("KILN_PROGRESS", "loud")
    code, out, err = run(capsys, "pin", "lock", "--json")
    assert code == 2 and out == ""
    assert one_line_error(err) == "error: KILN_PROGRESS='loud': not one of auto, plain, tty, quiet"


def test_every_long_command_takes_progress():
    from kiln.commands import build_parser

    parser = build_parser()
    for argv in (["build", "--image", "i", "--pin", "p", "--sm", "120"], ["context", "--image", "i", "--pin", "p",
                 "--sm", "120", "--out", "o"], ["values", "--image", "i", "--pin", "p", "--sm", "120"],
                 ["verify"], ["diff"], ["apply", "--out", "o"], ["pin", "lock"], ["pin", "bump", "--to", "0.33.0"],
                 ["bench", "http://127.0.0.1:1"]):
        assert parser.parse_args([*argv, "--progress", "plain"]).progress == "plain", argv


IMAGE = "e2e-progress"
DEFINITION = f"""
name = "{IMAGE}"
pins = ["v0.20.1"]
sms = [120]
tag = "{{cuda}}-sm{{sm}}-{{pin}}"
patches = ["P65"]

[model]
id = "Lorbus/Qwen3.6-27B-int4-AutoRound"
architectures = ["Qwen3_5ForConditionalGeneration"]
dtype = "float16"
kv_cache_dtype = "turboquant_k8v4"
"""


@pytest.mark.registry
def test_a_build_in_a_log_prints_its_stages_and_quiet_prints_none(tmp_path, registry_plain):
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / f"{IMAGE}.toml").write_text(DEFINITION)
    pins = tmp_path / "pins.toml"
    pins.write_text(f'[pins."v0.20.1"]\nrole = "current"\nimage = "docker.io/vllm/vllm-openai:v0.20.1"\n'
                    f'vllm = "{VLLM_VERSION}"\ncuda = "cu130"\n'
                    f'digest = "{registry_plain.digest_of(f"vllm/vllm-openai:v{VLLM_VERSION}")}"\n')
    env = {k: v for k, v in os.environ.items() if k != "KILN_PROGRESS"}  # auto, and stderr is a pipe

    def build(*extra: str) -> subprocess.CompletedProcess:
        argv = [sys.executable, "build.py", "--pins", str(pins), "--images", str(tmp_path / "images"), "build",
                "--image", IMAGE, "--pin", "v0.20.1", "--sm", "120", "--mirror", registry_plain.mirror,
                "--oci", str(tmp_path / "layout"), *extra]
        return subprocess.run(argv, cwd=paths.REPO, env=env, capture_output=True, text=True, timeout=300)

    first = build()
    assert first.returncode == 0, first.stderr
    lines = first.stderr.splitlines()
    stages = [line.split(":")[0].removeprefix("stage ") for line in lines if line.startswith("stage ")]
    assert stages == ["resolve", "pull", "patch", "bake", "publish"], first.stderr
    pull = next(line for line in lines if line.startswith("stage pull: "))
    match = re.fullmatch(rf"stage pull: (\d+) bytes \([\d.]+ (B|KiB|MiB|GiB)\) in {SECONDS}", pull)
    assert match and int(match.group(1)) > 0, pull  # a cold cache: the vLLM layers came over the wire
    layers = [line for line in lines if line.startswith("layer ")]
    assert layers and all(re.fullmatch(rf"layer [0-9a-f]{{12}}: \d+ bytes \(.+\) in {SECONDS}", x) for x in layers)
    assert sum(int(x.split(": ")[1].split()[0]) for x in layers) <= int(match.group(1))
    assert re.fullmatch(rf"stage bake: [1-9]\d* bytes \(.+\) in {SECONDS}", next(x for x in lines if "stage bake" in x))
    assert first.stdout.startswith("built ")

    quiet = build("--progress", "quiet")
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stderr == ""
    assert quiet.stdout.startswith("built ")
