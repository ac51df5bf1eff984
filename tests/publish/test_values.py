"""Helm values from the real image definition, checked against ``kiln/schemas/helm/values.schema.json``.

The end-to-end path (build --push --values, then ``build.py values``) is in
``tests/oci/test_helm_values.py``; here: the values' content, the schema's teeth, staging.
"""

from __future__ import annotations

import copy
import json

import jsonschema
import pytest

from kiln import paths
from kiln.definitions import load_definition, load_definitions
from kiln.errors import KilnError
from kiln.oci.reference import parse_reference
from kiln.pins import load_pins
from kiln.publish.values import (
    CHARTS,
    VALUES_SCHEMA,
    ValuesPublisher,
    check_chart,
    helm_values,
    values_bytes,
)
from kiln.staging import stage_bytes

DIGEST = "sha256:" + "ab" * 32
REPOSITORY = "ghcr.io/you/vllm-qwen3.6-27b-tq"  # the shipped definition sets none: --repository


@pytest.fixture(scope="module")
def validator():
    schema = json.loads(VALUES_SCHEMA.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


@pytest.fixture(scope="module")
def qwen(catalogue):
    pins = load_pins(paths.PINS)
    image = load_definition(paths.IMAGES, "qwen3.6-27b-tq", catalogue, pins)
    return image, image.pins_of(pins)[0]


def _shipped(catalogue) -> list[tuple]:
    """Every image definition of ``images/`` with every pin it is built for."""
    pins = load_pins(paths.PINS)
    return [(image, pin) for image in load_definitions(paths.IMAGES, catalogue, pins) for pin in image.pins_of(pins)
            if not pin.cpu]  # the CPU pin's image serves under ci/serve_check (tests/test_serve_check.py)


def test_the_shipped_images_are_checked(catalogue):
    assert {(image.name, pin.name) for image, pin in _shipped(catalogue)} == {
        (name, pin) for name in ("qwen3.6-27b-tq", "qwen3.6-35b-a3b-fp8") for pin in ("v0.33.0", "v0.20.1")}


@pytest.mark.parametrize("case", range(4), ids=lambda i: f"image-pin-{i}")
def test_every_sm_of_every_shipped_image_gives_valid_values(catalogue, validator, case):
    image, pin = _shipped(catalogue)[case]
    assert image.repository == ""  # no placeholder that looks real: the user names theirs
    repository = f"ghcr.io/you/vllm-{image.name}"  # what --repository would say
    for sm in image.sms:
        values = helm_values(image, pin, sm, repository, image.tag(pin.cuda, sm, pin), DIGEST)
        validator.validate(values)
        assert values["image"] == {"repository": repository, "tag": image.tag(pin.cuda, sm, pin),
                                   "digest": DIGEST, "pullPolicy": "IfNotPresent"}
        assert values["model"] == {"id": image.model.id}
        assert values["serve"]["args"] == list(image.serve_args)
        assert {e["name"]: e["value"] for e in values["serve"]["env"]} == image.serve_env
        assert values["resources"]["limits"] == values["resources"]["requests"] == {"nvidia.com/gpu": 1}
        selector = values["nodeSelector"]
        assert int(selector["nvidia.com/gpu.compute.major"] + selector["nvidia.com/gpu.compute.minor"]) == sm
        assert values["kiln"] == {"image": image.name, "pin": pin.name, "vllm": str(pin.vllm), "sm": sm}


@pytest.mark.parametrize(("sm", "major", "minor"), [(86, "8", "6"), (90, "9", "0"), (120, "12", "0"), (121, "12", "1")])
def test_node_selector_is_the_compute_capability(qwen, sm, major, minor):
    image, pin = qwen
    values = helm_values(image, pin, sm, REPOSITORY, "t", DIGEST)
    assert values["nodeSelector"] == {"nvidia.com/gpu.compute.major": major, "nvidia.com/gpu.compute.minor": minor}


_DELETE = object()


@pytest.mark.parametrize(("path", "value"), [
    (("image", "digest"), _DELETE),  # a chart must be able to pull by digest
    (("image", "digest"), "sha256:1234"),
    (("image", "digest"), "cu130-sm120-v0.20.1"),
    (("image", "repository"), "docker.io/kiln/vllm:tag"),
    (("image", "tag"), "-bad"),
    (("image", "pullPolicy"), "Sometimes"),
    (("serve", "env", 0, "value"), 1),  # Kubernetes env values are strings
    (("serve", "env", 0, "name"), "1BAD"),
    (("serve", "args", 0), ["nested"]),
    (("resources", "limits", "nvidia.com/gpu"), 0),
    (("nodeSelector", "nvidia.com/gpu.compute.minor"), 6),
    (("model", "id"), ""),
    (("kiln", "sm"), "120"),
    (("extra",), {}),
    (("resources",), _DELETE),
])
def test_schema_rejects(qwen, validator, path, value):
    image, pin = qwen
    values = helm_values(image, pin, 120, REPOSITORY, image.tag(pin.cuda, 120, pin), DIGEST)
    broken = copy.deepcopy(values)
    node = broken
    for key in path[:-1]:
        node = node[key]
    if value is _DELETE:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    validator.validate(values)
    with pytest.raises(jsonschema.ValidationError):
        validator.validate(broken)


def test_values_file_is_staged_then_committed(qwen, tmp_path):
    image, pin = qwen
    values = helm_values(image, pin, 120, REPOSITORY, image.tag(pin.cuda, 120, pin), DIGEST)
    dest = tmp_path / "deep" / "values.json"
    staged = stage_bytes(dest, values_bytes(values))
    assert not dest.exists()  # nothing visible before the build commits its outputs
    assert staged.commit() == dest
    assert dest.read_bytes() == values_bytes(values)
    assert json.loads(dest.read_text()) == values
    assert [p.name for p in dest.parent.iterdir()] == ["values.json"]

    staged = stage_bytes(dest, values_bytes({"other": 1}))
    staged.discard()
    assert json.loads(dest.read_text()) == values  # a discarded build leaves the old file
    assert [p.name for p in dest.parent.iterdir()] == ["values.json"]

    with pytest.raises(KilnError, match="is a directory"):
        ValuesPublisher(tmp_path, parse_reference("ghcr.io/x/y")).check()


@pytest.mark.parametrize("case", range(4), ids=lambda i: f"image-pin-{i}")
def test_shipped_values_serve_with_the_baked_chat_template(catalogue, case):
    """The Qwen presets' values start vLLM on the chat template the image bakes (no volume needed)."""
    image, pin = _shipped(catalogue)[case]
    sm = image.sms[0]
    args = helm_values(image, pin, sm, "ghcr.io/you/x", image.tag(pin.cuda, sm, pin), DIGEST)["serve"]["args"]
    template = args[args.index("--chat-template") + 1]
    assert template == "/opt/kiln/chat-templates/qwen3.6.jinja"
    assert template in {baked.path for baked in image.files}


@pytest.mark.parametrize("chart", CHARTS)
def test_the_cpu_pin_gets_no_helm_values(catalogue, chart):
    """Values ask for a GPU node of one SM: for the CPU pin's image that would be a lie."""
    pins = load_pins(paths.PINS)
    image = load_definition(paths.IMAGES, "qwen3.6-tiny-cpu", catalogue, pins)
    (pin,) = image.pins_of(pins)
    with pytest.raises(KilnError, match=f"pin {pin.name}: the CPU pin's images are served by ci/serve_check"):
        check_chart(chart, image, pin)
    publisher = ValuesPublisher(paths.REPO / "out.yaml", parse_reference("ghcr.io/you/x"), chart, image, pin)
    with pytest.raises(KilnError, match="are for GPU pins"):
        publisher.check()
