"""``--chart vllm-stack``: values for vLLM production-stack's chart, checked against that chart's
own ``values.schema.json`` (vendored, ``kiln/schemas/helm/vllm-stack/SOURCE.toml``) and against what its
Deployment template renders from them (``helm/templates/deployment-vllm-multi.yaml``)."""

from __future__ import annotations

import hashlib
import json
import shutil
import tomllib

import jsonschema
import pytest

from kiln import commands, paths
from kiln.definitions import load_definitions
from kiln.errors import KilnError
from kiln.pins import load_pins
from kiln.publish.values import chart_values, helm_values
from kiln.publish.vllm_stack import VLLM_STACK_SCHEMA, vllm_config, vllm_stack_values

DIGEST = "sha256:" + "cd" * 32
WHERE = "images/x.toml: serve.args"


@pytest.fixture(scope="module")
def validator():
    schema = json.loads(VLLM_STACK_SCHEMA.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def test_the_vendored_schema_is_the_recorded_one():
    source = tomllib.loads((VLLM_STACK_SCHEMA.parent / "SOURCE.toml").read_text())
    assert source["repository"] == "https://github.com/vllm-project/production-stack"
    assert len(source["commit"]) == 40 and source["path"] == "helm/values.schema.json"
    assert hashlib.sha256(VLLM_STACK_SCHEMA.read_bytes()).hexdigest() == source["sha256"]
    schema = json.loads(VLLM_STACK_SCHEMA.read_text())
    assert "vllmConfig" in schema["properties"]["servingEngineSpec"]["properties"]["modelSpec"]["items"]["properties"]


def _render(spec: dict) -> list[str]:
    """The container command the chart's Deployment template renders for one modelSpec entry
    (``vllm serve {modelURL} --host … --port …``, then the vllmConfig part), in its order."""
    argv = ["vllm", "serve", spec["modelURL"], "--host", "0.0.0.0", "--port", "8000"]
    config = spec.get("vllmConfig")
    if config is None:
        return argv
    if "enableChunkedPrefill" in config:
        argv.append("--enable-chunked-prefill" if config["enableChunkedPrefill"] else "--no-enable-chunked-prefill")
    argv.append("--enable-prefix-caching" if config.get("enablePrefixCaching") else "--no-enable-prefix-caching")
    for key, flag in (("maxModelLen", "--max-model-len"), ("dtype", "--dtype"),
                      ("tensorParallelSize", "--tensor-parallel-size"), ("maxNumSeqs", "--max-num-seqs"),
                      ("gpuMemoryUtilization", "--gpu_memory_utilization"), ("maxLoras", "--max_loras")):
        if key in config:
            argv += [flag, str(config[key])]  # Helm's `quote` of a YAML number
    return argv + list(config.get("extraArgs", []))


def _options(argv: list[str]) -> dict[str, list[str]]:
    """flag -> the tokens up to the next flag (vLLM reads ``_`` and ``-`` alike)."""
    found: dict[str, list[str]] = {}
    flag = None
    for token in argv:
        if token.startswith("--"):
            flag = "--" + token[2:].replace("_", "-")
            assert flag not in found, f"{flag} twice"
            found[flag] = []
        elif flag is not None:
            found[flag].append(token)
    return found


def _shipped(catalogue):
    pins = load_pins(paths.PINS)
    return [(image, pin) for image in load_definitions(paths.IMAGES, catalogue, pins) for pin in image.pins_of(pins)
            if not pin.cpu]  # the CPU pin's image serves under ci/serve_check (tests/test_serve_check.py)


def test_every_sm_of_every_shipped_image_validates_and_renders_its_serve_args(catalogue, validator):
    shipped = _shipped(catalogue)
    assert {image.name for image, _ in shipped} == {"qwen3.6-27b-tq", "qwen3.6-35b-a3b-fp8"}
    for image, pin in shipped:
        repository = f"ghcr.io/you/vllm-{image.name}"
        for sm in image.sms:
            tag = image.tag(pin.cuda, sm, pin)
            values = chart_values("vllm-stack", image, pin, sm, repository, tag, DIGEST)
            validator.validate(values)
            assert set(values) == {"servingEngineSpec"}
            (spec,) = values["servingEngineSpec"]["modelSpec"]
            # the template renders "repository:tag": the image is pulled by its digest
            assert f"{spec['repository']}:{spec['tag']}" == f"{repository}:{tag}@{DIGEST}"
            assert spec["modelURL"] == image.model.id
            assert spec["name"] == image.name.replace(".", "-")
            assert spec["env"] == [{"name": k, "value": v} for k, v in image.serve_env.items()]
            assert spec["requestGPU"] == 1 and spec["resources"]["limits"] == {"nvidia.com/gpu": 1}
            major, minor = divmod(sm, 10)
            assert spec["nodeSelectorTerms"] == [{"matchExpressions": [
                {"key": "nvidia.com/gpu.compute.major", "operator": "In", "values": [str(major)]},
                {"key": "nvidia.com/gpu.compute.minor", "operator": "In", "values": [str(minor)]}]}]
            assert spec["annotations"]["io.kiln.pin"] == pin.name and spec["annotations"]["io.kiln.sm"] == str(sm)
            # what the chart runs is what the image definition says vllm serve should get
            rendered = _options(_render(spec))
            wanted = {"--host": ["0.0.0.0"], "--port": ["8000"], **_options(list(image.serve_args))}
            assert rendered.keys() == wanted.keys()
            for flag, value in wanted.items():
                if flag == "--gpu-memory-utilization":
                    assert float(rendered[flag][0]) == float(value[0])
                else:
                    assert rendered[flag] == value, flag
            config = spec["vllmConfig"]  # the chart's own fields are used where they exist
            assert {"dtype", "maxModelLen", "maxNumSeqs", "gpuMemoryUtilization", "enablePrefixCaching"} <= set(config)
            assert config["enablePrefixCaching"] is True
            assert not {"--dtype", "--max-model-len", "--max-num-seqs"} & set(config["extraArgs"])


def _kiln_values(args: list[str], sm: int = 120) -> dict:
    values = {"image": {"repository": "ghcr.io/you/x", "tag": "t", "digest": DIGEST, "pullPolicy": "IfNotPresent"},
              "model": {"id": "org/model"}, "serve": {"args": args, "env": []},
              "resources": {"requests": {"nvidia.com/gpu": 1}, "limits": {"nvidia.com/gpu": 1}},
              "nodeSelector": {"nvidia.com/gpu.compute.major": "12", "nvidia.com/gpu.compute.minor": "0"},
              "kiln": {"image": "x", "pin": "p", "vllm": "0.20.1", "sm": sm}}
    return values


def test_mapping_forms(validator):
    config, gpus = vllm_config(["--dtype=half", "--max_model_len", "4096", "--no-enable-prefix-caching",
                                "-tp", "2", "--pipeline-parallel-size=2", "--trust-remote-code"], WHERE)
    assert config == {"dtype": "half", "maxModelLen": 4096, "enablePrefixCaching": False, "tensorParallelSize": 2,
                      "extraArgs": ["--pipeline-parallel-size=2", "--trust-remote-code"]}
    assert gpus == 4
    values = vllm_stack_values(_kiln_values(["-tp", "2", "--enable-prefix-caching"]), WHERE)
    validator.validate(values)
    spec = values["servingEngineSpec"]["modelSpec"][0]
    assert spec["requestGPU"] == 2 and spec["resources"]["requests"] == {"nvidia.com/gpu": 2}
    # a value the chart's integer field cannot hold is passed on untouched
    config, _ = vllm_config(["--max-model-len", "128k", "--enable-prefix-caching"], WHERE)
    assert config == {"enablePrefixCaching": True, "extraArgs": ["--max-model-len", "128k"]}


@pytest.mark.parametrize(("args", "message"), [
    (["--dtype", "half"], "passes --no-enable-prefix-caching unless told otherwise"),
    (["--enable-prefix-caching", "--port", "9000"], "--port: the vllm-stack chart sets --port itself"),
    (["--enable-prefix-caching", "--host=::"], "--host: the vllm-stack chart sets --host itself"),
    (["--enable-prefix-caching", "--dtype", "half", "--dtype", "float16"], "dtype is given twice"),
    (["--enable-prefix-caching", "--max-num-seqs"], "--max-num-seqs: no value follows it"),
    (["--enable-prefix-caching", "-tp", "two"], "'two' is not a number of GPUs"),
])
def test_serve_args_the_chart_cannot_take(args, message):
    with pytest.raises(KilnError, match="^" + WHERE) as err:
        vllm_config(args, WHERE)
    assert message in str(err.value)


@pytest.mark.parametrize(("path", "value"), [
    (("vllmConfig", "maxModelLen"), "131072"),
    (("vllmConfig", "enablePrefixCaching"), "true"),
    (("vllmConfig", "extraArgs"), [1]),
    (("tag",), 1),
    (("env",), {"A": "1"}),
])
def test_the_charts_schema_has_teeth(validator, path, value):
    values = vllm_stack_values(_kiln_values(["--enable-prefix-caching", "--max-model-len", "8", "--x"]), WHERE)
    validator.validate(values)
    node = values["servingEngineSpec"]["modelSpec"][0]
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(jsonschema.ValidationError):
        validator.validate(values)


def test_kiln_values_stay_the_default(catalogue):
    image, pin = _shipped(catalogue)[0]
    assert chart_values("kiln", image, pin, 120, "ghcr.io/you/x", "t", DIGEST) == helm_values(
        image, pin, 120, "ghcr.io/you/x", "t", DIGEST)


def test_build_refuses_a_definition_the_chart_cannot_take_before_any_work(tmp_path, capsys):
    images = tmp_path / "images"
    shutil.copytree(paths.IMAGES / "files", images / "files")  # the files the definition bakes
    text = (paths.IMAGES / "qwen3.6-27b-tq.toml").read_text()
    assert '  "--enable-prefix-caching",\n' in text
    (images / "qwen3.6-27b-tq.toml").write_text(text.replace('  "--enable-prefix-caching",\n', ""))
    # the pin's base is on a registry nothing listens on: reaching it would be another error
    pins = tmp_path / "pins.toml"
    pins.write_text(paths.PINS.read_text().replace("docker.io/vllm", "127.0.0.1:9/vllm"))
    argv = ["--pins", str(pins), "--images", str(images), "build", "--image", "qwen3.6-27b-tq", "--pin", "v0.20.1",
            "--sm", "120", "--allow-unlocked", "--repository", "127.0.0.1:9/x/y", "--values", str(tmp_path / "v.json"),
            "--chart", "vllm-stack"]
    assert commands.main(argv) == 2
    err = capsys.readouterr().err
    assert "qwen3.6-27b-tq.toml: serve.args: the vllm-stack chart passes --no-enable-prefix-caching" in err
    assert not (tmp_path / "v.json").exists()
    assert commands.main(argv[:-2]) != 0  # kiln's own values take the same definition: it fails later, on the pull
    assert "127.0.0.1:9" in capsys.readouterr().err


def test_chart_without_values_is_refused(capsys):
    code = commands.main(["build", "--image", "qwen3.6-27b-tq", "--pin", "v0.20.1", "--sm", "120",
                          "--chart", "vllm-stack"])
    assert code == 2
    assert "--chart vllm-stack: chooses the shape of --values FILE, which is not given" in capsys.readouterr().err
