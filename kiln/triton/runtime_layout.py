"""What vLLM's runtime hands the TurboQuant kernels, per vLLM version: the one place for it.

Public API:
    TURBOQUANT_KERNEL_BLOCK_SIZES   (16, 32, 64, 128): ``get_supported_kernel_block_sizes()``
    kernel_block_size(manager_block_size) -> int | None   the block size the kernels see
    RuntimeLayout                   the per-version rules below
    layout_for(version) -> RuntimeLayout
    vllm_version(text) -> tuple[int, int, int]   from ``vllm/_version.py``'s text
    block_table_width(layout, manager_block_size, max_model_len) -> int   the table's row stride

``[model.kernels] block_sizes`` are the KV cache MANAGER's block sizes (what the platform
picks for the model). The kernels do not see them: the TurboQuant backend declares the kernel
block sizes 16, 32, 64 and 128 on every pin kiln builds (0.20.1 and 0.33.0), and
``select_common_block_size`` (``v1/worker/utils.py``) keeps the manager's size only when it is
one of them; otherwise it takes the largest of them that divides it, and each manager block is
split into kernel blocks (3136 -> 64, 2080 -> 32, 4192 -> 32, 2768 -> 16). The kernel's
``BLOCK_SIZE`` constexpr is that kernel block size, the cache view has ``kernel block size``
rows per block and the block table holds kernel block ids.

What differs per version (``tests/triton/test_runtime_layout.py`` derives all of it from each
pin's own code and compares it with the worker's tensors):

- the block table's row stride. 0.20.1: ``cdiv(max_model_len, manager) * ratio``
  (``BlockTable``). 0.33.0: the kernel block table is ``get_block_table_width`` of the manager
  table (rows padded to 128 tokens) times the ratio (``AttentionGroup.create_metadata_builders``).
  Triton specialises that integer by divisibility by 16, so it must be the runtime's.
- the continuation fast path's ``seq_lens``: 0.20.1 allocates ``torch.arange(...)`` (aligned);
  from 0.21.0 it is a slice ``_arange_cache[cached_len + 1:]`` whose pointer is 16-byte aligned
  only when ``cached_len + 1`` is a multiple of 4, so both pointer specialisations occur.
- the cache view: 0.20.1 views each layer's buffer as contiguous ``(blocks, B, Hk, slot)``;
  0.33.0 allocates LBNHC (``[L, B, N, H, C]`` in memory), views ``[B, H, N, C]`` and the backend
  transposes it back to ``[B, N, H, C]``: the same strides as the contiguous tensor, so the
  worker builds that one for both.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

TURBOQUANT_KERNEL_BLOCK_SIZES = (16, 32, 64, 128)


def kernel_block_size(manager_block_size: int) -> int | None:
    """``select_common_block_size(manager, [TurboQuantAttentionBackend])``; None: no kernel size fits."""
    if manager_block_size in TURBOQUANT_KERNEL_BLOCK_SIZES:
        return manager_block_size
    fits = [size for size in TURBOQUANT_KERNEL_BLOCK_SIZES if manager_block_size % size == 0]
    return max(fits) if fits else None


@dataclass(frozen=True)
class RuntimeLayout:
    name: str  # the pin whose code the rule was read from
    table_token_alignment: int | None  # manager table rows padded to this many tokens (None: not padded)
    continuation_seq_lens_sliced: bool  # seq_lens of the continuation path is a slice of a cached arange


_LAYOUTS = (  # (first vLLM version, rule), ascending; verified on the pins named
    ((0, 0, 0), RuntimeLayout("0.20.1", table_token_alignment=None, continuation_seq_lens_sliced=False)),
    ((0, 21, 0), RuntimeLayout("0.21.0", table_token_alignment=None, continuation_seq_lens_sliced=True)),
    ((0, 32, 0), RuntimeLayout("0.33.0", table_token_alignment=128, continuation_seq_lens_sliced=True)),
)


def layout_for(version: tuple[int, int, int]) -> RuntimeLayout:
    return [layout for first, layout in _LAYOUTS if version >= first][-1]


def vllm_version(text: str | None) -> tuple[int, int, int] | None:
    """``(0, 33, 0)`` from ``vllm/_version.py`` (``__version__ = version = '0.33.0'``, nightlies too)."""
    match = re.search(r"""^__version__\s*=\s*(?:version\s*=\s*)?['"](\d+)\.(\d+)\.(\d+)""", text or "", re.M)
    return tuple(int(part) for part in match.groups()) if match else None


def block_table_width(layout: RuntimeLayout, manager_block_size: int, max_model_len: int) -> int:
    """The row stride of the (kernel) block table the decode kernel reads."""
    kernel = kernel_block_size(manager_block_size)
    assert kernel is not None
    width = math.ceil(max_model_len / manager_block_size)
    if layout.table_token_alignment is not None:  # get_block_table_width
        alignment = layout.table_token_alignment // math.gcd(layout.table_token_alignment, manager_block_size)
        width = math.ceil(width / alignment) * alignment
    return width * (manager_block_size // kernel)
