"""P5b: unify KV page sizes of hybrid models by padding the smaller pages to the largest one.

The variant of P5 an image opts into (same failure: ``unify_kv_cache_spec_page_size`` in
``v1/core/kv_cache_utils.py`` raises ``NotImplementedError`` on a TurboQuant hybrid because the
TurboQuant attention page, 388 x B x H bytes for k8v4 at head_dim 256, does not divide the Mamba
page the platform padded to its uint8 estimate, 512 x B x H). P5 grows the attention blocks to a
common multiple and pads the Mamba pages (+51.6% per Mamba page on Qwen3.6 + k8v4); P5b keeps
the largest page and pads the smaller ones up to it (+32% on the TurboQuant pages only), ~34%
less KV memory per block, which is what decides context length on a 24 GB card.

Padding a TurboQuant attention page is only sound if everything that addresses the cache uses
the page stride, so the patch has three parts on 0.20.1:

1. ``unify_kv_cache_spec_page_size``: Mamba pages (their size does not scale with
   ``block_size``) and TurboQuant pages that do not divide the largest page get
   ``page_size_padded = max``; other attention pages still grow by a whole block ratio, and
   anything else still raises. ``TQFullAttentionSpec`` (``v1/kv_cache_interface.py``) inherits
   ``page_size_padded`` from ``AttentionSpec`` and overrides ``real_page_size_bytes`` with its
   packed slot size, so ``page_size_bytes`` becomes the padded size and the real size stays
   known. Other attention layouts are not padded: FlashAttention's ``(2, num_blocks, ...)``
   cache is re-strided for hybrids by ``_update_hybrid_attention_mamba_layout`` with no room
   for padding.
2. ``GPUModelRunner._reshape_kv_cache_tensors`` (``v1/worker/gpu_model_runner.py``) already
   views a padded attention page through ``as_strided``, but gives each *kernel* block the
   whole page as stride. A hybrid's attention block (hundreds of tokens) holds several
   TurboQuant kernel blocks (16-128 tokens), so the view would run past the allocation. The
   stride becomes page / kernel-blocks-per-page: the padding is spread evenly over the kernel
   blocks and one stride addresses them all.
3. ``triton_turboquant_store`` (``v1/attention/ops/triton_turboquant_store.py``) passed
   ``kv_cache.view(-1)`` to its kernels, which fails on a strided (padded) cache; the kernels
   already address the cache through the explicit block/position/head strides, so the cache
   tensor is passed as it is (as 0.33.0 does).

The decode and continuation-prefill kernels already use ``kv_cache.stride(...)``.

0.33.0 verdict: UPSTREAM. The function moved to ``v1/core/kv_cache_planning.py`` and pads
Mamba pages and non-MLA attention pages that do not divide the largest page to it
(``replace(layer_spec, page_size_padded=max_page_size)``), and the TurboQuant store kernels
take the cache tensor itself. The runner-side counterpart is a different design there (the KV
layout is planned in ``kv_cache_planning.py`` with per-layer padded block strides,
``_get_layer_block_stride``); it was read, not run. Detected by ``upstream_fix``: the
platform's TurboQuant page (the fix that matters, from 0.21.0), and padding ``unify`` with both
store launches without ``.view(-1)`` (from 0.26.0), in whichever file ``unify`` lives.

Verdicts across releases (``patchsets/release-train.toml``, reviewed on every release
0.20.1-0.33.0):
- 0.20.1, 0.20.2: APPLIES.
- 0.21.0 on: UPSTREAM, in the platform layer (vllm#39931, ``platforms/interface.py:548`` on
  0.21.0): ``Platform._align_hybrid_block_size`` sizes the attention page from TurboQuant's
  packed layout, so the TurboQuant and Mamba pages come out equal and no TurboQuant page is
  ever padded; the runner-stride and store edits only exist to read padded TurboQuant pages.
  Upstream's layout is also the smaller one: it pads the Mamba page a little up to the
  TurboQuant page, where P5b pads the TurboQuant pages up to the Mamba page. Before this review
  the recogniser read only ``kv_cache_planning.py`` (0.33.0), and 0.24.0-0.32.0 read DRIFTED:
  the padded-page view moved from ``GPUModelRunner._reshape_kv_cache_tensors`` to
  ``v1/worker/gpu/attn_utils.py::_reshape_attention_kv_cache`` in 0.24.0.
- What upstream left as it was: that view still gives every kernel block the whole padded
  page as stride (0.24.0-0.28.0), which matters only for a padded attention page holding
  several kernel blocks, a layout upstream does not produce for TurboQuant hybrids. From 0.26.0
  the detail also lists ``unify`` padding Mamba pages (vllm#45207) and non-dividing attention
  pages (opt-in from 0.24.0, every non-MLA page from 0.29.0), and the store kernels taking the
  strided cache (``v1/attention/ops/triton_turboquant_store.py:389``).
"""

import libcst as cst
import libcst.matchers as m

from kiln.patch.model import Codemod, Patch
from kiln.patch.shapes import (
    UNIFY_PAGE_SIZE,
    assign_to,
    cls,
    func,
    marked,
    place_of,
    platform_sizes_turboquant_pages,
    statements,
    unify_pads_pages,
    with_marker,
)

WHY_UNIFY = "pad Mamba pages and TurboQuant pages that do not divide the largest page up to it"
WHY_STRIDE = "a padded page holds several kernel blocks: spread the padding so one stride addresses them"
WHY_STORE = "pass the (possibly padded, strided) cache itself: the kernel addresses it through its strides"

NEW_FUNCTION = '''
def unify_kv_cache_spec_page_size(
    kv_cache_spec: dict[str, KVCacheSpec],
) -> dict[str, KVCacheSpec]:
    """
    Unify the page size of the given KVCacheSpec. If the page size of all layers
    are the same, return the original KVCacheSpec. If not same, unify to the
    largest page size: Mamba layers (whose page size does not depend on the
    block size) and TurboQuant layers whose page does not divide the largest one
    are padded up to it; other layers increase their block size. Raise
    NotImplementedError if failed to unify the page size.

    Args:
        kv_cache_spec: The KVCacheSpec of each attention layer in the model

    Returns:
        The updated KVCacheSpec with the same page_size_bytes.
    """
    from vllm.v1.kv_cache_interface import TQFullAttentionSpec

    page_sizes = {layer.page_size_bytes for layer in kv_cache_spec.values()}
    if len(page_sizes) <= 1:
        # All layers have the same page size, no need to unify.
        return kv_cache_spec

    max_page_size = max(page_sizes)
    new_kv_cache_spec = {}
    for layer_name, layer_spec in kv_cache_spec.items():
        layer_page_size = layer_spec.page_size_bytes
        if layer_page_size == max_page_size:
            new_spec = layer_spec
        elif isinstance(layer_spec, MambaSpec) or (
            isinstance(layer_spec, TQFullAttentionSpec)
            and max_page_size % layer_page_size != 0
        ):
            # TurboQuant's cache is block-first, so the runner reads a padded
            # page through a strided view.
            new_spec = replace(layer_spec, page_size_padded=max_page_size)
        elif max_page_size % layer_page_size == 0:
            ratio = max_page_size // layer_page_size
            new_spec = replace(layer_spec, block_size=layer_spec.block_size * ratio)
        else:
            raise NotImplementedError(
                f"The page size of layer {layer_name} ({layer_page_size} bytes) does "
                f"not divide the maximum page size ({max_page_size} bytes) and the "
                "layer cannot be padded. Cannot unify by adjusting block_size."
            )
        assert new_spec.page_size_bytes == max_page_size
        new_kv_cache_spec[layer_name] = new_spec
    return new_kv_cache_spec
'''


class UnifyPagesPadToMax(Codemod):
    """Replace ``unify_kv_cache_spec_page_size`` with the pad-smaller-to-max version."""

    target = "v1/core/kv_cache_utils.py"
    anchor = (func(UNIFY_PAGE_SIZE),)
    patched = (func(UNIFY_PAGE_SIZE, leading_lines=marked("P5b")),)

    def rewrite(self, node):
        (new,) = statements(NEW_FUNCTION)
        return with_marker(new.with_changes(leading_lines=node.leading_lines), "P5b", WHY_UNIFY)


RUNNER = cls("GPUModelRunner")
RESHAPE = func("_reshape_kv_cache_tensors")


class PaddedPageStridePerKernelBlock(Codemod):
    """In the runner's padded-attention branch, stride kernel blocks by page / blocks per page."""

    target = "v1/worker/gpu_model_runner.py"
    anchor = (RUNNER, RESHAPE, assign_to("page_stride"))
    patched = (RUNNER, RESHAPE, m.SimpleStatementLine(leading_lines=marked("P5b")))

    def rewrite(self, node):
        check, stride = statements(
            """
            assert kv_cache_spec.page_size_bytes % (dtype_size * num_blocks_per_kv_block) == 0
            page_stride = (
                kv_cache_spec.page_size_bytes // dtype_size // num_blocks_per_kv_block
            )
            """
        )
        check = with_marker(check.with_changes(leading_lines=node.leading_lines), "P5b", WHY_STRIDE)
        return cst.FlattenSentinel([check, stride])


STORE_FILE = "v1/attention/ops/triton_turboquant_store.py"
STORE = func("triton_turboquant_store")
FLAT_CACHE = m.Arg(
    value=m.Call(
        func=m.Attribute(value=m.Name("kv_cache"), attr=m.Name("view")),
        args=[m.Arg(value=m.UnaryOperation(operator=m.Minus(), expression=m.Integer("1")))],
    )
)


def _kernel_launch(kernel: str, *, cache_arg=None, leading_lines=None) -> m.SimpleStatementLine:
    args = [m.ZeroOrMore(), cache_arg, m.ZeroOrMore()] if cache_arg is not None else m.DoNotCare()
    call = m.Call(func=m.Subscript(value=m.Name(kernel)), args=args)
    if leading_lines is None:
        return m.SimpleStatementLine(body=[m.Expr(value=call)])
    return m.SimpleStatementLine(body=[m.Expr(value=call)], leading_lines=leading_lines)


class _PassStridedCache(Codemod):
    """Replace ``kv_cache.view(-1)`` by ``kv_cache`` in one store-kernel launch."""

    target = STORE_FILE
    kernel: str

    def rewrite(self, node):
        args = [
            arg.with_changes(value=cst.Name("kv_cache")) if m.matches(arg, FLAT_CACHE) else arg
            for arg in node.body[0].value.args
        ]
        call = node.body[0].value.with_changes(args=args)
        new = node.with_changes(body=[node.body[0].with_changes(value=call)])
        return with_marker(new, "P5b", WHY_STORE)


class StoreFp8TakesStridedCache(_PassStridedCache):
    kernel = "_tq_fused_store_fp8"
    anchor = (STORE, _kernel_launch("_tq_fused_store_fp8", cache_arg=FLAT_CACHE))
    patched = (STORE, _kernel_launch("_tq_fused_store_fp8", leading_lines=marked("P5b")))
    upstream = (STORE, _kernel_launch("_tq_fused_store_fp8", cache_arg=m.Arg(value=m.Name("kv_cache"))))


class StoreMseTakesStridedCache(_PassStridedCache):
    kernel = "_tq_fused_store_mse"
    anchor = (STORE, _kernel_launch("_tq_fused_store_mse", cache_arg=FLAT_CACHE))
    patched = (STORE, _kernel_launch("_tq_fused_store_mse", leading_lines=marked("P5b")))
    upstream = (STORE, _kernel_launch("_tq_fused_store_mse", cache_arg=m.Arg(value=m.Name("kv_cache"))))


# -- upstream detection ------------------------------------------------------------------------
# The places upstream prevents the failure (see "Verdicts across releases" above); the
# recognisers are shared with P5 (kiln/patch/shapes.py).



class P5b(Patch):
    id = "P5b"
    family = "kv_cache"
    title = "Hybrid KV page-size unification by padding smaller pages to the largest (variant of P5)"
    why = (
        "unify_kv_cache_spec_page_size raises NotImplementedError when TurboQuant attention and "
        "Mamba pages do not divide. Pad Mamba and TurboQuant pages up to the largest page (with "
        "the runner stride and store-kernel edits that make a padded TQ page readable): ~34% "
        "less KV memory per block than P5."
    )
    conflicts = ("P5",)
    variant = True
    perf_critical = True
    written_for = ">=0.20.1"
    edits = (
        UnifyPagesPadToMax,
        PaddedPageStridePerKernelBlock,
        StoreFp8TakesStridedCache,
        StoreMseTakesStridedCache,
    )

    def upstream_fix(self, module_of) -> str | None:
        found = []
        platform = platform_sizes_turboquant_pages(module_of)
        if platform:
            found.append(
                f"{platform}: Platform._align_hybrid_block_size sizes the attention page from "
                "TurboQuant's packed layout, so the TurboQuant and Mamba pages come out equal and "
                "no TurboQuant page is padded (vllm#39931)"
            )
        unify = unify_pads_pages(module_of, "MambaSpec", "AttentionSpec")
        store = module_of(STORE_FILE)
        fp8 = place_of(STORE_FILE, store, StoreFp8TakesStridedCache.upstream)
        mse = place_of(STORE_FILE, store, StoreMseTakesStridedCache.upstream)
        if unify and fp8 and mse:
            found.append(
                f"{unify}: {UNIFY_PAGE_SIZE} pads Mamba and non-dividing attention pages to the largest page; "
                f"{fp8}, {mse}: triton_turboquant_store launches its kernels on the strided cache"
            )
        return "; ".join(found) or None
