"""``kiln.verify.patched_source``: the patched vLLM source of (image, pin, SM), the one call the ci
scripts (gpu_bundle, gpu_check, bench_triton) make, is what a build patches."""

from __future__ import annotations

import pytest

from kiln import paths
from kiln.definitions import load_definition
from kiln.errors import KilnError
from kiln.image.prepare import patched_selection
from kiln.paths import RepoFiles
from kiln.pins import load_pins
from kiln.verify import patched_source

IMAGE = "qwen3.6-27b-tq"


class Given:
    """A source provider over a tree already fetched (or none: fetching fails the test)."""

    def __init__(self, tree=None):
        self.tree = tree

    def describe(self) -> str:
        return "the test's tree"

    def fetch(self):
        assert self.tree is not None, "fetched a source before checking the inputs"
        return self.tree


@pytest.mark.network
def test_the_default_pin_s_patched_source_is_what_a_build_patches(catalogue, trees, tmp_path):
    pins = load_pins(paths.PINS)
    definition = load_definition(paths.IMAGES, IMAGE, catalogue, pins)
    pin = definition.pins_of(pins)[0]  # the default: the image's first pin
    tree = trees(pin.name)
    got = patched_source(RepoFiles(), IMAGE, 120, provider=Given(tree))
    assert got.inputs.pin == pin and got.inputs.sm == 120 and got.tree is tree
    # what prepare_build runs on the base's tree (its memo in the build's cache)
    built = patched_selection(catalogue, tree, definition.target(pin, 120), list(definition.patches),
                              tmp_path / "cache")
    assert got.changed == built.changed_text() and got.changed
    assert {pid: o.verdict for pid, o in got.outcomes.items()} == {pid: o.verdict for pid, o in built.outcomes.items()}
    assert got.applied == sorted(pid for pid, o in built.outcomes.items() if o.verdict.name == "APPLIES")
    assert got.applied


def test_a_pin_the_image_is_not_built_for_fails_before_any_fetch():
    pins = load_pins(paths.PINS)
    cpu = next(p.name for p in pins.values() if p.cpu)
    with pytest.raises(KilnError, match=f"pin {cpu} is not one this image is built for"):
        patched_source(RepoFiles(), IMAGE, 120, pin=cpu, provider=Given())
    with pytest.raises(KilnError, match="sm 75 is not one of the image's sms"):
        patched_source(RepoFiles(), IMAGE, 75, provider=Given())
