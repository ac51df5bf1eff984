"""A build's kernel compile begun beside the patching (``kiln.image.prepare._KernelCompile``): its
result is used only when the text it was handed is the patching's final text of the files the
kernels read; otherwise it runs again on the final text."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from kiln import paths
from kiln.definitions import load_definition
from kiln.image.prepare import _KernelCompile
from kiln.pins import load_pins
from kiln.triton.kernels import KERNELS


@pytest.fixture(scope="module")
def preset(catalogue):
    return load_definition(paths.IMAGES, "qwen3.6-27b-tq", catalogue, load_pins(paths.PINS)).model.kernels


def _compile(preset, pool, calls, wanted=True):
    def compile_layer(changed):
        calls.append(changed)
        return f"layer {len(calls)}"
    return _KernelCompile(preset, compile_layer, pool, wanted)


def test_the_early_compile_is_used_when_it_read_the_final_text(preset):
    kernel_file = KERNELS[preset.launchers[0]].file
    calls: list[dict] = []
    with ThreadPoolExecutor(max_workers=1) as pool:
        compile = _compile(preset, pool, calls)
        assert compile.reads(kernel_file) and not compile.reads("entrypoints/chat_utils.py")
        compile.start({kernel_file: "patched"})
        # other files the patching changed do not matter to the kernels
        assert compile.result({kernel_file: "patched", "entrypoints/chat_utils.py": "x"}) == ("layer 1", True)
    assert calls == [{kernel_file: "patched"}]


def test_an_early_compile_on_text_the_patching_then_changed_runs_again_on_the_final_text(preset):
    kernel_file = KERNELS[preset.launchers[0]].file
    calls: list[dict] = []
    final = {kernel_file: "patched again", "entrypoints/chat_utils.py": "x"}
    with ThreadPoolExecutor(max_workers=1) as pool:
        compile = _compile(preset, pool, calls)
        compile.start({kernel_file: "patched"})
        assert compile.result(final) == ("layer 2", False)
    assert calls == [{kernel_file: "patched"}, final]


def test_a_build_that_does_not_compile_starts_nothing(preset):
    calls: list[dict] = []
    with ThreadPoolExecutor(max_workers=1) as pool:
        compile = _compile(preset, pool, calls, wanted=False)  # e.g. the kernels' cache entry hit
        compile.start({})
        assert compile.early is None and calls == []
