"""Helm values end to end: ``build --push --values`` against a real docker-registry, then
``build.py values`` reading the same image back; both validated against the shipped schema."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import jsonschema
import pytest

from kiln.publish.values import VALUES_SCHEMA
from tests.support.kiln_process import run_kiln
from tests.support.registry import VLLM_VERSION

pytestmark = pytest.mark.registry

IMAGE = "e2e-helm"
DEFINITION = f"""
name = "{IMAGE}"
repository = "docker.io/kiln/e2e-helm"
pins = ["v0.20.1"]
sms = [86, 120]
tag = "{{cuda}}-sm{{sm}}-{{pin}}"
patches = ["P65"]

[model]
id = "Lorbus/Qwen3.6-27B-int4-AutoRound"
architectures = ["Qwen3_5ForConditionalGeneration"]
dtype = "float16"
kv_cache_dtype = "turboquant_k8v4"

[serve]
args = ["--kv-cache-dtype", "turboquant_k8v4", "--enable-prefix-caching", "--speculative-config", '{{"method": "mtp", "num_speculative_tokens": 3}}']

[serve.env]
VLLM_NO_USAGE_STATS = "1"
OMP_NUM_THREADS = "1"
"""


class Project:
    def __init__(self, root: Path, registry):
        self.root, self.registry = root, registry
        self.dest = "test/" + re.sub(r"[^a-z0-9]+", "-", root.name.lower()).strip("-")
        (root / "images").mkdir()
        (root / "images" / f"{IMAGE}.toml").write_text(DEFINITION)
        self.pins = root / "pins.toml"
        self.pins.write_text(
            '[pins."v0.20.1"]\nrole = "current"\nimage = "docker.io/vllm/vllm-openai:v0.20.1"\n'
            f'vllm = "{VLLM_VERSION}"\ncuda = "cu130"\n'
            f'digest = "{registry.digest_of(f"vllm/vllm-openai:v{VLLM_VERSION}")}"\n'
        )

    def run(self, capsys, command: str, *extra: str, sm: int = 120, pins: Path | None = None):
        argv = ["--pins", str(pins or self.pins), "--images", str(self.root / "images"), command,
                "--image", IMAGE, "--pin", "v0.20.1", "--sm", str(sm), "--mirror", self.registry.mirror,
                "--repository", f"{self.registry.host}/{self.dest}", *extra]
        return run_kiln(*argv)  # builds and pushes: a process of its own (tests/support/kiln_process.py)


@pytest.fixture
def project(tmp_path, registry_plain) -> Project:
    return Project(tmp_path, registry_plain)


@pytest.fixture(scope="module")
def validator():
    schema = json.loads(VALUES_SCHEMA.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker())


def test_build_writes_values_and_values_command_reads_the_same(project, capsys, tmp_path, validator):
    values_file = tmp_path / "out" / "values.json"
    code, out, err = project.run(capsys, "build", "--push", "--values", str(values_file), "--json")
    assert code == 0, err
    result = json.loads(out)
    written = values_file.read_bytes()
    values = json.loads(written)
    validator.validate(values)
    assert values == result["helm_values"]  # the --json summary always carries them
    assert result["outputs"]["values"] == str(values_file)
    assert values["image"] == {
        "repository": f"{project.registry.host}/{project.dest}",
        "tag": f"cu130-sm120-v{VLLM_VERSION}",
        "digest": result["manifest_digest"],
        "pullPolicy": "IfNotPresent",
    }
    # the digest is the one the registry serves for the tag (read with skopeo, not kiln)
    assert project.registry.digest_of(f"{project.dest}:{values['image']['tag']}") == values["image"]["digest"]
    assert values["serve"]["args"][-1] == '{"method": "mtp", "num_speculative_tokens": 3}'
    assert values["serve"]["env"] == [{"name": "VLLM_NO_USAGE_STATS", "value": "1"},
                                      {"name": "OMP_NUM_THREADS", "value": "1"}]
    assert values["nodeSelector"] == {"nvidia.com/gpu.compute.major": "12", "nvidia.com/gpu.compute.minor": "0"}
    assert values["kiln"] == {"image": IMAGE, "pin": "v0.20.1", "vllm": VLLM_VERSION, "sm": 120}

    # later, from the registry alone: byte-identical values
    code, printed, err = project.run(capsys, "values")
    assert code == 0, err
    assert printed.encode() == written


def test_vllm_stack_chart_values_from_build_and_from_the_registry(project, capsys, tmp_path):
    from kiln.publish.vllm_stack import VLLM_STACK_SCHEMA

    values_file = tmp_path / "values.yaml"  # JSON is YAML: `helm install -f values.yaml`
    code, out, err = project.run(capsys, "build", "--push", "--values", str(values_file), "--chart", "vllm-stack",
                                 "--json")
    assert code == 0, err
    result = json.loads(out)
    values = json.loads(values_file.read_bytes())
    jsonschema.Draft202012Validator(json.loads(VLLM_STACK_SCHEMA.read_text())).validate(values)
    assert values == result["helm_values"]
    (spec,) = values["servingEngineSpec"]["modelSpec"]
    assert spec["repository"] == f"{project.registry.host}/{project.dest}"
    tag, digest = spec["tag"].split("@")
    assert digest == result["manifest_digest"] == project.registry.digest_of(f"{project.dest}:{tag}")
    assert spec["vllmConfig"] == {"enablePrefixCaching": True, "extraArgs": [
        "--kv-cache-dtype", "turboquant_k8v4", "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 3}']}
    code, printed, err = project.run(capsys, "values", "--chart", "vllm-stack")
    assert code == 0, err
    assert printed.encode() == values_file.read_bytes()


def test_values_of_an_image_never_built(project, capsys, tmp_path):
    code, out, err = project.run(capsys, "build", "--push")
    assert code == 0, err
    code, out, err = project.run(capsys, "values", sm=86)  # sm 120 was pushed, sm 86 never was
    assert code == 2 and out == ""
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), err
    assert f"{project.registry.host}/{project.dest}:cu130-sm86-v{VLLM_VERSION}" in lines[0] and "never built" in lines[0]


def test_values_refuses_a_tag_holding_another_image(project, capsys):
    code, _, err = project.run(capsys, "build", "--push")
    assert code == 0, err
    host = project.registry.host
    subprocess.run(["skopeo", "copy", "--quiet", "--src-tls-verify=false", "--dest-tls-verify=false",
                    f"docker://{host}/{project.dest}:cu130-sm120-v{VLLM_VERSION}",
                    f"docker://{host}/{project.dest}:cu130-sm86-v{VLLM_VERSION}"], check=True, capture_output=True)
    code, out, err = project.run(capsys, "values", sm=86)
    assert code == 2 and out == ""
    assert "not kiln's e2e-helm v0.20.1 sm 86 image" in err and "io.kiln.sm='120'" in err, err


def test_failed_build_writes_no_values(project, capsys, tmp_path):
    pins = tmp_path / "bad-pins.toml"
    pins.write_text(project.pins.read_text().split("digest =")[0] + f'digest = "sha256:{"0" * 64}"\n')
    values_file = tmp_path / "out" / "values.json"
    code, out, err = project.run(capsys, "build", "--push", "--values", str(values_file), pins=pins)
    assert code == 2 and "now resolves to" in err, err
    assert not (tmp_path / "out").exists()
