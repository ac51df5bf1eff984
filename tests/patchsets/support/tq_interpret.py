"""Run vLLM's TurboQuant Triton ops (and the kernels patches add) on CPU with Triton's interpreter.

``load_ops`` writes the op modules of a (patched) tree to a directory and imports them under
their real ``vllm.v1.attention.ops.*`` names, with stand-ins for the three vLLM modules they
import (``vllm.triton_utils``: the real ``triton``/``tl``; ``vllm.platforms``: a platform that
is not CUDA, so ``_use_fp8_e4b15`` picks e4nv). ``TRITON_INTERPRET=1`` must be set before the
modules load: ``triton.jit`` reads it when a kernel is decorated.

``torch_reference`` is an independent PyTorch decoder of the cache bytes (it shares no code
with the kernels): it unpacks every stored key and value and runs causal softmax attention
in float64.
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
import types
from pathlib import Path

import torch

OPS = "v1/attention/ops"
CENTROIDS = "model_executor/layers/quantization/turboquant/centroids.py"
OP_MODULES = (
    "triton_decode_attention",
    "triton_turboquant_grouped_decode",  # added by PN119, imported by the patched decode module
    "triton_turboquant_decode",
    "triton_turboquant_store",
    "triton_turboquant_spec_verify",  # added by P67; loaded when present
)

# Presets (vllm/model_executor/layers/quantization/turboquant/config.py): key bits, value
# bits, norm correction. 8 key bits = FP8 keys.
PRESETS = {"turboquant_k8v4": (8, 4, False), "turboquant_4bit_nc": (4, 4, True)}


def load_ops(files: dict[str, str], where: Path, monkeypatch) -> types.SimpleNamespace:
    """The op modules of ``files`` (rel path -> text), importable only for this test."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "set TRITON_INTERPRET=1 before loading kernels"
    import triton
    import triton.language as tl

    platform = types.SimpleNamespace(is_cuda_alike=lambda: False, is_rocm=lambda: False)
    stand_ins = {
        "vllm": {},
        "vllm.triton_utils": {"triton": triton, "tl": tl},
        "vllm.platforms": {"current_platform": platform},
        "vllm.v1": {},
        "vllm.v1.attention": {},
        "vllm.v1.attention.ops": {},
    }
    for name, attrs in stand_ins.items():
        module = types.ModuleType(name)
        module.__path__ = []
        module.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, module)
    loaded = {}
    for stem in OP_MODULES:
        rel = f"{OPS}/{stem}.py"
        if rel not in files:
            continue
        path = where / "vllm" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(files[rel])  # a real file: Triton reads kernel source through inspect
        name = f"vllm.v1.attention.ops.{stem}"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, name, module)
        spec.loader.exec_module(module)
        loaded[stem] = module
    return types.SimpleNamespace(**loaded)


class TQLayout:
    """Byte layout of one cache slot for a preset and head dim (as TurboQuantConfig computes it)."""

    def __init__(self, preset: str, head_dim: int):
        key_bits, value_bits, self.norm_correction = PRESETS[preset]
        self.head_dim = head_dim
        self.key_fp8 = key_bits == 8
        self.mse_bits = 0 if self.key_fp8 else key_bits
        self.value_bits = value_bits
        self.mse_bytes = math.ceil(head_dim * self.mse_bits / 8)
        self.key_packed_size = head_dim if self.key_fp8 else self.mse_bytes + 2
        self.value_data_bytes = math.ceil(head_dim * value_bits / 8)
        slot = self.key_packed_size + self.value_data_bytes + 4
        self.slot_size = slot + (slot % 2)
        # FP8 keys still carry value-bit centroids (TurboQuantConfig.centroid_bits)
        self.centroid_bits = value_bits if self.key_fp8 else key_bits


def hadamard(d: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(d)


def get_centroids(text: str):
    """``get_centroids(d, bits)`` of the tree's ``turboquant/centroids.py`` (pure torch)."""
    namespace: dict = {}
    exec(compile(text, CENTROIDS, "exec"), namespace)
    return namespace["get_centroids"]


def _codes(raw: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Little-endian ``bits``-bit codes packed in ``raw`` [..., bytes] -> [..., count]."""
    as_bits = ((raw.long().unsqueeze(-1) >> torch.arange(8)) & 1).flatten(-2)  # LSB first
    weights = 1 << torch.arange(bits)
    return (as_bits[..., : count * bits].unflatten(-1, (count, bits)) * weights).sum(-1)


def _fp16(raw: torch.Tensor) -> torch.Tensor:
    return (raw[..., 0].long() | (raw[..., 1].long() << 8)).to(torch.int16).view(torch.float16).double()


def dequantize(cache: torch.Tensor, layout: TQLayout, table: torch.Tensor, pi_t: torch.Tensor):
    """Keys and values of every slot of ``cache`` [blocks, block_size, Hk, slot], float64.

    MSE keys are rebuilt in the original space: norm * centroid codes (renormalised under norm
    correction), rotated back with ``pi_t.T``.
    """
    d = layout.head_dim
    if layout.key_fp8:
        keys = cache[..., :d].contiguous().view(torch.float8_e4m3fn).double()
    else:
        codes = _codes(cache[..., : layout.mse_bytes], layout.mse_bits, d)
        unit = table.double()[codes]
        if layout.norm_correction:
            unit = unit / unit.norm(dim=-1, keepdim=True)
        norms = _fp16(cache[..., layout.mse_bytes : layout.mse_bytes + 2])
        keys = (unit * norms.unsqueeze(-1)) @ pi_t.double().T
    vb = layout.key_packed_size
    vcodes = _codes(cache[..., vb : vb + layout.value_data_bytes], layout.value_bits, d).double()
    scale = _fp16(cache[..., vb + layout.value_data_bytes : vb + layout.value_data_bytes + 2])
    zero = _fp16(cache[..., vb + layout.value_data_bytes + 2 : vb + layout.value_data_bytes + 4])
    values = vcodes * scale.unsqueeze(-1) + zero.unsqueeze(-1)
    return keys, values


def torch_reference(query, cache, block_table, seq_lens, q_len, layout, table, pi_t, scale):
    """Causal attention of a uniform verify batch over the dequantised cache, float64.

    ``query`` [num_reqs * q_len, Hq, D]; query ``i`` of request ``r`` sees the first
    ``seq_lens[r] - q_len + i + 1`` tokens of that request's blocks.
    """
    keys, values = dequantize(cache, layout, table, pi_t)
    block_size, num_kv_heads = cache.shape[1], cache.shape[2]
    group = query.shape[1] // num_kv_heads
    out = torch.empty(query.shape, dtype=torch.float64)
    for r, seq_len in enumerate(seq_lens.tolist()):
        pos = torch.arange(seq_len)
        blocks = block_table[r, pos // block_size].long()
        k = keys[blocks, pos % block_size].repeat_interleave(group, dim=1)  # [L, Hq, D]
        v = values[blocks, pos % block_size].repeat_interleave(group, dim=1)
        for i in range(q_len):
            t = r * q_len + i
            seen = seq_len - q_len + i + 1
            scores = torch.einsum("hd,lhd->hl", query[t].double(), k[:seen]) * scale
            out[t] = torch.einsum("hl,lhd->hd", scores.softmax(-1), v[:seen])
    return out


# --- the patched backend, extracted -----------------------------------------------------------

IMPL_METHODS = ("forward", "_is_uniform_spec_verify", "_spec_verify_attention")


def impl_class(backend_text: str, namespace: dict, methods=IMPL_METHODS):
    """``TurboQuantAttentionImpl`` reduced to ``methods`` taken from ``backend_text``.

    The other methods ``forward`` may call are stand-ins that record which path ran
    (``_decode_attention``, ``_prefill_attention``) or do nothing (``_ensure_on_device``: the
    layer passed in already carries ``_tq_Pi``, ``_tq_PiT`` and ``_tq_centroids``).
    """
    from tests.patchsets.support.patchlib import extract

    namespace = {"torch": torch, "Any": object, "AttentionLayer": object,
                 "TurboQuantMetadata": types.SimpleNamespace, **namespace}
    source = "\n".join(extract(backend_text, f"TurboQuantAttentionImpl.{name}") for name in methods)
    exec(compile(source, "turboquant_attn", "exec"), namespace)

    def record(path):
        def run(self, query, *args, **kwargs):
            self.paths.append(path)
            return torch.zeros_like(query)

        return run

    body = {
        "_ensure_on_device": lambda self, layer, device: None,
        "_decode_attention": record("decode"),
        "_prefill_attention": record("prefill"),
    }
    body.update({name: namespace[name] for name in methods})
    return type("TurboQuantAttentionImpl", (), body)


def make_impl(cls, layout: TQLayout, num_heads: int, num_kv_heads: int, splits: int):
    impl = cls()
    impl.paths = []
    impl.num_heads, impl.num_kv_heads, impl.head_size = num_heads, num_kv_heads, layout.head_dim
    impl.num_kv_groups = num_heads // num_kv_heads
    impl.scale = layout.head_dim**-0.5
    impl.max_num_kv_splits = splits
    impl.tq_config = types.SimpleNamespace(
        key_mse_bits=layout.mse_bits, key_packed_size=layout.key_packed_size,
        effective_value_quant_bits=layout.value_bits, key_fp8=layout.key_fp8,
        norm_correction=layout.norm_correction,
    )
    return impl


def verify_metadata(seq_lens, block_table, q_len: int, device="cpu", **overrides):
    """Metadata of a uniform verify batch: every request has ``q_len`` new tokens."""
    num_reqs = len(seq_lens)
    qsl = torch.arange(num_reqs + 1, dtype=torch.int32) * q_len
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    fields = dict(
        seq_lens=seq.to(device), slot_mapping=torch.zeros(num_reqs * q_len, dtype=torch.int64, device=device),
        block_table=block_table.to(device), query_start_loc=qsl.to(device),
        num_actual_tokens=num_reqs * q_len, max_query_len=q_len, max_seq_len=max(seq_lens),
        is_prefill=q_len > 1, num_decodes=0, num_decode_tokens=0,
        query_start_loc_cpu=qsl, seq_lens_cpu=seq,
    )
    fields.update(overrides)
    return types.SimpleNamespace(**fields)


class Batch:
    """A TurboQuant cache filled by the real (interpreted) store kernel, and a verify batch.

    ``seq_lens[r]`` tokens of request ``r`` are stored through its block-table row (blocks
    spread out of order); the batch's queries are the last ``q_len`` positions of each.
    ``transposed``: the cache is allocated ``(blocks, Hk, block_size, slot)`` as vLLM 0.33.0
    does, and kernels get its ``transpose(1, 2)`` view.
    """

    def __init__(self, ops, layout, table, *, group, num_kv_heads=1, q_len=3, seq_lens=(21, 9, 0),
                 block_size=16, transposed=False, seed=0):
        gen = torch.Generator().manual_seed(seed)
        d = layout.head_dim
        self.layout, self.table, self.q_len, self.seq_lens = layout, table, q_len, list(seq_lens)
        self.num_heads, self.num_kv_heads = group * num_kv_heads, num_kv_heads
        self.pi = hadamard(d)
        blocks_per_req = max(1, -(-max(seq_lens) // block_size))
        num_blocks = 1 + blocks_per_req * len(seq_lens)
        order = torch.randperm(num_blocks - 1, generator=gen) + 1  # block 0 is vLLM's null block
        self.block_table = order.view(len(seq_lens), blocks_per_req).to(torch.int32)
        if transposed:
            self.cache = torch.zeros(num_blocks, num_kv_heads, block_size, layout.slot_size, dtype=torch.uint8)
            self.view = self.cache.transpose(1, 2)
        else:
            self.cache = self.view = torch.zeros(num_blocks, block_size, num_kv_heads, layout.slot_size,
                                                 dtype=torch.uint8)
        ordered = table.sort().values
        midpoints = (ordered[:-1] + ordered[1:]) / 2
        for r, length in enumerate(seq_lens):
            if not length:
                continue  # a FULL-graph padding request: nothing stored, seq_len 0
            pos = torch.arange(length)
            slots = (self.block_table[r, pos // block_size].long() * block_size + pos % block_size).to(torch.int32)
            k = torch.randn(length, num_kv_heads, d, generator=gen).half()
            v = torch.randn(length, num_kv_heads, d, generator=gen).half()
            ops.triton_turboquant_store.triton_turboquant_store(
                k, v, self.view, slots, self.pi, midpoints, mse_bits=layout.mse_bits,
                key_packed_size=layout.key_packed_size, value_quant_bits=layout.value_bits,
                key_fp8=layout.key_fp8,
            )
        self.num_tokens = len(seq_lens) * q_len
        self.query = torch.randn(self.num_tokens, self.num_heads, d, generator=gen).half()
        self.metadata = verify_metadata(self.seq_lens, self.block_table, q_len)
        self.layer = types.SimpleNamespace(_tq_Pi=self.pi, _tq_PiT=self.pi, _tq_centroids=table)

    def forward(self, impl):
        n, h, d = self.query.shape
        flat = self.query.reshape(n, h * d)
        kv = torch.zeros(n, self.num_kv_heads * d, dtype=self.query.dtype)
        out = impl.forward(self.layer, flat, kv, kv, self.cache, self.metadata)
        return out.view(n, h, d)

    def reference(self):
        real = [r for r, length in enumerate(self.seq_lens) if length]
        rows = torch.cat([torch.arange(r * self.q_len, (r + 1) * self.q_len) for r in real])
        out = torch_reference(self.query[rows], self.view, self.block_table[real],
                              torch.tensor([self.seq_lens[r] for r in real]), self.q_len, self.layout,
                              self.table, self.pi, self.layout.head_dim**-0.5)
        return rows, out


# --- the interpreter runs in a fresh process (see tq_numerics) ---------------------------------


def write_root(tree, changed: dict[str, str], where: Path) -> str:
    """A directory holding the op modules and centroids of ``tree`` with ``changed`` applied."""
    for stem in OP_MODULES:
        rel = f"{OPS}/{stem}.py"
        text = changed.get(rel) or (tree.read(rel) if tree.exists(rel) else None)
        if text is not None:
            (where / "vllm" / rel).parent.mkdir(parents=True, exist_ok=True)
            (where / "vllm" / rel).write_text(text)
    (where / "vllm" / CENTROIDS).parent.mkdir(parents=True, exist_ok=True)
    (where / "vllm" / CENTROIDS).write_text(tree.read(CENTROIDS))
    return str(where)


def interpret(cases: list[dict], where: Path) -> dict:
    """Results of ``tests.patchsets.support.tq_numerics`` for ``cases``, run in a fresh interpreter."""
    import json
    import subprocess

    spec = where / "spec.json"
    spec.write_text(json.dumps({"cases": cases}))
    repo = Path(__file__).resolve().parents[3]
    proc = subprocess.run([sys.executable, "-m", "tests.patchsets.support.tq_numerics", str(spec)], cwd=repo,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
