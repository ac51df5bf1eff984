"""ci/gpu_bundle.py and ci/gpu_pn119.py on CPU: what can be checked without a GPU.

- ``--bundle`` refuses a folder that holds anything and a file that is not a Triton RECORD,
  before any work; ``--run-bundle`` refuses a machine whose Triton is not the one keyed for.
- PN119's GPU comparison, run under Triton's interpreter on real 0.33.0 source: the grouped
  decode matches stock on a GQA case (and gpu_check's k8v4 reference), and a grouped kernel with
  the classic head-mapping slip fails the same comparison (so the GPU run can fail).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.patchsets.attention_turboquant.test_pn119 import KERNEL, _mutated
from tests.patchsets.support import tq_interpret as tq
from tests.patchsets.support.patchlib import patched_files

REPO = Path(__file__).resolve().parent.parent
GPU_CHECK = REPO / "ci" / "gpu_check.py"
CONFIG = "model_executor/layers/quantization/turboquant/config.py"


def _gpu_check(*args, cwd=REPO):
    return subprocess.run([sys.executable, str(GPU_CHECK), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300)


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
