"""vLLM's real KV-cache spec classes, executed on CPU without torch (for P5/P5b tests).

The classes ``KVQuantMode``, ``KVCacheSpec``, ``AttentionSpec``, ``FullAttentionSpec``,
``TQFullAttentionSpec`` and ``MambaSpec`` are extracted from the pristine
``v1/kv_cache_interface.py`` of a source tree and executed with a tiny torch stand-in (a dtype
is just a name and an item size), so ``page_size_bytes``, ``real_page_size_bytes`` and
``page_size_padded`` behave exactly as in vLLM. ``assert_upstream_from_0210_by_the_platform_page``
is the verdict both patches share from 0.21.0 on.
"""

from __future__ import annotations

import copy
import logging
import math
import sys
import types
import typing
from dataclasses import dataclass, fields, replace
from enum import IntEnum

from packaging.version import Version

from kiln import paths
from kiln.patch.catalog import load_catalogue
from kiln.patch.engine import Session, isolated_run
from kiln.patch.model import BuildTarget, Verdict
from kiln.source.wheel import WheelSource
from tests.patchsets.support.patchlib import extract

SPEC_CLASSES = ("KVQuantMode", "KVCacheSpec", "AttentionSpec", "FullAttentionSpec", "TQFullAttentionSpec", "MambaSpec")


@dataclass(frozen=True)
class DType:
    name: str
    itemsize: int


TORCH = types.SimpleNamespace(
    dtype=DType,
    uint8=DType("uint8", 1),
    bfloat16=DType("bfloat16", 2),
    float16=DType("float16", 2),
    float32=DType("float32", 4),
)


def cdiv(a: int, b: int) -> int:
    return -(a // -b)


def spec_classes(tree) -> types.SimpleNamespace:
    """The spec classes of ``tree``'s ``v1/kv_cache_interface.py``, executed with stand-ins."""
    text = tree.read("v1/kv_cache_interface.py")
    source = "from __future__ import annotations\n\n" + "\n\n".join(extract(text, name) for name in SPEC_CLASSES)
    module = types.ModuleType("kiln_test_kv_cache_interface")
    module.__dict__.update(
        copy=copy,
        dataclass=dataclass,
        fields=fields,
        replace=replace,
        IntEnum=IntEnum,
        prod=math.prod,
        Self=typing.Self,
        torch=TORCH,
        get_dtype_size=lambda dtype: dtype.itemsize,
        nvfp4_kv_cache_full_dim=lambda dim: dim,
        cdiv=cdiv,
        round_up=lambda x, y: cdiv(x, y) * y,
        logger=logging.getLogger("kiln.test.kv_cache_interface"),
    )
    sys.modules[module.__name__] = module  # dataclasses looks the module up by name
    exec(compile(source, "v1/kv_cache_interface.py", "exec"), module.__dict__)
    return types.SimpleNamespace(**{name: module.__dict__[name] for name in SPEC_CLASSES})


def unify_function(text: str, specs: types.SimpleNamespace):
    """``unify_kv_cache_spec_page_size`` from a (patched or pristine) ``kv_cache_utils.py``."""
    namespace = {
        "KVCacheSpec": specs.KVCacheSpec,
        "MambaSpec": specs.MambaSpec,
        "FullAttentionSpec": specs.FullAttentionSpec,
        "replace": replace,
        "math": math,
        "cdiv": cdiv,
        "logger": logging.getLogger("kiln.test.kv_cache_utils"),
    }
    source = "from __future__ import annotations\n\n" + extract(text, "unify_kv_cache_spec_page_size")
    exec(compile(source, "v1/core/kv_cache_utils.py", "exec"), namespace)
    return namespace["unify_kv_cache_spec_page_size"]


# A Qwen3.6-27B-like hybrid on one GPU: 64 layers, every 4th full attention (4 KV heads,
# head_dim 256) with turboquant_k8v4, the others Gated DeltaNet layers.
NUM_LAYERS = 64
KV_HEADS = 4
HEAD_DIM = 256
TQ_K8V4_SLOT = HEAD_DIM + (HEAD_DIM * 4 // 8 + 4)  # fp8 key + 4-bit value + fp16 scale/zero = 388
GDN_SHAPES = ((3, 10240), (48, 128, 128))  # conv state, SSM state
GDN_REAL_PAGE = 3 * 10240 * 2 + 48 * 128 * 128 * 4  # bf16 conv + fp32 SSM = 3,207,168 bytes
# Platform._align_hybrid_block_size estimates the attention page with the plain uint8 formula
# (2 x head_dim bytes per head and token), picks the block size from it and pads Mamba to it.
UINT8_ATTN_PAGE_PER_TOKEN = 2 * KV_HEADS * HEAD_DIM
BLOCK_SIZE = 16 * cdiv(GDN_REAL_PAGE, 16 * UINT8_ATTN_PAGE_PER_TOKEN)  # 1568 tokens
MAMBA_PADDED_PAGE = BLOCK_SIZE * UINT8_ATTN_PAGE_PER_TOKEN  # 3,211,264 bytes
TQ_PAGE = BLOCK_SIZE * KV_HEADS * TQ_K8V4_SLOT  # 2,433,536 bytes: does not divide the above


def is_full_attention(i: int) -> bool:
    return i % 4 == 3


def qwen36_tq_hybrid(specs: types.SimpleNamespace) -> dict:
    """Layer name -> spec, as the runner reports it to ``get_kv_cache_groups``."""
    out = {}
    for i in range(NUM_LAYERS):
        if is_full_attention(i):
            out[f"model.layers.{i}.self_attn.attn"] = specs.TQFullAttentionSpec(
                block_size=BLOCK_SIZE,
                num_kv_heads=KV_HEADS,
                head_size=HEAD_DIM,
                head_size_v=HEAD_DIM,
                dtype=TORCH.uint8,
                tq_slot_size=TQ_K8V4_SLOT,
            )
        else:
            out[f"model.layers.{i}.linear_attn"] = specs.MambaSpec(
                block_size=BLOCK_SIZE,
                shapes=GDN_SHAPES,
                dtypes=(TORCH.bfloat16, TORCH.float32),
                page_size_padded=MAMBA_PADDED_PAGE,
                mamba_type="gdn_attention",
            )
    return out


def assert_upstream_from_0210_by_the_platform_page(patch_id: str) -> None:
    """``patch_id`` (P5 or P5b) applies to 0.20.2; from 0.21.0 the platform sizes the hybrid
    attention page from TurboQuant's packed layout (vllm#39931), and the UPSTREAM verdict names
    that branch, in the pristine file's lines."""
    catalogue = load_catalogue(paths.PATCHSETS)
    for version, applies in (("0.20.2", True), ("0.21.0", False)):
        session = Session(WheelSource(Version(version)).fetch())
        outcome = isolated_run(catalogue, session, BuildTarget(Version(version)), patch_id).outcomes[patch_id]
        if applies:
            assert outcome.verdict is Verdict.APPLIES, outcome.detail
            continue
        assert outcome.verdict is Verdict.UPSTREAM, outcome.detail
        lines = session.tree.read("platforms/interface.py").splitlines()
        branch = next(n for n, text in enumerate(lines, 1) if 'cache_dtype.startswith("turboquant_")' in text)
        assert outcome.detail.startswith(f"platforms/interface.py:{branch}: Platform._align_hybrid_block_size")
