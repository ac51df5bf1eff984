"""vLLM's real ``WorkspaceManager`` and TurboQuant's metadata builder, executed on CPU.

``load_workspace`` runs a tree's ``v1/worker/workspace.py`` as a module with stand-ins for the
four vLLM modules it imports (``vllm.envs``: debug logging off; ``vllm.logger``;
``vllm.utils.math_utils.round_up``; ``vllm.v1.worker.ubatching.dbo_current_ubatch_id``: ubatch
0). ``torch.accelerator.empty_cache`` (called when the workspace grows) needs a device, so the
caller patches it to a no-op. ``builder`` puts ``TurboQuantMetadataBuilder.__init__`` and the
named methods, taken from a backend file, into a class body over a stand-in base that stores
what vLLM's ``AttentionMetadataBuilder.__init__`` stores, so ``super().__init__`` works as in
vLLM.
"""

from __future__ import annotations

import math
import sys
import textwrap
import types

import torch

from tests.patchsets.support.patchlib import extract

WORKSPACE = "v1/worker/workspace.py"


def load_workspace(text: str, monkeypatch) -> types.ModuleType:
    """The tree's ``workspace`` module; ``monkeypatch`` undoes the stand-ins after the test."""
    stand_ins = {
        "vllm": {},
        "vllm.envs": {"VLLM_DEBUG_WORKSPACE": False},
        "vllm.logger": {"init_logger": lambda name: types.SimpleNamespace(info=print, warning=print)},
        "vllm.utils": {},
        "vllm.utils.math_utils": {"round_up": lambda x, y: -(-x // y) * y},
        "vllm.v1": {},
        "vllm.v1.worker": {},
        "vllm.v1.worker.ubatching": {"dbo_current_ubatch_id": lambda: 0},
    }
    for name, attrs in stand_ins.items():
        module = types.ModuleType(name)
        module.__path__ = []
        module.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(torch.accelerator, "empty_cache", lambda: None)
    workspace = types.ModuleType("vllm.v1.worker.workspace")
    monkeypatch.setitem(sys.modules, workspace.__name__, workspace)
    exec(compile(text, WORKSPACE, "exec"), workspace.__dict__)
    return workspace


class _BuilderBase:
    """What ``AttentionMetadataBuilder.__init__`` keeps, plus the reorder-threshold setter."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        self.kv_cache_spec = kv_cache_spec
        self.layer_names = layer_names
        self.vllm_config = vllm_config
        self.device = device

    def _init_reorder_batch_threshold(self, threshold, supports_spec_as_decode=False):
        self.reorder_batch_threshold = threshold


def builder(backend_text: str, workspace: types.ModuleType, methods: tuple[str, ...] = ()):
    """``TurboQuantMetadataBuilder`` with ``__init__`` and ``methods`` from ``backend_text``."""
    body = "\n".join(
        textwrap.indent(extract(backend_text, f"TurboQuantMetadataBuilder.{name}"), "    ")
        for name in ("__init__", *methods)
    )
    namespace = {
        "Base": _BuilderBase,
        "torch": torch,
        "math": math,
        "_CONTINUATION_DECODE_THRESHOLD": 128,
        "current_workspace_manager": workspace.current_workspace_manager,
        "is_workspace_manager_initialized": workspace.is_workspace_manager_initialized,
    }
    exec(compile(f"class TurboQuantMetadataBuilder(Base):\n{body}\n", "turboquant_attn.py", "exec"), namespace)
    return namespace["TurboQuantMetadataBuilder"]


def vllm_config(*, max_num_seqs=4, max_num_batched_tokens=2048, max_model_len=1000, num_heads=4, splits=8):
    return types.SimpleNamespace(
        model_config=types.SimpleNamespace(
            max_model_len=max_model_len,
            dtype=torch.bfloat16,
            get_num_attention_heads=lambda parallel_config: num_heads,
        ),
        scheduler_config=types.SimpleNamespace(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, enable_chunked_prefill=True
        ),
        parallel_config=types.SimpleNamespace(),
        attention_config=types.SimpleNamespace(tq_max_kv_splits_for_cuda_graph=splits),
        cache_config=types.SimpleNamespace(block_size=16),
    )


def kv_cache_spec(*, num_kv_heads=2, head_size=16, block_size=16):
    return types.SimpleNamespace(num_kv_heads=num_kv_heads, head_size=head_size, block_size=block_size)
