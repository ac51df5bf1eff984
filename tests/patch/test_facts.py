"""The catalogue's facts (``kiln.patch.facts``) answer as the catalogue does, for every shipped image."""

from __future__ import annotations

import json

import pytest

from kiln import paths
from kiln.definitions import load_definitions
from kiln.errors import KilnError
from kiln.image.cachekeys import _selection, catalogue_key, kernels_key
from kiln.image.inputs import load_build_inputs
from kiln.patch.catalog import load_catalogue
from kiln.patch.facts import FIELDS, catalogue_facts, facts_catalogue, source_files
from kiln.paths import RepoFiles
from kiln.pins import load_pins

FILES = RepoFiles(pins=paths.PINS, patchsets=paths.PATCHSETS, record=paths.RECORD, images=paths.IMAGES)


@pytest.fixture(scope="module")
def real():
    return load_catalogue(paths.PATCHSETS)


@pytest.fixture(scope="module")
def facts(real):
    # as a cache entry carries them: JSON, read back
    return facts_catalogue(paths.PATCHSETS, json.loads(json.dumps(catalogue_facts(real))), "entry")


def test_the_facts_of_the_facts_are_the_facts(real, facts):
    assert catalogue_facts(facts) == catalogue_facts(real)
    assert list(facts.patches) == list(real.patches) and facts.digests == real.digests
    for pid, patch in real.patches.items():
        kept = facts.get(pid)
        assert kept.source_file == patch.source_file and kept.gates == patch.gates
        assert (kept.targets, kept.requires, kept.variant) == (patch.targets, patch.requires, patch.variant)
    assert facts.default_selection() == real.default_selection()
    assert all(facts.digest_with_requires(pid) == real.digest_with_requires(pid) for pid in real.patches)


def test_every_shipped_build_loads_and_keys_alike_from_the_facts(real, facts):
    pins = load_pins(paths.PINS)
    builds = 0
    for definition in load_definitions(paths.IMAGES, real, pins):
        for pin in definition.pins_of(pins):
            for sm in definition.sms:
                loaded = load_build_inputs(FILES, definition.name, pin.name, sm)
                cached = load_build_inputs(FILES, definition.name, pin.name, sm, (facts, "entry"))
                assert cached.definition == loaded.definition and cached.catalogue_hit == "entry"
                assert _selection(cached) == _selection(loaded), (definition.name, pin.name, sm)
                layers = [{"digest": "sha256:" + "1" * 64, "read_as": "gzip"}]
                if definition.model.kernels:
                    assert kernels_key(cached, layers, {}) == kernels_key(loaded, layers, {})
                assert cached.with_loaded_catalogue().catalogue.patches.keys() == real.patches.keys()
                builds += 1
    assert builds >= 3  # the shipped images on their pins and SMs


def test_facts_that_are_not_what_the_catalogue_writes_are_refused_naming_the_entry(real):
    good = catalogue_facts(real)
    pid = next(iter(good["patches"]))

    def refused(change) -> str:
        bad = json.loads(json.dumps(good))
        change(bad)
        with pytest.raises(KilnError) as raised:
            facts_catalogue(paths.PATCHSETS, bad, "build cache entry R:T")
        message = str(raised.value)
        assert message.startswith("build cache entry R:T: ") and "\n" not in message
        return message

    assert "do not name the same patches" in refused(lambda f: f["digests"].pop(pid))
    assert f"patch {pid!r}: not the fields" in refused(lambda f: f["patches"][pid].pop("title"))
    assert f"patch {pid!r}: a field of the wrong type" in refused(lambda f: f["patches"][pid].update(variant="no"))
    assert f"patch {pid!r}: gates are not" in refused(lambda f: f["patches"][pid]["gates"].pop("sm_min"))
    assert "is not under the catalogue" in refused(lambda f: f["patches"][pid].update(module="../../etc/x.py"))
    assert "requires a patch it does not list" in refused(lambda f: f["patches"][pid].update(requires=["P0"]))
    cyclic = next(p for p, data in good["patches"].items() if data["requires"])

    def cycle(f):
        dep = f["patches"][cyclic]["requires"][0]
        f["patches"][dep]["requires"] = [cyclic]

    assert "requires cycle" in refused(cycle)
    assert set(good["patches"][pid]) == set(FIELDS)


def test_the_key_is_every_byte_under_patchsets_and_no_bytecode(tmp_path):
    root = tmp_path / "patchsets"
    (root / "family" / "__pycache__").mkdir(parents=True)
    (root / "family" / "p1_x.py").write_text("x = 1\n")
    (root / "family" / "content.py").write_text("y = 2\n")
    (root / "family" / "__pycache__" / "p1_x.cpython-311.pyc").write_bytes(b"\0")
    assert sorted(source_files(root)) == ["family/content.py", "family/p1_x.py"]
    key, inputs = catalogue_key(root)
    (root / "family" / "__pycache__" / "other.pyc").write_bytes(b"\1")
    assert catalogue_key(root)[0] == key  # bytecode is no input
    (root / "family" / "content.py").write_text("y = 3\n")  # a NewFile's content file is one
    assert catalogue_key(root)[0] != key
    assert inputs["kind"] == "catalogue" and set(inputs["patchsets"]) == {"family/content.py", "family/p1_x.py"}
    with pytest.raises(KilnError, match="patchsets directory not found"):
        source_files(tmp_path / "none")
