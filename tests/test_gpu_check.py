"""The CPU-side pieces of ``ci/gpu_check.py`` (the GPU part needs a GPU; CI has none)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

SCRIPT = Path(__file__).resolve().parent.parent / "ci" / "gpu_check.py"
spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
gpu_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_check)
import gpu_reference  # noqa: E402  (ci/, on the tests' path: tests/__init__.py)


def test_dequantise_k8v4_reads_the_store_layout():
    d, gen = 8, torch.Generator().manual_seed(1)
    key = torch.randn(3, d, generator=gen).to(torch.float8_e4m3fn)
    q = torch.randint(0, 16, (3, d), generator=gen)
    scale = torch.tensor([0.5, 0.25, 2.0], dtype=torch.float16)
    zero = torch.tensor([-1.0, 0.75, -3.5], dtype=torch.float16)
    packed = (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8)
    slot = torch.cat([key.view(torch.uint8), packed, scale[:, None].view(torch.uint8),
                      zero[:, None].view(torch.uint8), torch.zeros(3, 2, dtype=torch.uint8)], dim=1)
    got_key, got_value = gpu_reference.dequantise_k8v4(slot, d)
    assert torch.equal(got_key, key.float())
    assert torch.equal(got_value, q.float() * scale.float()[:, None] + zero.float()[:, None])


def test_reference_decode_is_grouped_query_attention():
    gen = torch.Generator().manual_seed(2)
    query = torch.randn(2, 6, 16, generator=gen)
    keys, values = torch.randn(2, 5, 2, 16, generator=gen), torch.randn(2, 5, 2, 16, generator=gen)
    want = F.scaled_dot_product_attention(query[:, :, None], keys.transpose(1, 2), values.transpose(1, 2),
                                          scale=0.25, enable_gqa=True)[:, :, 0]
    got = gpu_reference.reference_decode(query, keys, values, 0.25)
    assert torch.allclose(got, want, atol=1e-5)


def test_gpu_side_refuses_a_machine_without_cuda(tmp_path):
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"sm": 90}))
    proc = subprocess.run([sys.executable, str(SCRIPT), "--gpu-job", str(job)], capture_output=True, text=True,
                          env={"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 2
    assert "no CUDA device" in proc.stderr


# -- the served-model step (ci/gpu_serve.py): everything but the GPU ------------------------------

import gpu_serve  # noqa: E402  (ci/, on the tests' path)

REPO = SCRIPT.parent.parent

# A stand-in `vllm` whose api_server serves tests/bench's fake OpenAI server on --port, and
# reports in /version whether it sees the patched parser (the overlay) or the stock one.
API_SERVER = '''
import sys
from tests.bench.fake_openai import Behaviour, FakeOpenAI
from tests.bench.conftest import ANSWERS
import vllm.tool_parsers.demo as demo

argv = sys.argv
port = int(argv[argv.index("--port") + 1])
name = argv[argv.index("--served-model-name") + 1]
patched = "# kiln P64" in open(demo.__file__).read()
server = FakeOpenAI(Behaviour(models=(name,), answers=ANSWERS, tokens=12,
                              version="0.20.1" + ("+patched" if patched else "")), port=port)
server.httpd.serve_forever()
'''


def stand_in_vllm(root: Path) -> Path:
    """``root/site/vllm`` (the installed, stock one) and ``root/patched`` (an apply --out tree)."""
    site = root / "site"
    for package in ("vllm", "vllm/entrypoints", "vllm/entrypoints/openai", "vllm/tool_parsers"):
        (site / package).mkdir(parents=True)
        (site / package / "__init__.py").write_text("")
    (site / "vllm" / "__init__.py").write_text('__version__ = "0.20.1"\n')
    (site / "vllm/entrypoints/openai/api_server.py").write_text(API_SERVER)
    (site / "vllm/tool_parsers/demo.py").write_text("def parse():\n    return 1\n")
    (site / "vllm/_C.abi3.so").write_bytes(b"\x7fELF stand-in")
    patched = root / "patched"
    shutil.copytree(site / "vllm", patched / "vllm")
    (patched / "vllm/tool_parsers/demo.py").write_text("def parse():\n    # kiln P64: held\n    return 2\n")
    report = {"vllm_version": "0.20.1", "files": {"tool_parsers/demo.py": {"before": "x", "after": "y"}},
              "patches": [{"patch": "P64", "verdict": "APPLIES", "detail": ""},
                          {"patch": "P4", "verdict": "UPSTREAM", "detail": ""}]}
    (patched / "kiln-report.json").write_text(json.dumps(report))
    return site


def hf_model(hub: Path, name: str, weights: int, model_type: str = "qwen3", safetensors: bool = True) -> Path:
    """A model laid out as the Hugging Face cache does: snapshot files linking to blobs."""
    repo = hub / ("models--" + name.replace("/", "--"))
    blobs, snapshot = repo / "blobs", repo / "snapshots" / "0123abc"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    files = {"config.json": json.dumps({"model_type": model_type}).encode(),
             ("model.safetensors" if safetensors else "model.bin"): b"w" * weights}
    for file_name, data in files.items():
        blob = blobs / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / file_name).symlink_to(blob)
    return snapshot


def test_the_smallest_cached_model_is_chosen(tmp_path):
    hf_model(tmp_path / "hub", "Qwen/Qwen3-1.7B", 5000)
    small = hf_model(tmp_path / "hub", "Qwen/Qwen3-0.6B", 3000)
    hf_model(tmp_path / "hub", "Old/pickled-only", 10, safetensors=False)
    models = gpu_serve.find_models(tmp_path)
    assert [m.name for m in models] == ["Qwen/Qwen3-0.6B", "Qwen/Qwen3-1.7B"]
    chosen = gpu_serve.choose_model(None, tmp_path)
    assert chosen.path == small and chosen.model_type == "qwen3" and chosen.size > 3000
    with pytest.raises(gpu_serve.StepError, match=r"no model in the Hugging Face cache .*: pass --model DIR"):
        gpu_serve.choose_model(None, tmp_path / "empty")
    with pytest.raises(gpu_serve.StepError, match=r"--model .*: no config.json and \*.safetensors there"):
        gpu_serve.choose_model(tmp_path, tmp_path)


def test_the_serve_command_and_environment(tmp_path):
    model = gpu_serve.LocalModel(tmp_path, "Qwen/Qwen3-0.6B", 1, "qwen3")
    command = gpu_serve.serve_command("/py", model, 8123, 0.4, ["--enforce-eager"])
    assert command[:3] == ["/py", "-m", "vllm.entrypoints.openai.api_server"]
    assert command[command.index("--port") + 1] == "8123" and command[command.index("--model") + 1] == str(tmp_path)
    assert command[command.index("--gpu-memory-utilization") + 1] == "0.40"
    assert command[command.index("--tool-call-parser") + 1] == "hermes"
    assert command[command.index("--reasoning-parser") + 1] == "qwen3" and command[-1] == "--enforce-eager"
    other = gpu_serve.serve_command("/py", gpu_serve.LocalModel(tmp_path, "x", 1, "gpt2"), 1, 0.85, [])
    assert "--tool-call-parser" not in other and "--enable-auto-tool-choice" not in other
    env = gpu_serve.serve_env({"PYTHONPATH": "/a", "HOME": "/h"}, tmp_path / "overlay")
    assert env["PYTHONPATH"] == f"{tmp_path / 'overlay'}{os.pathsep}/a" and env["VLLM_NO_USAGE_STATS"] == "1"
    assert "PYTHONPATH" not in gpu_serve.serve_env({}, None)


def test_the_overlay_links_the_installed_vllm_and_replaces_only_patched_files(tmp_path):
    site = stand_in_vllm(tmp_path)
    changed = gpu_serve.build_overlay(site / "vllm", tmp_path / "patched", tmp_path / "overlay")
    assert changed == ["tool_parsers/demo.py"]
    overlay = tmp_path / "overlay" / "vllm"
    assert (overlay / "_C.abi3.so").is_symlink() and (overlay / "_C.abi3.so").resolve() == site / "vllm/_C.abi3.so"
    assert not (overlay / "tool_parsers/demo.py").is_symlink()
    assert "# kiln P64" in (overlay / "tool_parsers/demo.py").read_text()
    assert "kiln" not in (site / "vllm/tool_parsers/demo.py").read_text()  # the installed one is untouched


def test_an_overlay_for_another_vllm_version_is_refused(tmp_path):
    site = stand_in_vllm(tmp_path)
    report = json.loads((tmp_path / "patched/kiln-report.json").read_text())
    (tmp_path / "patched/kiln-report.json").write_text(json.dumps({**report, "vllm_version": "0.33.0"}))
    env = {**os.environ, "PYTHONPATH": str(site)}
    with pytest.raises(gpu_serve.StepError, match=r"patches vLLM 0.33.0, but .* has vLLM 0.20.1"):
        gpu_serve.prepare_overlay(sys.executable, tmp_path / "patched", tmp_path / "overlay", env)


def test_an_images_manifest_is_checked_against_the_files_on_disk(tmp_path):
    patched = tmp_path / "usr/lib/vllm/x.py"
    patched.parent.mkdir(parents=True)
    patched.write_text("patched\n")
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps({
        "image": "qwen3.6-27b-tq", "pin": {"name": "v0.20.1"}, "base": {"reference": "vllm/vllm-openai:v0.20.1"},
        "patches": [{"patch": "P64", "verdict": "APPLIES"}],
        "files": {str(patched): {"before": None, "after": hashlib.sha256(b"patched\n").hexdigest()}}}))
    found = gpu_serve.verify_manifest(manifest)
    assert found["patches"] == ["P64"] and found["files_verified"] == 1 and found["image"] == "qwen3.6-27b-tq"
    patched.write_text("stock\n")
    with pytest.raises(gpu_serve.StepError, match=r"1 patched file\(s\) differ on disk, e\.g\. .*x\.py"):
        gpu_serve.verify_manifest(manifest)


def test_the_step_serves_patched_and_stock_benches_them_and_records_the_result(tmp_path, monkeypatch):
    """The whole step on CPU: the stand-in vLLM serves the fake OpenAI server, twice."""
    site = stand_in_vllm(tmp_path)
    model = hf_model(tmp_path / "hub", "Qwen/Qwen3-0.6B", 100)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), str(REPO)]))
    benchmarks = tmp_path / "BENCHMARKS.md"
    benchmarks.write_text("# Benchmarks\n\n<!-- bench:served -->\nold\n<!-- /bench:served -->\n\ntail\n")
    import benchlib

    monkeypatch.setattr(benchlib, "BENCHMARKS", benchmarks)
    evidence = tmp_path / "evidence.json"
    code = gpu_check.main(["--step", "serve", "--model", str(model), "--overlay", str(tmp_path / "patched"),
                           "--against-stock", "--runs", "2", "--concurrency", "1,2", "--battery-runs", "1",
                           "--evidence", str(evidence), "--ready-timeout", "60"])
    assert code == 0
    data = json.loads(evidence.read_text())
    patched, stock = data["endpoints"]
    assert patched["server_version"] == "0.20.1+patched" and stock["server_version"] == "0.20.1"
    assert patched["model"] == stock["model"] == gpu_serve.SERVED_NAME
    assert data["served"]["patched"]["patches"] == ["P64"]
    assert data["served"]["model"] == {"name": "Qwen/Qwen3-0.6B", "path": str(model), "size": 100 + len('{"model_type": "qwen3"}'),
                                       "model_type": "qwen3"}
    assert data["speed"]["failed_requests"] == 0 and len(data["speed"]["samples"]) == 2 * (6 + 2 * 6 * 3)
    assert data["battery"]["clean"]["A"]["total"] == 8
    text = benchmarks.read_text()
    assert "old" not in text and text.endswith("\n\ntail\n")
    assert "## served model (issue 15)" in text and "| concurrency | metric | kiln-patched | stock | change | verdict |" in text
    assert "| 2 | throughput |" in text and "| all | 8/8 | 8/8 |" in text
    commands = data["served"]["commands"]
    assert commands["A"][commands["A"].index("--tool-call-parser") + 1] == "hermes"


def test_the_step_refuses_a_machine_without_a_patched_vllm(tmp_path, capsys):
    model = hf_model(tmp_path / "hub", "Qwen/Qwen3-0.6B", 100)
    code = gpu_check.main(["--step", "serve", "--model", str(model), "--manifest", str(tmp_path / "none.json")])
    assert code == 2
    assert capsys.readouterr().err.startswith("gpu_check: no kiln-patched vLLM: run inside a kiln image")
    assert gpu_check.main(["--step", "serve", "--model", str(model), "--against-stock"]) == 2


SERVER_PARENT = """
import os, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import gpu_serve
server = gpu_serve.Server([sys.executable, "-c", "import time; time.sleep(600)", "--port", "1"], dict(os.environ),
                          Path(sys.argv[2]))
print(server.process.pid, flush=True)
time.sleep(600)
"""


def _running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    return stat.rpartition(b")")[2].split()[0] != b"Z"


@pytest.mark.reliability
def test_the_served_model_dies_with_a_killed_check(tmp_path):
    """The ``vllm serve`` process (here a sleeper in its place) runs in a session of its own, so a
    SIGKILLed check could not stop it: the kernel does (``kiln/lifeline.py``), within 2 s."""
    import signal
    import time

    parent = subprocess.Popen([sys.executable, "-c", SERVER_PARENT, str(SCRIPT.parent), str(tmp_path / "log")],
                              cwd=REPO, stdout=subprocess.PIPE, text=True)
    server = int(parent.stdout.readline())
    try:
        assert _running(server)
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=30)
        deadline = time.monotonic() + 2.0
        while _running(server) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _running(server), "the server outlived its killed check by 2 s"
    finally:
        if _running(server):
            os.kill(server, signal.SIGKILL)
