"""What reaches the TurboQuant kernels at runtime, derived from each pin's own vLLM code, against
the tensors kiln's worker launches with (``kiln/triton/runtime_layout.py``, ``worker.py``).

Triton picks a compiled kernel by its constexprs (``BLOCK_SIZE`` = ``kv_cache.shape[1]``,
``NUM_KV_HEADS``, ...), each plain int argument's class (== 1, divisible by 16, other), each
pointer's dtype and 16-byte alignment. For every shipped image, pin and block size this test
runs the pin's real code on CPU torch where it can be loaded alone:

- the kernel block size: ``select_common_block_size`` (``v1/worker/utils.py``) with the
  TurboQuant backend's own ``get_supported_kernel_block_sizes``;
- the cache view: 0.20.1 ``GPUModelRunner._reshape_kv_cache_tensors`` (then the hybrid
  re-layout) with the backend's ``get_kv_cache_shape``; 0.33.0 ``customize_attention_spec``,
  the planner's strides (``compute_layout_strides``) and ``create_kv_cache_views`` in the
  backend's layout, then the backend's ``transpose(1, 2)``;
- the block table width: 0.33.0 ``get_block_table_width`` times the kernel blocks per block;
- the continuation path's ``seq_lens``: the slice the pin's backend takes, over cached lengths.

Where the rule is a line of code rather than a loadable function, the test asserts that line is
in the pin's source, so a pin that changes it fails here instead of compiling the wrong variant.
"""

from __future__ import annotations

import math
import sys
import textwrap
import types
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from math import prod

import pytest
import torch

from kiln import paths
from kiln.definitions import load_definitions
from kiln.pins import load_pins
from kiln.triton import worker
from kiln.triton.aot import KernelSources
from kiln.triton.kernels import launch_plan
from kiln.triton.runtime_layout import (
    block_table_width,
    kernel_block_size,
    layout_for,
    vllm_version,
)
from tests.patchsets.support.patchlib import extract, extract_all

TQ = "v1/attention/backends/turboquant_attn.py"
TQ_CONFIG = "model_executor/layers/quantization/turboquant/config.py"
PINS = ("v0.20.1", "v0.33.0")


def _exec(source: str, namespace: dict, name: str) -> dict:
    exec(compile("from __future__ import annotations\n" + source, name, "exec"), namespace)
    return namespace


def _cls(value: int) -> str:
    """Triton's specialisation class of an int argument."""
    return "1" if value == 1 else "16" if value % 16 == 0 else "other"


def _tensor_classes(t: torch.Tensor, dims: int) -> tuple:
    return (t.dtype, tuple(_cls(t.stride(i)) for i in range(dims)), t.data_ptr() % 16 == 0)


@pytest.fixture
def tq_config_module(trees, monkeypatch):
    """``vllm....turboquant.config`` of a pin, importable by name (the worker and the backend import it)."""

    def load(tree):
        names = ["vllm", "vllm.model_executor", "vllm.model_executor.layers",
                 "vllm.model_executor.layers.quantization", "vllm.model_executor.layers.quantization.turboquant"]
        for name in names:
            monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
        module = types.ModuleType(names[-1] + ".config")
        monkeypatch.setitem(sys.modules, module.__name__, module)
        exec(compile(tree.read(TQ_CONFIG), TQ_CONFIG, "exec"), module.__dict__)
        return module

    return load


def _backend_class(tree, names: Sequence[str], **namespace) -> type:
    """A class holding the TurboQuant backend's own methods ``names``."""
    tq = tree.read(TQ)
    body = "\n".join(textwrap.indent(src, "    ") for src in extract_all(tq, [f"TurboQuantAttentionBackend.{n}"
                                                                          for n in names]).values())
    backend_text = tree.read("v1/attention/backend.py")
    _exec(extract(backend_text, "MultipleOf"), namespace | {"dataclass": dataclass}, "backend.py")
    return _exec(f"class TurboQuantBackend:\n{body}\n", namespace, TQ)["TurboQuantBackend"]


def runtime_block_size_rule(tree):
    """vLLM's own ``select_common_block_size`` of ``tree``, bound to the TurboQuant backend: manager
    block size -> kernel block size (the source is extracted once, then called for each size)."""
    utils = tree.read("v1/worker/utils.py")
    names = [n for n in ("_block_size_is_supported", "select_common_block_size") if f"def {n}(" in utils]
    backend_text = tree.read("v1/attention/backend.py")
    namespace = _exec(extract(backend_text, "MultipleOf"), {"dataclass": dataclass}, "backend.py")
    _exec("\n\n".join(extract_all(utils, names).values()), namespace, "v1/worker/utils.py")
    backends = [_backend_class(tree, ["get_name", "get_supported_kernel_block_sizes"])]
    return lambda manager_block_size: namespace["select_common_block_size"](manager_block_size, backends)


def runtime_kernel_block_size(tree, manager_block_size: int) -> int:
    return runtime_block_size_rule(tree)(manager_block_size)


@dataclass(frozen=True)
class _TQSpec:
    """The fields of vLLM's TurboQuant attention spec that the view code reads."""

    block_size: int
    num_kv_heads: int
    head_size: int
    slot: int
    dtype: torch.dtype = torch.uint8
    page_size_padded: int | None = None
    block_stride_alignment: object = field(default=None, kw_only=True)
    state_content_bytes: int | None = field(default=None, kw_only=True)

    # 0.33.0 names
    num_heads = property(lambda self: self.num_kv_heads)
    state_content_size_bytes = property(lambda self: self.slot)
    storage_block_size = property(lambda self: self.block_size)

    def get_num_kernel_states(self, kernel_block_size: int) -> int:
        return kernel_block_size

    @property
    def page_size_bytes(self) -> int:
        return self.block_size * self.num_kv_heads * self.slot

    def copy_with_new_block_size(self, block_size: int):
        return replace(self, block_size=block_size)


def runtime_kv_cache_0201(tree, spec: _TQSpec, kernel_bs: int, cache_dtype: str, num_blocks: int = 3) -> torch.Tensor:
    runner = tree.read("v1/worker/gpu_model_runner.py")
    methods = extract_all(runner, ["GPUModelRunner._reshape_kv_cache_tensors",
                                   "GPUModelRunner._update_hybrid_attention_mamba_layout"])
    assert "def get_kv_cache_stride_order" not in tree.read(TQ)  # the identity order below
    block_dim = extract(tree.read("v1/attention/backend.py"), "AttentionBackend.get_kv_cache_block_dim")
    backend = _backend_class(tree, ["get_kv_cache_shape"])
    ns = _exec(block_dim, {}, "backend.py")
    backend.get_kv_cache_block_dim = classmethod(ns["get_kv_cache_block_dim"])

    class Mamba:
        pass

    ns = _exec("\n\n".join(methods.values()), {"torch": torch, "AttentionSpec": _TQSpec, "MambaSpec": Mamba,
                                                "get_dtype_size": lambda d: torch.empty((), dtype=d).element_size()},
               "v1/worker/gpu_model_runner.py")
    group = types.SimpleNamespace(kv_cache_spec=spec, backend=backend, kv_cache_group_id=0, layer_names=["attn"])
    runner_self = types.SimpleNamespace(runner_only_attn_layers=set(), cache_config=types.SimpleNamespace(
        cache_dtype=cache_dtype), _kv_cache_spec_attn_group_iterator=lambda: iter([group]))
    raw = {"attn": torch.zeros(num_blocks * spec.page_size_bytes, dtype=torch.int8)}
    caches = ns["_reshape_kv_cache_tensors"](runner_self, raw, [kernel_bs])
    ns["_update_hybrid_attention_mamba_layout"](runner_self, caches, [kernel_bs])  # the model is hybrid
    return caches["attn"]


def runtime_kv_cache_0330(tree, spec: _TQSpec, manager_bs: int, num_blocks: int = 3) -> torch.Tensor:
    kvi = tree.read("v1/kv_cache_interface.py")
    layout_ns = _exec(tree.read("v1/kv_cache_layout.py"), {}, "v1/kv_cache_layout.py")
    ns = {"torch": torch, "prod": prod, "dataclass": dataclass, "math": math, **layout_ns}
    backend_text = tree.read("v1/attention/backend.py")
    _exec(extract(backend_text, "MultipleOf"), ns, "backend.py")
    _exec("\n\n".join(extract_all(kvi, ["compute_layer_kv_cache_shape_bytes", "compute_layout_strides",
                                        "create_kv_cache_views", "KVCacheTensor"]).values()), ns, "kv_cache_interface.py")
    method = extract(kvi, "KVCacheSpec.get_block_stride_alignment")
    assert "from vllm.v1.attention.backend import MultipleOf" in method  # given below
    method = method.replace("from vllm.v1.attention.backend import MultipleOf", "")
    alignment = _exec(method, {"math": math, "MultipleOf": ns["MultipleOf"]},
                      "kv_cache_interface.py")["get_block_stride_alignment"]
    utils = tree.read("v1/worker/utils.py")
    backend = _backend_class(tree, ["get_name", "get_supported_kernel_block_sizes", "supported_kv_cache_layouts",
                                    "customize_spec"], KVCacheLayout=ns["KVCacheLayout"])
    backend.customize_spec = classmethod(lambda cls, s: replace(s, state_content_bytes=s.slot))
    customize = _exec(extract(utils, "customize_attention_spec"), {"replace": replace, "MultipleOf": ns["MultipleOf"]},
                      "v1/worker/utils.py")["customize_attention_spec"]
    spec = customize(backend, spec)
    layout = backend.supported_kv_cache_layouts()[0]
    # the planner (kv_cache_planning.get_kv_cache_config_from_groups): the page padded to its alignment
    page = spec.page_size_bytes
    padded = -(-page // alignment(spec)) * alignment(spec)
    planning = tree.read("v1/core/kv_cache_planning.py")
    assert "padded_page = _get_layer_block_stride(spec)" in planning
    block_stride = None if padded == page else padded
    layer_stride, block_stride, *_ = ns["compute_layout_strides"](spec, num_blocks, 2, layout,
                                                                  fixed_strides=(None, block_stride, None, None, None))
    tensor = ns["KVCacheTensor"](size=2 * layer_stride, layers=["a", "b"], layer_stride=layer_stride,
                                 block_stride=block_stride)
    # prepare_kernel_block_sizes: a layer-outer tensor lets the group split its blocks
    assert "t.block_stride > t.layer_stride" in utils
    kernel = manager_bs if block_stride > layer_stride else runtime_kernel_block_size(tree, manager_bs)
    raw = torch.zeros(tensor.size, dtype=torch.int8)
    views = ns["create_kv_cache_views"](raw, spec, num_blocks, layout, tensor, kernel_block_size=kernel)
    assert tree.read(TQ).count("kv_cache = kv_cache.transpose(1, 2)") == 2  # forward and the KV store
    return views[1].transpose(1, 2)  # the second layer: its own offset into the allocation


def runtime_table_width(tree, manager_bs: int, kernel_bs: int, max_model_len: int) -> int:
    ratio = manager_bs // kernel_bs
    if "def get_block_table_width(" not in tree.read("v1/worker/block_table.py"):
        # 0.20.1 MultiGroupBlockTable / BlockTable: kernel ids of cdiv(max_model_len, block) blocks per row
        text = tree.read("v1/worker/block_table.py")
        assert "cdiv(max_model_len, block_size * total_cp_world_size)" in text
        assert "self.max_num_blocks_per_req = max_num_blocks_per_req * self.blocks_per_kv_block" in text
        return -(-max_model_len // manager_bs) * ratio
    utils = tree.read("v1/worker/utils.py")
    assert "width = get_block_table_width(max_num_blocks, self.kv_cache_spec.block_size)" in utils
    assert "width *= self.kv_cache_spec.block_size // kernel_block_size" in utils
    ns = _exec(extract(tree.read("v1/worker/block_table.py"), "get_block_table_width"),
               {"math": math, "cdiv": lambda a, b: -(-a // b)}, "block_table.py")
    return ns["get_block_table_width"](-(-max_model_len // manager_bs), manager_bs) * ratio


def runtime_seq_lens_alignments(tree) -> set[bool]:
    """16-byte alignment of the continuation path's seq_lens over cached lengths."""
    text = tree.read(TQ)
    if "synth_seq_lens = _arange_cache[cached_len + 1 : seq_len + 1]" in text:
        cache = torch.arange(0, 64, dtype=torch.int32)
        return {cache[cached + 1: cached + 5].data_ptr() % 16 == 0 for cached in range(8)}
    assert "synth_seq_lens = torch.arange(" in text
    return {torch.arange(5, 9, dtype=torch.int32).data_ptr() % 16 == 0}


def _shipped(catalogue):
    pins = load_pins(paths.PINS)
    return [image for image in load_definitions(paths.IMAGES, catalogue, pins) if image.model.kernels]


def _worker_calls(builder, preset, params) -> list[tuple[tuple, dict]]:
    calls = []
    getattr(worker, f"build_{builder}")(lambda *a, **k: calls.append((a, k)), preset.to_json(), params)
    return calls


@pytest.mark.parametrize("pin", PINS)
def test_worker_launches_what_the_pin_runtime_hands_the_kernels(catalogue, trees, tq_config_module, pin):
    tree = trees(pin)
    config = tq_config_module(tree)
    layout = KernelSources({}, tree.root).runtime_layout()
    alignments = runtime_seq_lens_alignments(tree)
    found = []
    for image in _shipped(catalogue):
        preset = image.model.kernels
        cfg = config.TurboQuantConfig.from_cache_dtype(image.model.kv_cache_dtype, preset.head_dim)
        plan = launch_plan(preset, layout)
        for manager in preset.block_sizes:
            kernel = runtime_kernel_block_size(tree, manager)
            spec = _TQSpec(manager, preset.num_kv_heads, preset.head_dim, cfg.slot_size_aligned)
            if pin == "v0.20.1":
                cache = runtime_kv_cache_0201(tree, spec, kernel, image.model.kv_cache_dtype)
            else:
                cache = runtime_kv_cache_0330(tree, spec, manager)
            assert tuple(cache.shape[1:]) == (kernel, preset.num_kv_heads, cfg.slot_size_aligned)
            width = runtime_table_width(tree, manager, kernel, preset.max_model_len)
            table = torch.zeros(preset.max_num_seqs, width, dtype=torch.int32)
            found.append((image.name, manager, kernel, cache.stride()[:3], width))
            launches = [p["params"] for p in plan if p["params"]["block_size"] == manager]
            seen_alignments = set()
            for params in launches:
                for args, kwargs in _worker_calls(next(p["builder"] for p in plan if p["params"] is params),
                                                  preset, params):
                    kv = kwargs.get("kv_cache", args[2] if args else None)
                    where = (image.name, pin, params)
                    assert kv.shape[1:] == cache.shape[1:], where  # BLOCK_SIZE, NUM_KV_HEADS, slot
                    assert _tensor_classes(kv, 3) == _tensor_classes(cache, 3), where
                    if "block_table" not in kwargs:
                        continue
                    bt = kwargs["block_table"]
                    expected = table[0:1].expand(params["batch"], -1) if params.get("continuation") else table
                    assert _tensor_classes(bt, 1) == _tensor_classes(expected, 1), where
                    seq = kwargs["seq_lens"]
                    assert seq.dtype == torch.int32
                    if params.get("continuation"):
                        seen_alignments.add(seq.data_ptr() % 16 == 0)
                        continue
                    q = kwargs["query"]
                    runtime_q = torch.zeros(8 * params["batch"], preset.num_heads, preset.head_dim,
                                            dtype=q.dtype)[: params["batch"]]
                    assert _tensor_classes(q, 2) == _tensor_classes(runtime_q, 2), where
                    splits = 32  # AttentionConfig.tq_max_kv_splits_for_cuda_graph
                    assert "tq_max_kv_splits_for_cuda_graph: int = 32" in tree.read("config/attention.py")
                    mid_o = torch.empty(params["batch"], preset.num_heads, splits, preset.head_dim + 1)
                    assert _tensor_classes(kwargs["mid_o_buf"], 3) == _tensor_classes(mid_o, 3), where
            assert seen_alignments == alignments, (image.name, pin, manager)
    print(pin, found)  # -s shows what the runtime hands the kernels per image and block size


def test_kernel_block_sizes_of_the_shipped_presets(trees):
    """The suspicion, pinned down: the kernels never see the manager's block size of these presets."""
    for pin in PINS:
        tree = trees(pin)
        assert [runtime_kernel_block_size(tree, b) for b in (3136, 2080, 4192, 2768)] == [64, 32, 32, 16]
        assert runtime_kernel_block_size(tree, 64) == 64


def test_kiln_rule_agrees_with_select_common_block_size_on_every_multiple_of_16(trees):
    for pin in PINS:
        runtime = runtime_block_size_rule(trees(pin))
        for manager in range(16, 4097, 16):
            assert kernel_block_size(manager) == runtime(manager), (pin, manager)
    assert kernel_block_size(100) is None


def test_layout_follows_the_source_version():
    assert vllm_version("__version__ = version = '0.33.0'\n") == (0, 33, 0)
    assert vllm_version("__version__ = version = '0.21.0rc2.dev145+g0123abc'\n") == (0, 21, 0)
    assert vllm_version("version = 'x'") is None
    assert not layout_for((0, 20, 1)).continuation_seq_lens_sliced and layout_for((0, 20, 1)).name == "0.20.1"
    assert layout_for((0, 21, 0)).continuation_seq_lens_sliced and layout_for((0, 31, 0)).table_token_alignment is None
    assert layout_for((0, 33, 0)).table_token_alignment == 128 and layout_for((0, 40, 0)).name == "0.33.0"
    # the 35B-A3B at 262144 tokens: 63 manager blocks of 4192 -> 131 kernel blocks each (0.20.1);
    # 95 blocks of 2768 padded to 96 (128-token rows) -> 173 kernel blocks each (0.33.0)
    assert block_table_width(layout_for((0, 20, 1)), 4192, 262144) == 63 * 131
    assert block_table_width(layout_for((0, 33, 0)), 2768, 262144) == 96 * 173
