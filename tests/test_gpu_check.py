"""The CPU-side pieces of ``ci/gpu_check.py`` (the GPU part needs a GPU; CI has none)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

SCRIPT = Path(__file__).resolve().parent.parent / "ci" / "gpu_check.py"
spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
gpu_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_check)


def test_dequantise_k8v4_reads_the_store_layout():
    d, gen = 8, torch.Generator().manual_seed(1)
    key = torch.randn(3, d, generator=gen).to(torch.float8_e4m3fn)
    q = torch.randint(0, 16, (3, d), generator=gen)
    scale = torch.tensor([0.5, 0.25, 2.0], dtype=torch.float16)
    zero = torch.tensor([-1.0, 0.75, -3.5], dtype=torch.float16)
    packed = (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8)
    slot = torch.cat([key.view(torch.uint8), packed, scale[:, None].view(torch.uint8),
                      zero[:, None].view(torch.uint8), torch.zeros(3, 2, dtype=torch.uint8)], dim=1)
    got_key, got_value = gpu_check.dequantise_k8v4(slot, d)
    assert torch.equal(got_key, key.float())
    assert torch.equal(got_value, q.float() * scale.float()[:, None] + zero.float()[:, None])


def test_reference_decode_is_grouped_query_attention():
    gen = torch.Generator().manual_seed(2)
    query = torch.randn(2, 6, 16, generator=gen)
    keys, values = torch.randn(2, 5, 2, 16, generator=gen), torch.randn(2, 5, 2, 16, generator=gen)
    want = F.scaled_dot_product_attention(query[:, :, None], keys.transpose(1, 2), values.transpose(1, 2),
                                          scale=0.25, enable_gqa=True)[:, :, 0]
    got = gpu_check.reference_decode(query, keys, values, 0.25)
    assert torch.allclose(got, want, atol=1e-5)


def test_gpu_side_refuses_a_machine_without_cuda(tmp_path):
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"sm": 90}))
    proc = subprocess.run([sys.executable, str(SCRIPT), "--gpu-job", str(job)], capture_output=True, text=True,
                          env={"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 2
    assert "no CUDA device" in proc.stderr
