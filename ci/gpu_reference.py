"""What the GPU checks compare kernels against, and how a kernel check reads to a person.

Used by ``ci/gpu_check.py`` (its own numerics), ``ci/gpu_pn119.py`` (k8v4 cases against an
independent reference) and ``ci/gpu_bundle.py`` (the report of ``--run-bundle``): one module
below all three, so none of them imports another for these. torch is imported inside the
functions: the printer runs where torch is not installed.
"""

from __future__ import annotations


def dequantise_k8v4(slot_bytes, head_dim: int):
    """Keys and values of k8v4 cache slots ``[..., slot]`` (uint8) -> float32 ``[..., D]`` each.

    Layout (vLLM 0.20.1 ``triton_turboquant_store``): D bytes of fp8 e4m3 key, then D/2 bytes
    of 4-bit values (low nibble first), then the fp16 scale and the fp16 zero point.
    """
    import torch

    d = head_dim
    key = slot_bytes[..., :d].contiguous().view(torch.float8_e4m3fn).float()
    packed = slot_bytes[..., d:d + d // 2].to(torch.int32)
    q = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(*packed.shape[:-1], d).float()
    tail = slot_bytes[..., d + d // 2:d + d // 2 + 4].contiguous()
    scale = tail[..., 0:2].contiguous().view(torch.float16).float()
    zero = tail[..., 2:4].contiguous().view(torch.float16).float()
    return key, q * scale + zero


def reference_decode(query, keys, values, scale: float):
    """Grouped-query attention of one query per sequence: query [B, Hq, D], keys/values [B, T, Hk, D]."""
    import torch

    hq, hk = query.shape[1], keys.shape[2]
    k = keys.repeat_interleave(hq // hk, dim=2)  # [B, T, Hq, D]
    v = values.repeat_interleave(hq // hk, dim=2)
    scores = torch.einsum("bhd,bthd->bht", query.float(), k) * scale
    return torch.einsum("bht,bthd->bhd", scores.softmax(dim=-1), v)


def print_kernel_report(report: dict, where: str, more: list[str] = ()) -> None:
    """The human form of a kernel check's report (``report["ok"]`` decides the last line)."""
    print(f"{report['gpu']} ({where}): {report['hits']} kernel(s) loaded from the cache, "
          f"{len(report['compiles'])} compiled {report['compiles'] or ''}")
    for item in report["numerics"]:
        print(f"  numerics {item}")
    for line in more:
        print(f"  {line}")
    print("OK" if report["ok"] else "FAILED")
