"""The kernel preset an image declares, and the vLLM launchers kiln knows how to call.

Public API:
    RUNTIME_CACHE_DIR        "/opt/kiln/triton-cache" (the image's ``TRITON_CACHE_DIR``)
    Kernel(name, file, function, builder)     one vLLM launcher function
    KERNELS                  name -> Kernel (what ``[model.kernels] launchers`` may name)
    KernelPreset             head dim, heads, dtype, block sizes, KV presets, spec tokens, ...
    parse_kernel_preset(raw, model_dtype, kv_cache_dtype, spec_tokens, fail) -> KernelPreset
    check_kernels(preset, read) -> None     every launcher exists in the patched source
    launch_plan(preset, layout) -> list[dict]   what the worker calls, in order (JSON-ready)

An image definition declares, in ``[model.kernels]``, what its model will launch::

    [model.kernels]
    launchers = ["turboquant_store", "turboquant_decode"]
    head_dim = 256
    num_heads = 24          # query heads per GPU (tensor parallel 1)
    num_kv_heads = 4
    block_sizes = [2080]    # the KV cache manager's block size vLLM picks for the model
    max_model_len = 131072  # --max-model-len: the block table's row stride
    max_num_seqs = 4        # --max-num-seqs: rows of the decode buffers
    # dtype (default: model.dtype), kv_cache_presets (default: [model.kv_cache_dtype]),
    # spec_tokens (default: model.num_speculative_tokens), max_num_kv_splits (default 32)

Every value that reaches a Triton argument matters: constexprs (head dim, block size, KV
preset, fp8 flavour) pick a kernel, and plain ints are specialised by divisibility by 16.
The kernels see the runtime's kernel block size and block table, not the manager's block size:
``runtime_layout.py`` derives them per vLLM version.
To add a launcher: a ``Kernel`` here and a builder of the same name in ``worker.BUILDERS``
that calls it with CPU tensors of the shapes the runtime passes.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from dataclasses import asdict, dataclass

from kiln.triton.runtime_layout import (
    TURBOQUANT_KERNEL_BLOCK_SIZES,
    RuntimeLayout,
    block_table_width,
    kernel_block_size,
)

RUNTIME_CACHE_DIR = "/opt/kiln/triton-cache"
DTYPES = ("float16", "bfloat16")
KV_PRESETS = ("turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc")


@dataclass(frozen=True)
class Kernel:
    name: str
    file: str  # relative to the vllm package
    function: str  # the launcher vLLM calls
    builder: str  # worker.BUILDERS key

    @property
    def module(self) -> str:
        return "vllm." + self.file[:-3].replace("/", ".")


KERNELS = {k.name: k for k in (
    Kernel("turboquant_store", "v1/attention/ops/triton_turboquant_store.py", "triton_turboquant_store", "store"),
    Kernel("turboquant_decode", "v1/attention/ops/triton_turboquant_decode.py",
           "triton_turboquant_decode_attention", "decode"),
)}


@dataclass(frozen=True)
class KernelPreset:
    launchers: tuple[str, ...]
    head_dim: int
    num_heads: int
    num_kv_heads: int
    dtype: str
    block_sizes: tuple[int, ...]
    kv_cache_presets: tuple[str, ...]
    spec_tokens: int
    max_model_len: int
    max_num_seqs: int
    max_num_kv_splits: int = 32

    def to_json(self) -> dict:
        return asdict(self)


def _int(raw: dict, key: str, fail, default: int | None = None, minimum: int = 1) -> int:
    value = raw.get(key, default)
    if value is None:
        fail(f"model.kernels.{key}", "missing (an integer)")
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        fail(f"model.kernels.{key}", f"must be an integer >= {minimum}, not {value!r}")
    return value


def parse_kernel_preset(raw: object, model_dtype: str, kv_cache_dtype: str, spec_tokens: int,
                        fail: Callable[[str, str], None]) -> KernelPreset:
    """Validate ``[model.kernels]``; ``fail(field, why)`` raises the loader's error."""
    if not isinstance(raw, dict):
        fail("model.kernels", "must be a table")
    known = set(KernelPreset.__dataclass_fields__)
    for key in raw:
        if key not in known:
            fail(f"model.kernels.{key}", f"unknown field (known: {', '.join(sorted(known))})")
    launchers = raw.get("launchers")
    if not isinstance(launchers, list) or not launchers or not all(isinstance(x, str) for x in launchers):
        fail("model.kernels.launchers", f"must be a non-empty list of kernel names ({', '.join(KERNELS)})")
    for name in launchers:
        if name not in KERNELS:
            fail("model.kernels.launchers", f"unknown kernel {name!r} (known: {', '.join(KERNELS)})")
    if len(set(launchers)) != len(launchers):
        fail("model.kernels.launchers", "lists a kernel twice")
    dtype = raw.get("dtype", model_dtype)
    if dtype not in DTYPES:
        fail("model.kernels.dtype", f"{dtype!r} is not one of {', '.join(DTYPES)}")
    presets = raw.get("kv_cache_presets", [kv_cache_dtype])
    if not isinstance(presets, list) or not presets or not all(isinstance(x, str) for x in presets):
        fail("model.kernels.kv_cache_presets", "must be a non-empty list of TurboQuant presets")
    for name in presets:
        if name not in KV_PRESETS:
            fail("model.kernels.kv_cache_presets", f"{name!r} is not a TurboQuant preset ({', '.join(KV_PRESETS)})")
    blocks = raw.get("block_sizes")
    if not isinstance(blocks, list) or not blocks or not all(
            isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in blocks):
        fail("model.kernels.block_sizes", "must be a non-empty list of positive integers")
    for block in blocks:
        if kernel_block_size(block) is None:
            sizes = ", ".join(map(str, TURBOQUANT_KERNEL_BLOCK_SIZES))
            fail("model.kernels.block_sizes", f"{block} is not a multiple of any TurboQuant kernel block size ({sizes})")
    head_dim = _int(raw, "head_dim", fail, minimum=8)
    num_heads = _int(raw, "num_heads", fail)
    num_kv_heads = _int(raw, "num_kv_heads", fail)
    if num_heads % num_kv_heads:
        fail("model.kernels.num_heads", f"{num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    return KernelPreset(
        launchers=tuple(launchers), head_dim=head_dim, num_heads=num_heads, num_kv_heads=num_kv_heads,
        dtype=dtype, block_sizes=tuple(blocks), kv_cache_presets=tuple(presets),
        spec_tokens=_int(raw, "spec_tokens", fail, default=spec_tokens, minimum=0),
        max_model_len=_int(raw, "max_model_len", fail), max_num_seqs=_int(raw, "max_num_seqs", fail),
        max_num_kv_splits=_int(raw, "max_num_kv_splits", fail, default=32),
    )


def check_kernels(preset: KernelPreset, read: Callable[[str], str | None], where: str) -> None:
    """Every declared launcher is a top-level function of its file in the patched source.

    ``read(rel)``: the patched text of ``vllm/<rel>``, or None when the file does not exist.
    """
    from kiln.errors import KilnError

    for name in preset.launchers:
        kernel = KERNELS[name]
        text = read(kernel.file)
        if text is None:
            raise KilnError(f"{where}: kernel {name}: vllm/{kernel.file} does not exist in the patched source")
        tree = ast.parse(text)
        if not any(isinstance(node, ast.FunctionDef) and node.name == kernel.function for node in tree.body):
            raise KilnError(f"{where}: kernel {name}: vllm/{kernel.file} has no function "
                            f"{kernel.function} in the patched source")


def launch_plan(preset: KernelPreset, layout: RuntimeLayout) -> list[dict]:
    """The launches that cover what the runtime computes for this preset, in a fixed order.

    ``block_size`` names the manager's block size; ``kernel_block_size`` and ``table_width`` are
    what the kernels get from it on ``layout``'s vLLM (``runtime_layout.py``)."""
    plan = []
    for name in preset.launchers:
        kernel = KERNELS[name]
        for kv_preset in preset.kv_cache_presets:
            for block_size in preset.block_sizes:
                shape = {"block_size": block_size, "kernel_block_size": kernel_block_size(block_size)}
                variants: list[dict] = [{}]
                if kernel.builder == "store":
                    variants = [{"tokens": preset.max_num_seqs * (1 + preset.spec_tokens)}]
                elif kernel.builder == "decode":
                    # the decode path (per-layer buffers) and the continuation-prefill fast path,
                    # whose seq_lens may be a slice at any int32 offset (then not 16-byte aligned)
                    shape["table_width"] = block_table_width(layout, block_size, preset.max_model_len)
                    continuation = {"batch": 1 + preset.spec_tokens, "continuation": True}
                    variants = [{"batch": preset.max_num_seqs}, continuation]
                    if layout.continuation_seq_lens_sliced:
                        variants.append({**continuation, "seq_lens_offset": 1})
                for extra in variants:
                    plan.append({"kernel": name, "module": kernel.module, "function": kernel.function,
                                 "builder": kernel.builder,
                                 "params": {"kv_preset": kv_preset, **shape, **extra}})
    return plan
