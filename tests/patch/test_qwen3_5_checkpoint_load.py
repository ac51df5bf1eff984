"""The 27B image's checkpoint layout loads right on every pin (Genesis PN520, vllm#47058).

Genesis's PN520 says that after vllm#47058 (``Qwen3_5Model.load_weights`` replaced by a
``WeightsMapper(orig_to_new_stacked=...)`` and ``AutoWeightsLoader``; 0.23.1rc1.dev630 and later,
so 0.32.0 and 0.33.0 here) the split GDN shards ``linear_attn.in_proj_b`` / ``in_proj_a`` of
``Lorbus/Qwen3.6-27B-int4-AutoRound``, which AutoRound keeps in 16 bits (``extra_config`` bits 16,
data_type fp) while the rest is INT4, no longer reach the fused ``in_proj_ba``. This test builds a
tiny checkpoint with that layout and the 27B's names, runs each pin's real loading code into
the parameters, and compares every loaded tensor with the checkpoint. Besides the pins (0.20.1,
0.32.0, 0.33.0) it runs 0.24.0, the last release with the imperative loader, and 0.25.0, the first
with the declarative one (0.24.0 was branched before vllm#47058 merged).

The checkpoint (known values, exact in float16 and bfloat16): the names the 27B stores, as
``Qwen3_5ForConditionalGeneration`` reads them: ``model.language_model.embed_tokens``, a GDN
layer (``linear_attn.in_proj_qkv`` / ``in_proj_z`` INT4, ``in_proj_b`` / ``in_proj_a`` BF16,
``conv1d``, ``A_log``, ``dt_bias``, ``norm``, ``out_proj`` INT4), a gated full-attention layer
(``self_attn.q_proj`` with the output gate, ``k_proj``, ``v_proj``, ``o_proj`` INT4, ``q_norm``,
``k_norm``), INT4 MLPs, the norms, ``lm_head`` and the MTP head (``mtp.fc``, ``mtp.layers.0.*``,
``mtp.norm``, ``mtp.pre_fc_norm_*``: the main model must leave them to the drafter). INT4 is
AutoRound's ``auto_round:auto_gptq`` packing, symmetric, group size 32: ``qweight`` int32 with 8
input rows per word, ``qzeros`` int32 with 8 output columns per word, float16 ``scales``. The
quantization config is AutoRound's: ``quant_method`` auto-round, bits 4, ``block_name_to_quantize``
``model.language_model.layers``, and an ``extra_config`` entry ``{"bits": 16, "data_type": "fp"}``
for every ``linear_attn.in_proj_a`` / ``in_proj_b`` (on the pins also a second time with one regex
entry for them all, a form vLLM's INC parser reads too; the 27B's real config.json was not read
here: no access to the Hugging Face hub; the layout is the one the issue and Genesis describe).

What runs is each pin's own code (``tests/support/vllm_modules.py`` imports the tree's files as
the real modules): ``model_executor/layers/linear.py`` (the linear layers, their weight loaders and,
on the declarative releases, ``MergedColumnParallelLinear.load_weights``), ``parameter.py``, ``models/utils.py``
(``WeightsMapper``, ``AutoWeightsLoader``), ``vocab_parallel_embedding.py``, the quantization
package with the AutoRound config that picks each layer's method from the real prefixes
(``layers/quantization/inc/`` from 0.24.0, ``inc.py`` on 0.20.1) and the GPTQ-Marlin linear method
that creates the INT4 parameters (``auto_gptq.py`` from 0.24.0, ``gptq_marlin.py`` on 0.20.1); from ``models/qwen3_5.py``, ``qwen3_next.py``, ``qwen3_vl.py`` (whose modules import the
whole engine) the three ``load_weights`` methods of ``Qwen3_5ForConditionalGeneration``,
``Qwen3_5ForCausalLMBase`` and ``Qwen3_5Model`` and the classes' ``hf_to_vllm_mapper`` and
``packed_modules_mapping``, executed from the tree's text; the GDN layer's own
``create_qkvz_proj`` / ``create_ba_proj`` (``qwen_gdn_linear_attn.py``, ``gdn_linear_attn.py`` on
0.20.1) build its fused projections; ``sharded_weight_loader`` / ``default_weight_loader``
(``model_loader/weight_utils.py``) and ``mamba_v2_sharded_weight_loader`` (``mamba_mixer2.py``)
load ``A_log``, ``dt_bias`` and ``conv1d``. The quantization config goes through the steps of
``configure_quant_config`` (``model_loader/utils.py``): the top class's mapper (its rename part on
0.33.0) over ``extra_config`` and its ``packed_modules_mapping``.

Stood in: the module tree itself (``nn.Module`` holders with the real attribute names, built the
way the real ``__init__`` methods build them, instead of the model classes, whose modules need the
engine); the norms (a plain weight parameter, as ``RMSNorm`` has); tensor parallelism (one rank);
the platform (CUDA's choices where they matter: ``maybe_disable_tp`` replicates ``in_proj_ba``, as
for INC on CUDA; the same at one rank); the MoE- and ROCm-only helpers of some releases'
``load_weights`` (no experts, no AITER shared-expert fusion: a dense model on CUDA); the CUDA-only
Marlin capability checks
(``check_marlin_supported`` true, as on the images' GPUs) and the Marlin kernel choice (its
``process_weights_after_loading`` repacking for the GPU is not run: the comparison is of the
parameters as loaded). The vision tower is left out of the checkpoint. Any other stub the harness
puts in place of a vLLM module must not be called while the model is built and loaded
(``ALLOWED_STUBS``): no stand-in does work whose result the comparison depends on.

The test can fail: a deliberately broken mapping (``in_proj_b`` / ``in_proj_a`` swapped in 0.33.0's
``orig_to_new_stacked``) and a shard that never reaches the model (Genesis's "in_proj_ba left
uninitialised"; every parameter starts as NaN or -1) both fail the comparison.
"""

from __future__ import annotations

import contextlib
import logging
import types
from pathlib import Path

import libcst as cst
import pytest
import torch
from packaging.version import Version
from torch import nn

from kiln.source.wheel import WheelSource
from tests.patchsets.support.patchlib import extract, run_defs
from tests.support.vllm_modules import VllmModules, in_child, stub

pytestmark = pytest.mark.network  # the pins' wheels, from PyPI

PINS = ["v0.20.1", "cpu-v0.32.0", "v0.33.0"]
# Besides the pins: the last release with the imperative loader and the first with vllm#47058's
# declarative one (0.24.0 was branched before the merge), the release Genesis's bisection points at.
RELEASES = {"vllm-0.24.0": "0.24.0", "vllm-0.25.0": "0.25.0"}

# Tiny Qwen3.6-27B: the 27B's structure (GDN layers and gated full attention, dense MLP), small sizes
HIDDEN = 64
VOCAB = 128
INTER = 96
GDN_K_HEADS, GDN_K_DIM = 2, 16  # key_dim 32
GDN_V_HEADS, GDN_V_DIM = 4, 16  # value_dim 64, num_v_heads 4 (in_proj_b/in_proj_a out 4)
CONV_KERNEL = 4
HEADS, KV_HEADS, HEAD_DIM = 2, 1, 32
LAYER_TYPES = ["linear_attention", "full_attention"]
GROUP = 32
BITS = 4
PACK = 32 // BITS
DTYPE = torch.float16  # the images serve with --dtype float16

GENERATOR = torch.Generator().manual_seed(520)


def _values(*shape, dtype=torch.bfloat16):
    """Known values exact in bfloat16 and float16: multiples of 1/64 in (-2, 2)."""
    return (torch.randint(-127, 128, shape, generator=GENERATOR).to(torch.float32) / 64).to(dtype)


def _int4(out_features: int, in_features: int) -> dict[str, torch.Tensor]:
    """An AutoRound auto_gptq INT4 linear: qweight, qzeros, scales (symmetric: zero point 8)."""
    assert in_features % PACK == 0 and in_features % GROUP == 0 and out_features % PACK == 0
    q = torch.randint(0, 16, (in_features, out_features), generator=GENERATOR, dtype=torch.int32)
    qweight = torch.zeros(in_features // PACK, out_features, dtype=torch.int32)
    for i in range(PACK):
        qweight |= q[i::PACK] << (BITS * i)
    zeros = torch.full((in_features // GROUP, out_features), 8, dtype=torch.int32)
    qzeros = torch.zeros(in_features // GROUP, out_features // PACK, dtype=torch.int32)
    for i in range(PACK):
        qzeros |= zeros[:, i::PACK] << (BITS * i)
    scales = (torch.randint(1, 64, (in_features // GROUP, out_features), generator=GENERATOR) / 256).to(torch.float16)
    return {"qweight": qweight, "qzeros": qzeros, "scales": scales}


def dequantize(qweight, qzeros, scales) -> torch.Tensor:
    """GPTQ layout back to a float [out, in] matrix (as the checkpoint means it)."""
    shifts = torch.arange(PACK, dtype=torch.int32) * BITS
    q = ((qweight.unsqueeze(1) >> shifts.view(1, -1, 1)) & 0xF).reshape(-1, qweight.shape[1])
    z = ((qzeros.unsqueeze(2) >> shifts.view(1, 1, -1)) & 0xF).reshape(qzeros.shape[0], -1)
    groups = torch.arange(q.shape[0]) // GROUP
    return ((q - z[groups]).to(torch.float32) * scales[groups].to(torch.float32)).t()


def checkpoint() -> dict[str, torch.Tensor]:
    """The 27B's tensor names (Qwen3_5ForConditionalGeneration), tiny, with known values."""
    ckpt: dict[str, torch.Tensor] = {}

    def int4(name, out_f, in_f):
        for suffix, tensor in _int4(out_f, in_f).items():
            ckpt[f"{name}.{suffix}"] = tensor

    lm = "model.language_model"
    ckpt[f"{lm}.embed_tokens.weight"] = _values(VOCAB, HIDDEN)
    key_dim, value_dim = GDN_K_HEADS * GDN_K_DIM, GDN_V_HEADS * GDN_V_DIM
    for i, kind in enumerate(LAYER_TYPES):
        p = f"{lm}.layers.{i}"
        if kind == "linear_attention":
            int4(f"{p}.linear_attn.in_proj_qkv", 2 * key_dim + value_dim, HIDDEN)
            int4(f"{p}.linear_attn.in_proj_z", value_dim, HIDDEN)
            ckpt[f"{p}.linear_attn.in_proj_b.weight"] = _values(GDN_V_HEADS, HIDDEN)
            ckpt[f"{p}.linear_attn.in_proj_a.weight"] = _values(GDN_V_HEADS, HIDDEN)
            ckpt[f"{p}.linear_attn.conv1d.weight"] = _values(2 * key_dim + value_dim, 1, CONV_KERNEL)
            ckpt[f"{p}.linear_attn.A_log"] = _values(GDN_V_HEADS, dtype=torch.float32)
            ckpt[f"{p}.linear_attn.dt_bias"] = _values(GDN_V_HEADS)
            ckpt[f"{p}.linear_attn.norm.weight"] = _values(GDN_V_DIM)
            int4(f"{p}.linear_attn.out_proj", HIDDEN, value_dim)
        else:
            int4(f"{p}.self_attn.q_proj", 2 * HEADS * HEAD_DIM, HIDDEN)  # query and output gate
            int4(f"{p}.self_attn.k_proj", KV_HEADS * HEAD_DIM, HIDDEN)
            int4(f"{p}.self_attn.v_proj", KV_HEADS * HEAD_DIM, HIDDEN)
            int4(f"{p}.self_attn.o_proj", HIDDEN, HEADS * HEAD_DIM)
            ckpt[f"{p}.self_attn.q_norm.weight"] = _values(HEAD_DIM)
            ckpt[f"{p}.self_attn.k_norm.weight"] = _values(HEAD_DIM)
        int4(f"{p}.mlp.gate_proj", INTER, HIDDEN)
        int4(f"{p}.mlp.up_proj", INTER, HIDDEN)
        int4(f"{p}.mlp.down_proj", HIDDEN, INTER)
        ckpt[f"{p}.input_layernorm.weight"] = _values(HIDDEN)
        ckpt[f"{p}.post_attention_layernorm.weight"] = _values(HIDDEN)
    ckpt[f"{lm}.norm.weight"] = _values(HIDDEN)
    ckpt["lm_head.weight"] = _values(VOCAB, HIDDEN)
    # the MTP head (BF16: outside block_name_to_quantize); the drafter's own model loads it
    ckpt["mtp.fc.weight"] = _values(HIDDEN, 2 * HIDDEN)
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        ckpt[f"mtp.{name}.weight"] = _values(HIDDEN)
    for proj, (out_f, in_f) in {"q_proj": (2 * HEADS * HEAD_DIM, HIDDEN), "k_proj": (KV_HEADS * HEAD_DIM, HIDDEN),
                                "v_proj": (KV_HEADS * HEAD_DIM, HIDDEN), "o_proj": (HIDDEN, HEADS * HEAD_DIM)}.items():
        ckpt[f"mtp.layers.0.self_attn.{proj}.weight"] = _values(out_f, in_f)
    ckpt["mtp.layers.0.mlp.gate_proj.weight"] = _values(INTER, HIDDEN)
    return ckpt


def quantization_config(keys: str = "names") -> dict:
    """AutoRound's config; ``keys``: "names" (one extra_config entry per layer, as AutoRound writes
    them) or "regex" (one pattern for them all, which vLLM's INC parser also reads)."""
    extra = {}
    for i, kind in enumerate(LAYER_TYPES):
        if kind == "linear_attention":
            for proj in ("in_proj_a", "in_proj_b"):
                extra[f"model.language_model.layers.{i}.linear_attn.{proj}"] = {"bits": 16, "data_type": "fp"}
    if keys == "regex":
        extra = {r".*linear_attn\.in_proj_[ab]$": {"bits": 16, "data_type": "fp"}}
    return {
        "quant_method": "auto-round",
        "bits": BITS,
        "group_size": GROUP,
        "sym": True,
        "data_type": "int",
        "packing_format": "auto_round:auto_gptq",
        "block_name_to_quantize": "model.language_model.layers",
        "extra_config": extra,
    }


# ── the pin's code ──────────────────────────────────────────────────────────────────────────


def class_attr(source: str, cls: str, name: str, namespace: dict):
    """The value of ``cls``'s class-level ``name = ...`` in ``source``, evaluated in ``namespace``."""
    module = cst.parse_module(source)
    (node,) = [n for n in module.body if isinstance(n, cst.ClassDef) and n.name.value == cls]
    for statement in node.body.body:
        if not isinstance(statement, cst.SimpleStatementLine):
            continue
        for small in statement.body:
            if isinstance(small, cst.Assign) and any(
                isinstance(t.target, cst.Name) and t.target.value == name for t in small.targets
            ) or isinstance(small, cst.AnnAssign) and isinstance(small.target, cst.Name) and small.target.value == name:
                return eval(module.code_for_node(small.value), namespace)
    raise AssertionError(f"{cls}.{name}: not in the source")


class _Platform:
    """CUDA, for the choices the loading code makes; nothing else runs on it."""

    def is_cuda(self):
        return True

    def is_cuda_alike(self):
        return True

    def use_sync_weight_loader(self):
        return False

    def __getattr__(self, name):
        if name.startswith("is_"):
            return lambda *a, **k: False
        return stub(f"current_platform.{name}")


REAL = [
    "vllm.model_executor.parameter",
    "vllm.model_executor.utils",
    "vllm.model_executor.layers.linear",
    "vllm.model_executor.layers.vocab_parallel_embedding",
    "vllm.model_executor.models.utils",
    "vllm.model_executor.layers.quantization",
    "vllm.model_executor.layers.quantization.base_config",
    # from 0.24.0: the INC package and AutoGPTQ's Marlin method
    "vllm.model_executor.layers.quantization.inc",
    "vllm.model_executor.layers.quantization.inc.inc",
    "vllm.model_executor.layers.quantization.inc.config_parser",
    "vllm.model_executor.layers.quantization.inc.inc_linear",
    "vllm.model_executor.layers.quantization.inc.schemes",
    "vllm.model_executor.layers.quantization.inc.schemes.factory",
    "vllm.model_executor.layers.quantization.inc.schemes.inc_scheme",
    "vllm.model_executor.layers.quantization.inc.schemes.inc_wna16_scheme",
    "vllm.model_executor.layers.quantization.inc.schemes.inc_wna16_linear",
    "vllm.model_executor.layers.quantization.inc.schemes.inc_fp8_scheme",
    "vllm.model_executor.layers.quantization.inc.schemes.inc_mxfp4_scheme",
    "vllm.model_executor.layers.quantization.inc.schemes.inc_mxfp8_scheme",
    "vllm.model_executor.layers.quantization.utils.gptq_utils",
    "vllm.model_executor.layers.quantization.auto_gptq",
    # 0.20.1: one INC module and GPTQ-Marlin
    "vllm.model_executor.layers.quantization.gptq_marlin",
]


def _standins(root: Path) -> dict:
    vllm = root / "vllm"
    marlin = (vllm / "model_executor/layers/quantization/utils/marlin_utils.py").read_text()
    marlin_ns = run_defs(marlin, ["marlin_repeat_scales_on_all_ranks"], {"torch": torch},
                         "model_executor/layers/quantization/utils/marlin_utils.py")
    marlin_ns.update(
        # CUDA-only: the kernels' capability checks (true on the images' GPUs)
        check_marlin_supported=lambda *a, **k: True,
        verify_marlin_supported=lambda *a, **k: None,
        check_moe_marlin_supports_layer=lambda *a, **k: True,
    )
    weight_utils = (vllm / "model_executor/model_loader/weight_utils.py").read_text()
    names = ["default_weight_loader", "sharded_weight_loader", "maybe_remap_kv_scale_name"]
    weight_utils_ns = run_defs(weight_utils, names, {
        "torch": torch, "logger": logging.getLogger("weight_utils"),
        "get_tensor_model_parallel_rank": lambda: 0, "get_tensor_model_parallel_world_size": lambda: 1,
    }, "model_executor/model_loader/weight_utils.py")
    return {
        "vllm.model_executor.model_loader.weight_utils": {n: weight_utils_ns[n] for n in names},
        "vllm.logger": {"init_logger": _init_logger},
        "vllm.distributed": {
            "get_tensor_model_parallel_rank": lambda: 0,
            "get_tensor_model_parallel_world_size": lambda: 1,
            "divide": _divide,
        },
        "vllm.platforms": {"current_platform": _Platform()},
        "vllm.config": {"get_current_vllm_config_or_none": lambda: None},
        "vllm.model_executor.custom_op": {"PluggableLayer": _PluggableLayer, "CustomOp": _PluggableLayer},
        "vllm.model_executor.layers.quantization.utils.marlin_utils": marlin_ns,
    }


def _init_logger(name):
    """vllm.logger's init_logger: a logger with vLLM's once-only methods (logged every time here)."""
    logger = logging.getLogger(name)
    for level in ("debug", "info", "warning"):
        setattr(logger, f"{level}_once", getattr(logger, level))
    return logger


def _divide(numerator, denominator):
    """vllm.distributed's divide (distributed/utils.py): exact division."""
    assert numerator % denominator == 0, f"{numerator} is not divisible by {denominator}"
    return numerator // denominator


class _PluggableLayer(nn.Module):
    """vLLM's layer registry base: a module whose ``register`` decorator registers nothing here."""

    @classmethod
    def register(cls, name):
        return lambda layer: layer


class _Holder(nn.Module):
    pass


class _Norm(nn.Module):
    def __init__(self, size):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size), requires_grad=False)


class Pin:
    """One pin's real loading code, imported from its tree (inside ``VllmModules``)."""

    def __init__(self, root: Path, vm: VllmModules, broken: bool = False, keys: str = "names"):
        self.root = root
        self.keys = keys
        self.vllm = root / "vllm"
        self.linear = vm.load("vllm.model_executor.layers.linear")
        self.param = vm.load("vllm.model_executor.parameter")
        self.utils = vm.load("vllm.model_executor.models.utils")
        self.vocab = vm.load("vllm.model_executor.layers.vocab_parallel_embedding")
        if (self.vllm / "model_executor/layers/quantization/inc/inc.py").exists():
            self.inc = vm.load("vllm.model_executor.layers.quantization.inc.inc")
        else:
            self.inc = vm.load("vllm.model_executor.layers.quantization.inc")
        self.source = {rel: (self.vllm / "model_executor" / rel).read_text()
                       for rel in ("models/qwen3_5.py", "models/qwen3_next.py", "models/qwen3_vl.py")}
        weight_utils = vm.load("vllm.model_executor.model_loader.weight_utils")
        self.sharded_weight_loader = weight_utils.sharded_weight_loader
        mixer = (self.vllm / "model_executor/layers/mamba/mamba_mixer2.py").read_text()
        ns = run_defs(mixer, ["mamba_v2_sharded_weight_loader"],
                      {"torch": torch, "divide": lambda a, b: a // b,
                       "get_tensor_model_parallel_rank": lambda: 0,
                       "get_tensor_model_parallel_world_size": lambda: 1},
                      "model_executor/layers/mamba/mamba_mixer2.py")
        self.mamba_v2_sharded_weight_loader = ns["mamba_v2_sharded_weight_loader"]
        gdn = next(p for p in ("model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py",
                               "model_executor/layers/mamba/gdn_linear_attn.py") if (self.vllm / p).exists())
        gdn_source = (self.vllm / gdn).read_text()
        gdn_cls = "QwenGatedDeltaNetAttention" if "class QwenGatedDeltaNetAttention" in gdn_source else "GatedDeltaNetAttention"
        self.create_proj = {}
        for method in ("create_qkvz_proj", "create_ba_proj"):
            ns = {"MergedColumnParallelLinear": self.linear.MergedColumnParallelLinear, "torch": torch}
            exec(compile("from __future__ import annotations\n" + extract(gdn_source, f"{gdn_cls}.{method}"), f"vllm/{gdn}", "exec"), ns)
            self.create_proj[method] = ns[method]

        # the classes' mappers and packed-module mappings, from the tree's text
        ns = dict(vars(self.utils))
        self.next_mapper = self._attr("models/qwen3_next.py", "Qwen3NextModel", "hf_to_vllm_mapper", ns, None)
        vl = types.SimpleNamespace(
            hf_to_vllm_mapper=self._attr("models/qwen3_vl.py", "Qwen3VLForConditionalGeneration", "hf_to_vllm_mapper", ns),
            packed_modules_mapping=self._attr("models/qwen3_vl.py", "Qwen3VLForConditionalGeneration", "packed_modules_mapping", ns),
        )
        ns.update(Qwen3NextModel=types.SimpleNamespace(hf_to_vllm_mapper=self.next_mapper),
                  Qwen3VLForConditionalGeneration=vl)
        # inherited from Qwen3VLForConditionalGeneration where the class does not set it (0.20.1)
        self.top_mapper = (self._attr("models/qwen3_5.py", "Qwen3_5ForConditionalGeneration", "hf_to_vllm_mapper", ns, None)
                           or vl.hf_to_vllm_mapper)
        self.top_packed = self._attr("models/qwen3_5.py", "Qwen3_5ForConditionalGeneration", "packed_modules_mapping", ns)
        self.causal_mapper = self._attr("models/qwen3_5.py", "Qwen3_5ForCausalLMBase", "hf_to_vllm_mapper", ns, None)
        self.model_mapper = self._attr("models/qwen3_5.py", "Qwen3_5Model", "hf_to_vllm_mapper", ns, None)
        if broken:  # in_proj_b and in_proj_a swapped: what a wrong mapping does
            stacked = dict(self.model_mapper.orig_to_new_stacked)
            stacked[".in_proj_b"], stacked[".in_proj_a"] = stacked[".in_proj_a"], stacked[".in_proj_b"]
            self.model_mapper.orig_to_new_stacked = stacked
        load_ns = dict(vars(self.utils))
        load_ns.update(
            torch=torch, maybe_remap_kv_scale_name=weight_utils.maybe_remap_kv_scale_name,
            # MoE- and ROCm-only helpers some releases' load_weights reach for: a dense model on CUDA
            # has no experts (0.24.0's fused-expert mapping is used only for expert tensors) and no
            # AITER shared-expert fusion (0.25.0)
            fused_moe_make_expert_params_mapping=lambda *args, **kwargs: [],
            rocm_aiter_ops=types.SimpleNamespace(is_fusion_moe_shared_experts_enabled=lambda: False),
        )
        self.load_weights = {}
        for cls in ("Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLMBase", "Qwen3_5Model"):
            code = extract(self.source["models/qwen3_5.py"], f"{cls}.load_weights")
            ns = dict(load_ns)
            exec(compile("from __future__ import annotations\nfrom collections.abc import Iterable\n" + code,
                         "vllm/model_executor/models/qwen3_5.py", "exec"), ns)
            self.load_weights[cls] = ns["load_weights"]

    def _attr(self, rel, cls, name, ns, default=...):
        try:
            return class_attr(self.source[rel], cls, name, ns)
        except AssertionError:
            if default is ...:
                raise
            return default

    # -- the quantization config, as configure_quant_config leaves it ----------------------
    def quant_config(self):
        config = self.inc.INCConfig.from_config(quantization_config(self.keys))
        mapper = self.top_mapper
        rename = getattr(mapper, "get_rename_mapper", None)
        config.apply_vllm_mapper(rename() if rename else mapper)
        config.packed_modules_mapping = self.top_packed
        return config

    # -- the module tree ----------------------------------------------------------------------
    def build(self):
        """Qwen3_5ForConditionalGeneration's parameter tree (text part), prefix '' as the loader gives."""
        lin = self.linear
        qc = self.quant_config()
        previous = torch.get_default_dtype()
        torch.set_default_dtype(DTYPE)  # vLLM builds the model under the model dtype
        try:
            top = self._module("Qwen3_5ForConditionalGeneration", mapper=self.top_mapper)
            top.language_model = causal = self._module("Qwen3_5ForCausalLMBase", mapper=self.causal_mapper)
            causal.model = model = self._module("Qwen3_5Model", mapper=self.model_mapper)
            model.config = types.SimpleNamespace(model_type="qwen3_5_text", num_experts=0)
            model.quant_config = qc
            model.enable_lora = False
            model.is_fused_shared_expert_enabled = False
            model.get_expert_mapping = lambda: []
            model.embed_tokens = self.vocab.VocabParallelEmbedding(VOCAB, HIDDEN)
            layers = []
            key_dim, value_dim = GDN_K_HEADS * GDN_K_DIM, GDN_V_HEADS * GDN_V_DIM
            for i, kind in enumerate(LAYER_TYPES):
                prefix = f"language_model.model.layers.{i}"
                layer = _Holder()
                if kind == "linear_attention":
                    gdn = _Holder()
                    gdn.gqa_interleaved_layout = False
                    gdn.maybe_disable_tp = lambda quant_config: True  # CUDA with INC (TP 1: the same)
                    gdn.conv1d = lin.ColumnParallelLinear(CONV_KERNEL, 2 * key_dim + value_dim, bias=False,
                                                          prefix=f"{prefix}.linear_attn.conv1d")
                    gdn.conv1d.weight.data = gdn.conv1d.weight.data.unsqueeze(1)
                    gdn.in_proj_qkvz = self.create_proj["create_qkvz_proj"](
                        gdn, hidden_size=HIDDEN, key_dim=key_dim, value_dim=value_dim,
                        quant_config=qc, prefix=f"{prefix}.linear_attn.in_proj_qkvz")
                    gdn.in_proj_ba = self.create_proj["create_ba_proj"](
                        gdn, hidden_size=HIDDEN, num_v_heads=GDN_V_HEADS,
                        quant_config=qc, prefix=f"{prefix}.linear_attn.in_proj_ba")
                    qk = (key_dim, 0, False)
                    gdn.conv1d.weight.weight_loader = self.mamba_v2_sharded_weight_loader(
                        [qk, qk, (value_dim, 0, False)], 1, 0)
                    gdn.dt_bias = nn.Parameter(torch.ones(GDN_V_HEADS), requires_grad=False)
                    gdn.A_log = nn.Parameter(torch.empty(GDN_V_HEADS, dtype=torch.float32), requires_grad=False)
                    gdn.A_log.weight_loader = self.sharded_weight_loader(0)
                    gdn.dt_bias.weight_loader = self.sharded_weight_loader(0)
                    gdn.norm = _Norm(GDN_V_DIM)
                    gdn.out_proj = lin.RowParallelLinear(value_dim, HIDDEN, bias=False, input_is_parallel=True,
                                                         quant_config=qc, prefix=f"{prefix}.linear_attn.out_proj")
                    layer.linear_attn = gdn
                else:
                    attn = _Holder()
                    attn.qkv_proj = lin.QKVParallelLinear(HIDDEN, HEAD_DIM, HEADS * 2, KV_HEADS, bias=False,
                                                          quant_config=qc, prefix=f"{prefix}.self_attn.qkv_proj")
                    attn.o_proj = lin.RowParallelLinear(HEADS * HEAD_DIM, HIDDEN, bias=False, quant_config=qc,
                                                        prefix=f"{prefix}.self_attn.o_proj")
                    attn.q_norm = _Norm(HEAD_DIM)
                    attn.k_norm = _Norm(HEAD_DIM)
                    layer.self_attn = attn
                mlp = _Holder()
                mlp.gate_up_proj = lin.MergedColumnParallelLinear(HIDDEN, [INTER, INTER], bias=False, quant_config=qc,
                                                                  prefix=f"{prefix}.mlp.gate_up_proj")
                mlp.down_proj = lin.RowParallelLinear(INTER, HIDDEN, bias=False, quant_config=qc,
                                                      prefix=f"{prefix}.mlp.down_proj")
                layer.mlp = mlp
                layer.input_layernorm = _Norm(HIDDEN)
                layer.post_attention_layernorm = _Norm(HIDDEN)
                layers.append(layer)
            model.layers = nn.ModuleList(layers)
            model.norm = _Norm(HIDDEN)
            causal.lm_head = self.vocab.ParallelLMHead(VOCAB, HIDDEN, quant_config=qc, prefix="language_model.lm_head")
        finally:
            torch.set_default_dtype(previous)
        for param in top.parameters():  # a region no weight reaches stays visible
            param.data.fill_(-1 if not param.is_floating_point() else float("nan"))
        return top

    def _module(self, cls, mapper):
        load_weights = self.load_weights[cls]
        attrs = {"load_weights": load_weights}
        if mapper is not None:
            attrs["hf_to_vllm_mapper"] = mapper
        return type(cls, (nn.Module,), attrs)()


@contextlib.contextmanager
def pin_code(trees, label, broken=False, keys="names"):
    root = (WheelSource(Version(RELEASES[label])).fetch() if label in RELEASES else trees(label)).root
    with VllmModules(root, real=REAL, standins=_standins(root)) as vm:
        yield Pin(root, vm, broken=broken, keys=keys)


# ── the comparison ─────────────────────────────────────────────────────────────────────────


def expected(ckpt) -> dict[str, list[tuple[str, int, int]]]:
    """vLLM parameter -> [(checkpoint tensor, start, size) along its output dimension], in order."""
    key_dim, value_dim = GDN_K_HEADS * GDN_K_DIM, GDN_V_HEADS * GDN_V_DIM
    fused = {
        "linear_attn.in_proj_qkvz": [("linear_attn.in_proj_qkv", 2 * key_dim + value_dim), ("linear_attn.in_proj_z", value_dim)],
        "linear_attn.in_proj_ba": [("linear_attn.in_proj_b", GDN_V_HEADS), ("linear_attn.in_proj_a", GDN_V_HEADS)],
        "self_attn.qkv_proj": [("self_attn.q_proj", 2 * HEADS * HEAD_DIM), ("self_attn.k_proj", KV_HEADS * HEAD_DIM),
                               ("self_attn.v_proj", KV_HEADS * HEAD_DIM)],
        "mlp.gate_up_proj": [("mlp.gate_proj", INTER), ("mlp.up_proj", INTER)],
    }
    out = {}
    for name in ckpt:
        if name.startswith("mtp."):
            continue
        vname = name.replace("model.language_model.", "language_model.model.").replace("lm_head.", "language_model.lm_head.")
        head, _, suffix = vname.rpartition(".")
        for target, parts in fused.items():
            for shard, (part, size) in enumerate(parts):
                if head.endswith("." + part):
                    start = sum(s for _, s in parts[:shard])
                    out.setdefault(head[: -len(part)] + target + "." + suffix, []).append((name, start, size))
                    break
            else:
                continue
            break
        else:
            out[vname] = [(name, 0, None)]
    return out


def compare(model: nn.Module, ckpt: dict[str, torch.Tensor]) -> list[str]:
    """Every parameter against the checkpoint tensors it is made of: a list of mismatches."""
    params = dict(model.named_parameters())
    wrong = []
    plan = expected(ckpt)
    # The GPTQ-Marlin method of 0.20.1-0.25.0 also makes a g_idx, which the checkpoint does not store
    # and Marlin drops without desc_act (kernels/linear/mixed_precision/marlin.py:135-143 on 0.20.1)
    unplanned = {name for name in set(params) - set(plan) if not name.endswith(".g_idx")}
    assert set(plan) <= set(params) and not unplanned, (sorted(set(plan) - set(params)), sorted(unplanned))
    for pname, parts in plan.items():
        param = params[pname].data
        suffix = pname.rpartition(".")[2]
        for ckpt_name, start, size in parts:
            want = ckpt[ckpt_name]
            if size is None:
                got = param
                if "embed_tokens" in pname or "lm_head" in pname:
                    got = param[: want.shape[0]]
                if pname.endswith("conv1d.weight"):
                    got = param
            elif suffix in ("qweight", "scales"):  # [in, out]: output is dim 1
                got = param[:, start:start + size]
            elif suffix == "qzeros":  # [groups, out / 8]
                got = param[:, start // PACK:(start + size) // PACK]
            else:  # [out, in]
                got = param[start:start + size]
            if got.dtype.is_floating_point:
                ok = got.shape == want.shape and torch.equal(got, want.to(got.dtype))
            else:
                ok = got.shape == want.shape and torch.equal(got, want)
            if not ok:
                wrong.append(f"{pname}[{start}:{'' if size is None else start + size}] != {ckpt_name}")
    return wrong


def dequantized_mismatches(model, ckpt) -> list[str]:
    """The fused INT4 projections, dequantized, against the checkpoint's shards dequantized and stacked."""
    params = dict(model.named_parameters())
    wrong = []
    plan = expected(ckpt)
    for pname in params:
        if not pname.endswith(".qweight"):
            continue
        head = pname[: -len(".qweight")]
        got = dequantize(params[pname].data, params[head + ".qzeros"].data, params[head + ".scales"].data)
        shards = [name.rpartition(".")[0] for name, _, _ in plan[pname]]
        want = torch.cat([dequantize(ckpt[s + ".qweight"], ckpt[s + ".qzeros"], ckpt[s + ".scales"]) for s in shards])
        if not torch.equal(got, want):
            wrong.append(head)
    return wrong


# The stubs the building and loading may call: the CUDA kernel choice of the INT4 method and
# the unquantized GEMM's dispatch (forward only). Any other would be a stand-in doing real work.
ALLOWED_STUBS = {
    "vllm.model_executor.kernels.linear.MPLinearLayerConfig",
    "vllm.model_executor.kernels.linear.choose_mp_linear_kernel",
    "vllm.model_executor.kernels.linear.choose_mp_linear_kernel.()",
    "vllm.model_executor.layers.utils.dispatch_unquantized_gemm",
}


def load(pin: Pin, ckpt):
    with VllmModules.recording() as calls:
        model = pin.build()
        loaded = model.load_weights(iter(ckpt.items()))
    assert set(calls) <= ALLOWED_STUBS, sorted(set(calls) - ALLOWED_STUBS)
    return model, loaded


# ── the tests ──────────────────────────────────────────────────────────────────────────────


@pytest.mark.parametrize(("label", "keys"), [(label, "names") for label in PINS + list(RELEASES)]
                         + [(label, "regex") for label in PINS])
@in_child
def test_the_27b_layout_loads_into_every_parameter(trees, label, keys):
    ckpt = checkpoint()
    with pin_code(trees, label, keys=keys) as pin:
        model, loaded = load(pin, ckpt)
        # the fused GDN projection of the BF16 shards is an unquantized one; the rest INT4
        gdn = model.language_model.model.layers[0].linear_attn
        assert type(gdn.in_proj_ba.quant_method).__name__ == "UnquantizedLinearMethod"
        assert set(dict(gdn.in_proj_ba.named_parameters())) == {"weight"}
        assert {"qweight", "qzeros", "scales"} <= set(dict(gdn.in_proj_qkvz.named_parameters()))
        assert compare(model, ckpt) == []
        assert dequantized_mismatches(model, ckpt) == []
        # the fused [b; a] rows are the checkpoint's in_proj_b then in_proj_a (split_ba takes b first)
        ba = gdn.in_proj_ba.weight.data
        layer = "model.language_model.layers.0.linear_attn"
        assert torch.equal(ba[:GDN_V_HEADS], ckpt[f"{layer}.in_proj_b.weight"].to(DTYPE))
        assert torch.equal(ba[GDN_V_HEADS:], ckpt[f"{layer}.in_proj_a.weight"].to(DTYPE))
        params = {name for name, _ in model.named_parameters() if not name.endswith(".g_idx")}
        assert params <= set(loaded), sorted(params - set(loaded))
        assert not any(name.startswith("mtp") for name in loaded)
        assert "language_model.model.layers.0.linear_attn.in_proj_ba.weight" in loaded


@in_child
def test_a_wrong_mapping_fails_the_comparison(trees):
    """The comparison sees a mis-load: 0.33.0 with in_proj_b and in_proj_a swapped in the mapper."""
    ckpt = checkpoint()
    with pin_code(trees, "v0.33.0", broken=True) as pin:
        model, _ = load(pin, ckpt)
        wrong = compare(model, ckpt)
    assert wrong and all("in_proj_ba" in w for w in wrong), wrong


@in_child
def test_a_shard_that_never_arrives_is_seen(trees):
    """Genesis's symptom, in_proj_ba left uninitialised: a load without in_proj_a leaves its rows
    of the fused weight unset (NaN here), and the comparison with the checkpoint names them."""
    ckpt = checkpoint()
    missing = "model.language_model.layers.0.linear_attn.in_proj_a.weight"
    with pin_code(trees, "v0.33.0") as pin:
        model, _ = load(pin, {k: v for k, v in ckpt.items() if k != missing})
        wrong = compare(model, ckpt)
        rows = model.language_model.model.layers[0].linear_attn.in_proj_ba.weight.data
    assert wrong == [f"language_model.model.layers.0.linear_attn.in_proj_ba.weight[{GDN_V_HEADS}:{2 * GDN_V_HEADS}]"
                     f" != {missing}"], wrong
    assert rows[GDN_V_HEADS:].isnan().all() and not rows[:GDN_V_HEADS].isnan().any()
