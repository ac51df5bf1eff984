"""P65 on real 0.20.1 source: the builder reports single-token decode only under spec decode.

Behaviour test by extraction: the patched ``TurboQuantMetadataBuilder.get_cudagraph_support``
is taken from the patched file and run against stand-ins for the vLLM config objects (the
real module imports CUDA-only kernels).
"""

import enum
import types

import pytest

from tests.patchsets.support.patchlib import extract, patched_files

TARGET = "v1/attention/backends/turboquant_attn.py"


class AttentionCGSupport(enum.Enum):  # stand-in with vLLM's member names
    NEVER = 0
    UNIFORM_SINGLE_TOKEN_DECODE = 1
    UNIFORM_BATCH = 2
    ALWAYS = 3


@pytest.fixture(scope="module")
def builder_cls(catalogue, sessions):
    text = patched_files(catalogue, sessions("v0.20.1"), "P65")[TARGET]
    method = extract(text, "TurboQuantMetadataBuilder.get_cudagraph_support")
    namespace = {"AttentionCGSupport": AttentionCGSupport}
    exec(compile(method, "patched", "exec"), namespace)
    return type(
        "Builder",
        (),
        {
            "_cudagraph_support": AttentionCGSupport.UNIFORM_BATCH,
            "get_cudagraph_support": namespace["get_cudagraph_support"],
        },
    )


def test_spec_decode_downgrades_to_single_token_decode(builder_cls):
    config = types.SimpleNamespace(speculative_config=types.SimpleNamespace(num_speculative_tokens=3))
    assert builder_cls.get_cudagraph_support(config, None) is AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE


def test_without_spec_decode_keeps_uniform_batch(builder_cls):
    config = types.SimpleNamespace(speculative_config=None)
    assert builder_cls.get_cudagraph_support(config, None) is AttentionCGSupport.UNIFORM_BATCH


@pytest.mark.parametrize("label", ["v0.20.1", "v0.33.0"])
def test_patched_file_keeps_the_classvar_and_adds_the_override(catalogue, sessions, label):
    text = patched_files(catalogue, sessions(label), "P65")[TARGET]
    cls_src = extract(text, "TurboQuantMetadataBuilder")
    assert "_cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH" in cls_src
    assert "# kiln P65:" in cls_src
