"""P4 on real 0.20.1 source: TurboQuant KV on hybrids, no boundary layers outside attention.

Behaviour test by extraction: the patched ``if resolved_cache_dtype.startswith("turboquant_"):``
block of ``EngineArgs.create_engine_config`` is taken from the patched ``engine/arg_utils.py`` and
executed against stand-ins for the model and cache configs; the ``TurboQuantConfig`` it imports
is a stand-in carrying vLLM's real ``get_boundary_skip_layers`` (extracted from the pristine
``turboquant/config.py``). Importing ``vllm.engine.arg_utils`` needs torch.
"""

import logging
import sys
import textwrap
import types

import libcst as cst
import pytest
from packaging.version import Version

from kiln.patch.anchor import resolve
from kiln.patch.engine import isolated_run
from kiln.patch.model import BuildTarget, Verdict
from tests.patchsets.support.patchlib import assert_applies_once, extract, patched_files

TARGET = "engine/arg_utils.py"
TQ_CONFIG = "vllm.model_executor.layers.quantization.turboquant.config"


def tq_block(source: str, catalogue) -> str:
    """The TurboQuant block of create_engine_config, dedented to module level."""
    module = cst.parse_module(source)
    node = resolve(module, catalogue.get("P4").edits[0].anchor).unique
    assert node is not None
    return textwrap.dedent(module.code_for_node(node))


@pytest.fixture(scope="module")
def tq_config(trees):
    method = extract(trees("v0.20.1").read("model_executor/layers/quantization/turboquant/config.py"), "TurboQuantConfig.get_boundary_skip_layers")
    namespace: dict = {}
    exec(compile(method, "turboquant/config.py", "exec"), namespace)
    return type("TurboQuantConfig", (), {"get_boundary_skip_layers": namespace["get_boundary_skip_layers"]})


@pytest.fixture
def run(tq_config, monkeypatch):
    monkeypatch.setitem(sys.modules, TQ_CONFIG, types.SimpleNamespace(TurboQuantConfig=tq_config))

    def run(code: str, model_config, skip_layers=()):
        cache_config = types.SimpleNamespace(kv_cache_dtype_skip_layers=list(skip_layers))
        namespace = {
            "resolved_cache_dtype": "turboquant_k8v4",
            "model_config": model_config,
            "cache_config": cache_config,
            "logger": logging.getLogger("kiln.test.p4"),
        }
        exec(compile(code, TARGET, "exec"), namespace)
        return cache_config.kv_cache_dtype_skip_layers

    return run


@pytest.fixture(scope="module")
def patched_block(catalogue, sessions):
    return tq_block(patched_files(catalogue, sessions("v0.20.1"), "P4")[TARGET], catalogue)


@pytest.fixture(scope="module")
def pristine_block(catalogue, trees):
    return tq_block(trees("v0.20.1").read(TARGET), catalogue)


QWEN36_LAYER_TYPES = ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(64)]
QWEN36_ATTENTION = [i for i, t in enumerate(QWEN36_LAYER_TYPES) if t == "full_attention"]


def hybrid(text=None, hf=None, num_layers=64):
    text_config = types.SimpleNamespace(num_hidden_layers=num_layers, **(text or {}))
    return types.SimpleNamespace(is_hybrid=True, hf_text_config=text_config, hf_config=types.SimpleNamespace(**(hf or {})))


def test_pristine_rejects_a_hybrid(run, pristine_block):
    with pytest.raises(NotImplementedError, match="hybrid"):
        run(pristine_block, hybrid({"layer_types": QWEN36_LAYER_TYPES}))


def test_qwen36_hybrid_keeps_turboquant_on_every_attention_layer(run, patched_block, pristine_block):
    skipped = run(patched_block, hybrid({"layer_types": QWEN36_LAYER_TYPES}))
    # the dense formula would pick 0, 1, 62 (GDN layers, no KV cache) and 63
    assert skipped == []
    # user-listed layers are still honoured, and nothing outside them is added
    skipped = run(patched_block, hybrid({"layer_types": QWEN36_LAYER_TYPES}), skip_layers=["7"])
    assert skipped == ["7"]
    assert set(skipped) - {"7"} <= {str(i) for i in QWEN36_ATTENTION}


@pytest.mark.parametrize(
    ("text", "hf"),
    [
        ({"layers_block_type": ["mamba", "attention"] * 4}, None),  # Jamba / Zamba2
        (None, {"attn_type_list": [0, 0, 0, 1] * 2}),  # MiniMax
    ],
)
def test_other_hybrid_conventions(run, patched_block, text, hf):
    assert run(patched_block, hybrid(text, hf, num_layers=8)) == []


def test_hybrid_without_identifiable_attention_layers_still_raises(run, patched_block):
    with pytest.raises(NotImplementedError, match="full-attention layers"):
        run(patched_block, hybrid({"layer_types": ["linear_attention"] * 8}, num_layers=8))
    with pytest.raises(NotImplementedError, match="full-attention layers"):
        run(patched_block, hybrid(num_layers=8))


def test_dense_models_keep_boundary_protection(run, patched_block, pristine_block):
    dense = types.SimpleNamespace(is_hybrid=False, hf_text_config=types.SimpleNamespace(num_hidden_layers=36))
    assert run(patched_block, dense, ["5"]) == run(pristine_block, dense, ["5"]) == ["0", "1", "5", "34", "35"]


@pytest.mark.parametrize(("label", "expected"), [("v0.20.1", Verdict.APPLIES), ("v0.33.0", Verdict.UPSTREAM)])
def test_verdicts(catalogue, sessions, label, expected):
    session = sessions(label)
    outcome = isolated_run(catalogue, session, BuildTarget(session.tree.vllm_version), "P4").outcomes["P4"]
    assert outcome.verdict is expected, outcome.detail
    if expected is Verdict.UPSTREAM:
        assert "get_boundary_skip_layers(model_config)" in outcome.detail


def test_gated_to_turboquant(catalogue, sessions):
    session = sessions("v0.20.1")
    target = BuildTarget(Version("0.20.1"), kv_cache_dtype="fp8_e4m3")
    assert isolated_run(catalogue, session, target, "P4").outcomes["P4"].verdict is Verdict.GATED


def test_applying_twice_changes_nothing(catalogue, sessions):
    session = sessions("v0.20.1")
    assert_applies_once(catalogue, session, "P4", version="0.20.1")
