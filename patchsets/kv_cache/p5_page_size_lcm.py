"""P5: unify KV page sizes of hybrid models at a common multiple of the attention pages.

Without the patch, a hybrid model (attention + Mamba/GDN) with a TurboQuant KV cache does not
start on vLLM 0.20.1: ``unify_kv_cache_spec_page_size`` (``v1/core/kv_cache_utils.py``) raises
``NotImplementedError`` when the largest page is not a multiple of a smaller one. The platform
(``Platform._align_hybrid_block_size``) pads the Mamba page to the attention page it *estimates*
with the plain ``FullAttentionSpec`` formula (2 x head_size bytes per head and token for a uint8
cache), but TurboQuant packs K+V into ``tq_slot_size`` bytes (388 for k8v4 at head_dim 256), so
the real attention page (e.g. 388 x B x H) does not divide the Mamba page (512 x B x H). The same
function also trips its assertion when a Mamba page is the smaller one, since a Mamba page does
not grow with ``block_size``.

The patch replaces the function: the common page is the smallest multiple of the LCM of the
attention page sizes that is at least the largest page. Attention layers reach it by a whole
block-size ratio (the upstream mechanism); Mamba layers are padded up to it with
``page_size_padded`` (the same field the platform already uses). No attention page is padded,
so the attention layout the runner builds is unchanged. Inputs upstream accepts give the same
result as before (the LCM of pages that divide the largest page divides it). The cost is
memory: on Qwen3.6 + k8v4 the common page is 2 x 388 and the Mamba pages grow from 512 to 776
(+51.6% per Mamba page); P5b (pad the smaller pages to the largest) avoids that, with runner and
kernel edits, and an image picks one of the two.

0.33.0 verdict: UPSTREAM (not TARGET_GONE). The function moved to
``v1/core/kv_cache_planning.py`` (``kv_cache_utils.py`` still exists, so the anchor alone would
read as drift), and there it no longer raises for these layouts: Mamba pages and non-MLA
attention pages that do not divide the largest one are padded to it
(``replace(layer_spec, page_size_padded=max_page_size)``). The platform alignment is also
TurboQuant-aware there (``platforms/interface.py``, ``_align_hybrid_block_size`` uses the
packed TQ page), so the mismatch no longer arises. ``upstream_fix`` detects both, in every file
they have lived in (see below).

Verdicts across releases (``patchsets/release-train.toml``, reviewed on every release
0.20.1-0.33.0):
- 0.20.1, 0.20.2: APPLIES.
- 0.21.0 on: UPSTREAM, in the platform layer. vllm#39931 made
  ``Platform._align_hybrid_block_size`` (``platforms/interface.py:548`` on 0.21.0) size the
  per-token attention page of a ``turboquant_*`` cache from its packed layout (a
  ``TQFullAttentionSpec``; from 0.28.0 ``TurboQuantAttentionBackend.customize_spec``; from
  0.32.0 the same branch also serves ``ultraquant_4bit``), with the LCM of the TurboQuant and
  the unquantized page when skip layers exist. The Mamba page is padded to the page the
  TurboQuant layers really have, so ``unify`` sees pages that divide: the failure this patch
  was written for cannot happen. Before this review the recogniser only read ``unify`` and
  these releases read APPLIES until 0.26.0.
- Partly fixed, kept with the evidence: the second path P5's function covers, a layer whose
  page is larger than the platform-aligned one (a draft model with more KV bytes per token,
  vllm#43626), still trips ``unify``'s assertion on a Mamba page until 0.26.0, where
  vllm#45207 pads Mamba pages in ``unify`` (``v1/core/kv_cache_utils.py:1067``; moved to
  ``v1/core/kv_cache_planning.py:346`` in 0.33.0). That path is not TurboQuant's and does not
  arise in kiln's images (their MTP layer has the target's TurboQuant page), so P5 is retired
  from 0.21.0; 0.21.0-0.25.1 with such a draft would need a patch of its own. The UPSTREAM
  detail lists every place found (the platform branch, and ``unify`` from 0.26.0).
"""

from kiln.patch.model import Codemod, Patch
from kiln.patch.shapes import (
    UNIFY_PAGE_SIZE,
    func,
    marked,
    platform_sizes_turboquant_pages,
    statements,
    unify_pads_pages,
    with_marker,
)

WHY = "unify hybrid pages at a common multiple of the attention pages; pad Mamba pages up to it"

NEW_FUNCTION = '''
def unify_kv_cache_spec_page_size(
    kv_cache_spec: dict[str, KVCacheSpec],
) -> dict[str, KVCacheSpec]:
    """
    Unify the page size of the given KVCacheSpec. If the page size of all layers
    are the same, return the original KVCacheSpec. If not same, the common page
    size is the smallest multiple of the LCM of the attention page sizes that is
    at least the largest page size. Attention layers reach it by increasing their
    block size; Mamba layers, whose page size does not depend on the block size,
    are padded up to it. Raise NotImplementedError if a layer can do neither.

    Args:
        kv_cache_spec: The KVCacheSpec of each attention layer in the model

    Returns:
        The updated KVCacheSpec with the same page_size_bytes.
    """
    page_sizes = {layer.page_size_bytes for layer in kv_cache_spec.values()}
    if len(page_sizes) <= 1:
        # All layers have the same page size, no need to unify.
        return kv_cache_spec

    max_page_size = max(page_sizes)
    # Pages that grow by whole blocks: every layer but the Mamba state pages.
    block_pages = {
        layer.page_size_bytes
        for layer in kv_cache_spec.values()
        if not isinstance(layer, MambaSpec)
    }
    step = math.lcm(*block_pages) if block_pages else max_page_size
    target_page_size = cdiv(max_page_size, step) * step
    if target_page_size != max_page_size:
        logger.info(
            "Unifying KV cache page size at %d bytes, %.1f%% above the largest "
            "page (%d bytes): the attention pages do not divide it.",
            target_page_size,
            100 * (target_page_size - max_page_size) / max_page_size,
            max_page_size,
        )

    new_kv_cache_spec = {}
    for layer_name, layer_spec in kv_cache_spec.items():
        layer_page_size = layer_spec.page_size_bytes
        if layer_page_size == target_page_size:
            new_spec = layer_spec
        elif isinstance(layer_spec, MambaSpec):
            new_spec = replace(layer_spec, page_size_padded=target_page_size)
        else:
            ratio = target_page_size // layer_page_size
            new_spec = replace(layer_spec, block_size=layer_spec.block_size * ratio)
        if new_spec.page_size_bytes != target_page_size:
            raise NotImplementedError(
                f"Cannot unify the page size of layer {layer_name} "
                f"({layer_page_size} bytes) to {target_page_size} bytes."
            )
        new_kv_cache_spec[layer_name] = new_spec
    return new_kv_cache_spec
'''


class UnifyPagesAtAttentionLcm(Codemod):
    """Replace ``unify_kv_cache_spec_page_size`` with the LCM pad-up version."""

    target = "v1/core/kv_cache_utils.py"
    anchor = (func(UNIFY_PAGE_SIZE),)
    patched = (func(UNIFY_PAGE_SIZE, leading_lines=marked("P5")),)

    def rewrite(self, node):
        (new,) = statements(NEW_FUNCTION)
        return with_marker(new.with_changes(leading_lines=node.leading_lines), "P5", WHY)


# -- upstream detection ------------------------------------------------------------------------
# Two places upstream prevents the failure (see "Verdicts across releases" above): the platform
# sizes the hybrid attention page from TurboQuant's packed layout, so the Mamba page is padded
# to the page the TurboQuant layers really have; and ``unify_kv_cache_spec_page_size`` pads
# Mamba pages itself instead of scaling their block size.

# Both recognisers are shared with P5b (kiln/patch/shapes.py).


class P5(Patch):
    id = "P5"
    family = "kv_cache"
    title = "Hybrid KV page-size unification by LCM pad-up (attention scales, Mamba pads)"
    why = (
        "unify_kv_cache_spec_page_size raises NotImplementedError when hybrid attention and "
        "Mamba pages do not divide (TurboQuant + GDN/Mamba). Unify at a multiple of the LCM of "
        "the attention pages: attention grows by whole blocks, Mamba pages are padded."
    )
    written_for = ">=0.20.1"
    edits = (UnifyPagesAtAttentionLcm,)

    def upstream_fix(self, module_of) -> str | None:
        found = []
        platform = platform_sizes_turboquant_pages(module_of)
        if platform:
            found.append(
                f"{platform}: Platform._align_hybrid_block_size sizes the attention page from "
                "TurboQuant's packed layout, so Mamba pages are padded to the real TurboQuant page "
                "(vllm#39931)"
            )
        unify = unify_pads_pages(module_of, "MambaSpec")
        if unify:
            found.append(f"{unify}: {UNIFY_PAGE_SIZE} pads Mamba pages to the largest page instead of raising (vllm#45207)")
        return "; ".join(found) or None
