"""ci/gpu_bundle.py and ci/gpu_pn119.py on CPU: what can be checked without a GPU.

- ``--bundle`` refuses a folder that holds anything and a file that is not a Triton RECORD,
  before any work; ``--run-bundle`` refuses a machine whose Triton is not the one keyed for.
- ``--run-bundle`` killed leaves nothing running: its GPU child (blocked in a stand-in ``torch``
  that sleeps, as a hung GPU step would) is gone 2 s after the parent's SIGKILL; SIGTERM also
  removes the runtime cache. The runtime cache a SIGKILL leaves is removed by the next run (and
  said), a live run's is refused, a folder with no owner file is refused and left as it was.
- PN119's GPU comparison, run under Triton's interpreter on real 0.33.0 source: the grouped
  decode matches stock on a GQA case (and gpu_check's k8v4 reference), and a grouped kernel with
  the classic head-mapping slip fails the same comparison (so the GPU run can fail).
- P103's GPU comparison (``ci/gpu_p103.py``'s child and verdict) likewise, on the ops packages a
  bundle holds (``write_packages``), tiny heads and 2-chunk windows: P103 equals stock exactly, and
  a windowed forward that does not carry each sequence's state into its next window fails it.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.patchsets.attention_turboquant.test_pn119 import KERNEL, _mutated
from tests.patchsets.support import tq_interpret as tq
from tests.patchsets.support.patchlib import patched_files
from tests.test_lifeline import _session

REPO = Path(__file__).resolve().parent.parent
GPU_CHECK = REPO / "ci" / "gpu_check.py"
CONFIG = "model_executor/layers/quantization/turboquant/config.py"
import gpu_p103  # noqa: E402  (ci/gpu_p103.py, on the tests' path: tests/__init__.py)

# P103's windowed forward: the line that carries each sequence's state into its next window
CARRY = "        states[rows] = part_final\n"


def _gpu_check(*args, cwd=REPO, env=None):
    return subprocess.run([sys.executable, str(GPU_CHECK), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env=env)


def test_a_bundle_folder_that_holds_anything_is_refused(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "mine.txt").write_text("keep")
    record = tmp_path / "RECORD"
    record.write_text("triton-3.6.0.dist-info/RECORD,,\ntriton/_C/libtriton.so,sha256=AAAA,1\n")
    proc = _gpu_check("--bundle", str(tmp_path / "b"), "--gpu-triton-record", str(record))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"gpu_check: --bundle {tmp_path / 'b'}: not a new or empty folder"]
    assert (tmp_path / "b" / "mine.txt").read_text() == "keep"


def test_a_record_that_is_not_tritons_is_refused(tmp_path):
    record = tmp_path / "RECORD"
    record.write_text("torch-2.11.0.dist-info/RECORD,,\n")
    proc = _gpu_check("--bundle", str(tmp_path / "b"), "--gpu-triton-record", str(record))
    assert proc.returncode == 2 and "not a Triton dist-info RECORD" in proc.stderr
    assert not (tmp_path / "b").exists()


def test_running_a_bundle_keyed_for_another_triton_is_refused(tmp_path):
    bundle = tmp_path / "b"
    bundle.mkdir()
    (bundle / "job.json").write_text(json.dumps({"triton": "0.0.1", "libtriton_sha256": "0" * 64}))
    proc = _gpu_check("--run-bundle", str(bundle))
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and "the bundle was keyed for 0.0.1" in proc.stderr


# A ``torch`` that stands for a GPU step that hangs: it says it started, then sleeps.
HANGING_TORCH = "import os, time\nopen(os.environ['KILN_TEST_READY'], 'w').close()\ntime.sleep(600)\n"


@pytest.fixture
def keyed_bundle(tmp_path):
    """A bundle keyed for this machine's Triton (so ``--run-bundle`` gets past its checks), whose
    runtime cache is ``tmp_path/runtime/triton-cache``; no launches (the GPU step has no CUDA here)."""
    import triton

    libtriton = Path(triton.__file__).parent / "_C" / "libtriton.so"
    bundle = tmp_path / "bundle"
    (bundle / "cache" / "0123abcd").mkdir(parents=True)
    (bundle / "cache" / "0123abcd" / "kernel.json").write_text("{}")
    (bundle / "src").mkdir()
    (bundle / "job.json").write_text(json.dumps({
        "triton": triton.__version__, "libtriton_sha256": hashlib.sha256(libtriton.read_bytes()).hexdigest(),
        "sm": 90, "preset": {}, "launches": [], "patches": [], "image": "test", "pin": "test"}))
    hanging = tmp_path / "hanging" / "torch"
    hanging.mkdir(parents=True)
    (hanging / "__init__.py").write_text(HANGING_TORCH)
    root = tmp_path / "runtime" / "triton-cache"
    env = {**os.environ, "KILN_GPU_CHECK_RUNTIME_CACHE": str(root)}
    hang_env = {**env, "PYTHONPATH": str(hanging.parent), "KILN_TEST_READY": str(tmp_path / "ready")}
    return bundle, root, env, hang_env, tmp_path / "ready"


def _start_hanging_check(keyed_bundle) -> subprocess.Popen:
    bundle, root, _, hang_env, ready = keyed_bundle
    check = subprocess.Popen([sys.executable, str(GPU_CHECK), "--run-bundle", str(bundle)], cwd=REPO, env=hang_env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 120
    while not ready.exists():
        assert check.poll() is None, check.communicate()
        assert time.monotonic() < deadline, "the GPU step never started"
        time.sleep(0.1)
    assert len(_session(check.pid)) >= 2, _session(check.pid)  # the check and its GPU step
    return check


def _gone_within(check: subprocess.Popen, seconds: float) -> list[str]:
    check.wait(timeout=30)
    deadline = time.monotonic() + seconds
    while _session(check.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return _session(check.pid)


@pytest.mark.reliability
def test_a_killed_check_leaves_no_process_and_the_next_run_removes_its_cache(keyed_bundle):
    bundle, root, env, _, _ = keyed_bundle
    check = _start_hanging_check(keyed_bundle)
    try:
        owner = json.loads((root / ".kiln-gpu-check-owner.json").read_text())
        assert owner["pid"] == check.pid and (root / "0123abcd" / "kernel.json").exists()
        second = _gpu_check("--run-bundle", str(bundle), env=env)  # while the first one runs
        assert second.returncode == 2
        assert second.stderr.strip().splitlines() == [
            f"gpu_check: {root} is in use by a running GPU check (pid {check.pid}); run one check at a time"]
        check.send_signal(signal.SIGKILL)
        assert _gone_within(check, 2.0) == [], "the GPU step outlived its killed parent by 2 s"
    finally:
        if _session(check.pid):
            os.killpg(check.pid, signal.SIGKILL)
        check.wait()
    assert (root / ".kiln-gpu-check-owner.json").exists()  # SIGKILL: nothing could remove it
    after = _gpu_check("--run-bundle", str(bundle), env=env)
    assert f"gpu_check: removed {root}, left by a killed check (pid {check.pid})" in after.stderr.splitlines()
    assert after.returncode == 2 and "no CUDA device visible to torch" in after.stderr  # it went on: no GPU here
    assert not root.exists()  # and removed its own


@pytest.mark.reliability
def test_a_stopped_check_stops_its_gpu_step_and_removes_its_cache(keyed_bundle):
    _, root, _, _, _ = keyed_bundle
    check = _start_hanging_check(keyed_bundle)
    try:
        check.send_signal(signal.SIGTERM)
        assert _gone_within(check, 2.0) == []
    finally:
        if _session(check.pid):
            os.killpg(check.pid, signal.SIGKILL)
        check.wait()
    _, err = check.communicate()
    assert check.returncode == 128 + signal.SIGTERM, err
    assert err.strip().splitlines()[-1] == f"gpu_check: stopped by SIGTERM; {root} removed"
    assert not root.exists() and not any(root.parent.iterdir())


@pytest.mark.reliability
def test_a_runtime_cache_kiln_did_not_make_is_refused_and_kept(keyed_bundle):
    bundle, root, env, _, _ = keyed_bundle
    root.mkdir(parents=True)
    (root / "theirs").write_text("keep")
    proc = _gpu_check("--run-bundle", str(bundle), env=env)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"gpu_check: {root} exists and holds no readable "
                                                ".kiln-gpu-check-owner.json: not a kiln GPU check's, so nothing is removed"]
    assert sorted(p.name for p in root.iterdir()) == ["theirs"] and (root / "theirs").read_text() == "keep"


@pytest.fixture(scope="module")
def roots(catalogue, sessions, tmp_path_factory):
    """Stock, PN119-patched and head-slipped op modules of 0.33.0, with TurboQuant's config."""
    where = tmp_path_factory.mktemp("gpu-pn119")
    session = sessions("v0.33.0")
    changed = patched_files(catalogue, session, "PN119")
    made = {}
    for name, files in (("stock", {}), ("patched", changed),
                        ("slipped", {**changed, KERNEL: _mutated(changed[KERNEL])})):
        root = Path(tq.write_root(session.tree, files, where / name))
        (root / "vllm" / CONFIG).write_text(session.tree.read(CONFIG))
        made[name] = str(root)
    return made


def _compare(roots, patched: str, tmp_path) -> list[dict]:
    case = dict(kv_preset="turboquant_k8v4", hq=6, hk=2, d=64, block_size=16, seq_lens=[1, 21], splits=2,
                dtype="float16", seed=7)
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"stock": roots["stock"], "patched": roots[patched], "sm": 90, "device": "cpu",
                                "cases": [case]}))
    proc = subprocess.run([sys.executable, str(REPO / "ci" / "gpu_pn119.py"), str(spec)], cwd=REPO,
                          env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_gpu_comparison_finds_grouped_equal_to_stock(roots, tmp_path):
    (result,) = _compare(roots, "patched", tmp_path)
    assert result["stock_launched"] == {"_tq_decode_stage1": 1}
    assert result["patched_launched"] == {"tq_grouped_decode_stage1": 1}
    assert result["ok"] and result["max_abs_out"] > 0.1
    assert result["max_abs_vs_reference"] < 2e-2  # both sides against gpu_check's own k8v4 decoder


def test_the_gpu_comparison_fails_a_wrong_head_mapping(roots, tmp_path):
    (result,) = _compare(roots, "slipped", tmp_path)
    assert result["patched_launched"] == {"tq_grouped_decode_stage1": 1}
    assert not result["ok"] and result["max_abs_diff"] > 0.1


@pytest.fixture(scope="module")
def fla_bundles(catalogue, sessions, tmp_path_factory):
    """Bundle folders holding 0.33.0's GDN ops stock and P103-patched, and stock and slipped (the
    windows' states not carried), as ``--bundle`` writes them."""
    where = tmp_path_factory.mktemp("gpu-p103")
    session = sessions("v0.33.0")
    changed = patched_files(catalogue, session, "P103")
    chunk = f"{gpu_p103.OPS}/chunk.py"
    assert changed[chunk].count(CARRY) == 1
    slipped = {**changed, chunk: changed[chunk].replace(CARRY, "        pass\n")}
    made = {}
    for name, files in (("patched", changed), ("slipped", slipped)):
        made[name] = where / name
        made[name].mkdir()
        gpu_p103.write_packages(session.tree.root / "vllm" / gpu_p103.OPS, files, made[name])
    return made


def _compare_p103(bundle: Path, tmp_path) -> dict:
    spec = tmp_path / "p103.json"
    spec.write_text(json.dumps({"stock": str(bundle / "fla_stock"), "patched": str(bundle / "fla_src"),
                                "tokens": [200], "device": "cpu", "key_heads": 1, "value_heads": 2, "dim": 32,
                                "window_chunks": 2}))  # sequences of 150 and 50 tokens: 4 chunks, 2 windows
    proc = subprocess.run([sys.executable, str(REPO / "ci" / "gpu_p103.py"), str(spec)], cwd=REPO,
                          env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return gpu_p103.report(json.loads(proc.stdout.strip().splitlines()[-1]))


def test_the_gpu_comparison_finds_p103_equal_to_stock(fla_bundles, tmp_path):
    verdict = _compare_p103(fla_bundles["patched"], tmp_path)
    (case,) = verdict["cases"]
    assert "error" not in case, case
    assert verdict["ok"] and case["o_finite"], verdict["summary"]
    assert (case["o_max_abs_diff"], case["state_max_abs_diff"]) == (0, 0)


def test_the_gpu_comparison_fails_windows_that_drop_the_state(fla_bundles, tmp_path):
    verdict = _compare_p103(fla_bundles["slipped"], tmp_path)
    (case,) = verdict["cases"]
    assert "error" not in case, case
    assert not verdict["ok"] and case["o_max_abs_diff"] > 0.01 and case["state_max_abs_diff"] > 0.01, verdict
