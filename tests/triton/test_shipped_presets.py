"""The shipped image definitions' kernel presets compile, on CPU, for every SM and pin they name.

``test_triton_aot.py`` covers the machinery on a small preset; here the real presets of
``images/*.toml`` (head dim 256, their heads and block sizes) go through the same path: each
pin's pristine TurboQuant launchers (the release wheel, ``tests/conftest.py``), Triton 3.6's JIT
with the stand-in driver, one worker per SM, then the fresh-process check that compiles
nothing. A preset whose shapes a launcher cannot compile would fail here, not at a build.
"""

from __future__ import annotations

import json

import pytest

from kiln import paths
from kiln.definitions import load_definitions
from kiln.pins import load_pins
from kiln.triton.aot import KernelSources, compile_kernel_caches
from kiln.triton.kernels import check_kernels, launch_plan
from kiln.triton.toolchain import toolchain_for


def _shipped(catalogue):
    pins = load_pins(paths.PINS)
    return [(image, pin) for image in load_definitions(paths.IMAGES, catalogue, pins) if image.model.kernels
            for pin in image.pins_of(pins) if not pin.cpu]


def test_every_shipped_image_declares_kernels(catalogue):
    pins = load_pins(paths.PINS)
    for image in load_definitions(paths.IMAGES, catalogue, pins):
        if any(pin.cpu for pin in image.pins_of(pins)):
            assert image.model.kernels is None, image.name  # a CPU image compiles no kernels
            continue
        kernels = image.model.kernels
        assert kernels is not None, image.name
        assert kernels.head_dim == 256 and kernels.dtype == image.model.dtype == "float16"
        assert kernels.spec_tokens == image.model.num_speculative_tokens
        assert len(kernels.block_sizes) == len(image.pins_of(pins))  # one inferred size per pin
        assert str(kernels.max_model_len) in image.serve_args and str(kernels.max_num_seqs) in image.serve_args


@pytest.fixture(scope="module")
def toolchain(tmp_path_factory):
    return toolchain_for("3.6.0", "shipped-presets", tmp_path_factory.mktemp("toolchain"))


@pytest.mark.parametrize("case", range(4), ids=lambda i: f"image-pin-{i}")
def test_shipped_preset_compiles_for_every_sm(catalogue, trees, toolchain, tmp_path, case):
    shipped = _shipped(catalogue)
    assert len(shipped) == 4  # two images x two pins: a new one needs a case here
    image, pin = shipped[case]
    preset = image.model.kernels
    sources = KernelSources({}, trees(pin.name).root)
    check_kernels(preset, sources.read, f"{image.path}: model.kernels")
    results = compile_kernel_caches(preset, list(image.sms), sources, toolchain, tmp_path, jobs=2)
    assert sorted(results) == sorted(image.sms)
    # store, decode, continuation decode (and from 0.21.0 its unaligned seq_lens variant)
    sliced = sources.runtime_layout().continuation_seq_lens_sliced
    assert len(launch_plan(preset, sources.runtime_layout())) == (4 if sliced else 3) * len(preset.block_sizes)
    for sm, result in results.items():
        assert result.failures == [], (image.name, pin.name, sm, result.failures)
        names = {json.loads(p.read_text())["name"] for p in result.root.glob("*/*.json")
                 if not p.name.startswith("__grp__")}
        assert {"_tq_fused_store_fp8", "_tq_decode_stage1", "_fwd_kernel_stage2"} <= names, (image.name, sm, names)
        assert {json.loads(p.read_text())["target"]["arch"] for p in result.root.glob("*/*.json")
                if not p.name.startswith("__grp__")} == {sm}
