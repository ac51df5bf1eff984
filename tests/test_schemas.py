"""The schemas of image definitions, pins and the registries config: valid, published, shipped,
and the one place the loaders' keys are declared. Refusals: tests/commands/test_malformed_inputs.py."""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import subprocess
import sys
import tomllib

import jsonschema
import pytest

from kiln import paths, schema
from kiln.definitions import ModelPreset, load_definitions
from kiln.oci.endpoints import RegistryConfig
from kiln.pins import load_pins
from kiln.triton.kernels import KernelPreset

PUBLISHED = paths.REPO / "docs" / "schemas"


@pytest.mark.parametrize("name", schema.SCHEMAS)
def test_each_schema_is_a_valid_json_schema(name):
    jsonschema.Draft202012Validator.check_schema(schema.schema(name))


@pytest.mark.parametrize("name", schema.SCHEMAS)
def test_the_published_copy_in_docs_is_the_one_kiln_checks_with(name):
    published = PUBLISHED / f"{name}.schema.json"
    assert published.read_bytes() == schema.schema_path(name).read_bytes(), (
        f"docs/schemas/{name}.schema.json is stale: cp kiln/schemas/*.json docs/schemas/")


def test_docs_publish_no_schema_kiln_does_not_have():
    assert sorted(p.name for p in PUBLISHED.iterdir()) == sorted(f"{n}.schema.json" for n in schema.SCHEMAS)


def test_the_schemas_ship_in_the_package():
    data = tomllib.loads((paths.REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["kiln"]
    for name in schema.SCHEMAS:
        rel = f"schemas/{name}.schema.json"
        assert any(fnmatch.fnmatch(rel, pattern) for pattern in data), (rel, data)


def test_every_shipped_image_definition_and_the_pins_validate(catalogue):
    pins = load_pins(paths.PINS)
    schema.check(tomllib.loads(paths.PINS.read_text()), "pins", paths.PINS)
    images = sorted(paths.IMAGES.glob("*.toml"))
    assert images
    for path in images:
        schema.check(tomllib.loads(path.read_text()), "image", path)
    assert [d.name for d in load_definitions(paths.IMAGES, catalogue, pins)] == [p.stem for p in images]


def test_the_model_tables_declare_what_the_loaders_read():
    """A key the schema allows but no dataclass holds would be accepted and ignored again."""
    model = schema.schema("image")["properties"]["model"]["properties"]
    assert set(model) == {f.name for f in dataclasses.fields(ModelPreset)}
    assert set(model["kernels"]["properties"]) == {f.name for f in dataclasses.fields(KernelPreset)}


def test_a_valid_registries_config_loads(tmp_path):
    path = tmp_path / "registries.toml"
    path.write_text('insecure = ["https://selfsigned.local:443"]\n[mirrors]\n"docker.io" = "http://127.0.0.1:5000"\n')
    config = RegistryConfig.load(path=path)
    assert config.endpoint("docker.io").host == "127.0.0.1:5000"
    assert config.endpoint("docker.io").scheme == "http"
    assert config.endpoint("selfsigned.local:443").scheme == "https"


_PROBE = """
import importlib.util, json, sys
from kiln import schema
from kiln.errors import KilnError
if sys.argv[1] == "cli":
    schema.skip_format_grammars()
try:
    schema.check({"pins": {"x": {"rol": "current"}}}, "pins", "pins.toml")
except KilnError as err:
    refused = str(err)
import jsonschema
print(json.dumps({"refused": refused, "grammars": "lark" in sys.modules, "arrow": "arrow" in sys.modules,
                  "iri": "iri" in jsonschema.FormatChecker.checkers,
                  "duration": "duration" in jsonschema.FormatChecker.checkers,
                  "importable": all(importlib.util.find_spec(name) is not None
                                    for name in ("rfc3987_syntax", "isoduration")),
                  "left_hidden": [name for name in schema._FORMAT_PACKAGES if sys.modules.get(name, 0) is None]}))
"""


@pytest.mark.parametrize("caller", ["cli", "library"])
def test_the_command_line_imports_jsonschema_without_the_format_grammars(caller):
    """rfc3987-syntax (here through the test extras) costs every kiln process 1.5 s of grammar
    compiling at jsonschema's import; the command line goes without it, a library caller keeps it."""
    out = subprocess.run([sys.executable, "-c", _PROBE, caller], capture_output=True, text=True,
                         cwd=paths.REPO, check=True, timeout=120)
    seen = json.loads(out.stdout)
    assert seen["importable"], "rfc3987-syntax or isoduration is not installed: this test proves nothing"
    assert "rol" in seen["refused"] and "pins.toml" in seen["refused"]  # the schema still checks
    assert seen["grammars"] is seen["arrow"] is (caller == "library")
    assert seen["iri"] is seen["duration"] is (caller == "library")
    assert seen["left_hidden"] == []  # a later import of any of them works
