"""The shipped workflow, run: ``ci/run_workflow.py`` on a clean clone against local registries.

The clone gets one commit on top (a small image definition, so the plan holds one build instead
of twenty); the workflow file, pins.toml (unlocked, as shipped) and every script are the
repository's own. The base comes from a local registry standing in for Docker Hub (a mirror,
through ``KILN_REGISTRIES`` in the runner's environment, as on a self-hosted runner) and the
image goes to a registry that needs a login, named by the one variable ``KILN_REPOSITORY``.
Also here: the expression evaluator the runner uses, and the login script's failures.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import requests

# ci/, on the tests' path (tests/__init__.py)
from actions_expr import ExpressionError, evaluate, interpolate, with_status  # noqa: E402
from registry_login import login  # noqa: E402

from kiln import paths
from kiln.image.cachekeys import entry_tag
from kiln.publish.values import VALUES_SCHEMA
from kiln.publish.vllm_stack import VLLM_STACK_SCHEMA

FIXTURE_IMAGE = """\
# a test fixture: one pin, one SM on two platforms, one patch, no kernels (tests/test_run_workflow.py)
name = "ci-fixture"
pins = ["v0.20.1"]
sms = [90]
tag = "{cuda}-sm{sm}-{pin}"
patches = ["P65"]

[model]
id = "Lorbus/Qwen3.6-27B-int4-AutoRound"
architectures = ["Qwen3_5ForConditionalGeneration"]
dtype = "float16"
kv_cache_dtype = "turboquant_k8v4"

[serve]
args = ["--max-model-len", "4096", "--enable-prefix-caching"]
"""


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(cwd), "-c", "user.name=kiln test", "-c", "user.email=test@kiln.invalid",
                           *args], check=True, capture_output=True, text=True).stdout.strip()


@pytest.mark.registry
def test_the_workflow_goes_green_on_a_clean_clone(tmp_path, start_registry, registry_plain, registry_basic):
    # Docker Hub as vLLM's release tags are: v0.20.1 an index of linux/amd64 and linux/arm64
    hub = start_registry("plain", copy_from=registry_plain)
    subprocess.run(["skopeo", "copy", "--all", "--src-tls-verify=false", "--dest-tls-verify=false",
                    f"docker://{hub.host}/vllm/vllm-openai:v0.20.1-multi",
                    f"docker://{hub.host}/vllm/vllm-openai:v0.20.1"], check=True, capture_output=True)
    head = _git(paths.REPO, "rev-parse", "HEAD")
    src = tmp_path / "src"
    subprocess.run(["git", "clone", "--quiet", "--no-local", str(paths.REPO), str(src)], check=True)
    _git(src, "checkout", "--quiet", head)
    assert "digest = \"\"" in (src / "pins.toml").read_text()  # the shipped pins are unlocked
    (src / "images" / "ci-fixture.toml").write_text(FIXTURE_IMAGE)
    _git(src, "add", "images/ci-fixture.toml")
    _git(src, "commit", "--quiet", "-m", "a fixture image")
    # the runner machine's environment: Docker Hub is the local registry; both speak plain HTTP
    Path(os.environ["KILN_REGISTRIES"]).write_text(
        f'insecure = ["{hub.host}", "{registry_basic.host}"]\n'
        f'[mirrors]\n"docker.io" = "http://{hub.host}"\n')
    env = {k: v for k, v in os.environ.items() if k != "KILN_PROGRESS"}
    work = tmp_path / "work"
    result = subprocess.run(
        [sys.executable, str(src / "ci" / "run_workflow.py"), "--repo", str(src), "--event", "push",
         "--before", "HEAD~1", "--var", f"KILN_REPOSITORY={registry_basic.host}/ci/{{image}}",
         "--secret", "KILN_REGISTRY_USER=testuser", "--secret", "KILN_REGISTRY_PASSWORD=testpass",
         "--skip-job", "test", "--skip-job", "release-train", "--work", str(work)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-6000:]
    summary = result.stdout[result.stdout.rindex("summary:"):].splitlines()[1:]  # the runner's last lines
    assert [line.strip() for line in summary] == [
        "test: skipped on request", "release-train: skipped on request", "plan: success", "build: success",
        "warm: skipped"], log[-3000:]
    # no GPU runner named (vars.KILN_WARM_RUNNER): the optional warm job is skipped, in one line
    assert [line for line in log.splitlines() if "job warm" in line] == [
        "== job warm: skipped (if: vars.KILN_WARM_RUNNER != '' && github.event_name != 'pull_request' && "
        "needs.plan.outputs.count != '0')"], log[-3000:]
    # the pin was locked by the workflow's own step, which said so
    assert "::warning::pin v0.20.1 is unlocked in pins.toml" in log
    assert f"logged in to {registry_basic.host} for {registry_basic.host}/ci/ci-fixture" in log
    assert "stage pull: " in log and "stage publish: " in log  # plain progress in the job's log
    out = work / "artifacts" / "kiln-ci-fixture-cu130-sm90-v0.20.1" / "out"
    built = json.loads((out / "build-ci-fixture-cu130-sm90-v0.20.1.json").read_text())
    assert built["repository"] == f"{registry_basic.host}/ci/ci-fixture"
    assert registry_basic.digest_of("ci/ci-fixture:cu130-sm90-v0.20.1") == built["manifest_digest"]
    # one job pushed one index of both platforms (read back by skopeo)
    index = json.loads(subprocess.run(
        ["skopeo", "inspect", "--raw", "--tls-verify=false", "--creds", "testuser:testpass",
         f"docker://{registry_basic.host}/ci/ci-fixture:cu130-sm90-v0.20.1"],
        check=True, capture_output=True).stdout)
    assert index["mediaType"] == "application/vnd.oci.image.index.v1+json"
    assert [f"{m['platform']['os']}/{m['platform']['architecture']}" for m in index["manifests"]] == [
        "linux/amd64", "linux/arm64"] == list(built["platforms"])
    # the matrix's shared build cache: read (a miss on a fresh registry), then written beside the images
    assert built["cache"]["hit"] is None
    written, tags = [], []
    for cached in built["cache"]["entries"]:  # each platform's patched entry (and kernel entry, if kernels)
        tags += [cached["tag"]] + ([entry_tag(cached["kind"], cached["source_key"])] if "source_key" in cached else [])
    for tag in dict.fromkeys(tags):  # under its layers' key and its source's, which the platforms share: once
        entry = requests.get(f"{registry_basic.url}/v2/ci/kiln-cache/manifests/{tag}",
                             auth=("testuser", "testpass"),
                             headers={"Accept": "application/vnd.oci.image.manifest.v1+json"}, timeout=30)
        assert entry.status_code == 200, entry.text
        assert entry.json()["artifactType"] == f"application/vnd.kiln.cache.{tag.split('-')[2]}.v1"
        written.append(f"{registry_basic.host}/ci/kiln-cache@{entry.headers['Docker-Content-Digest']}")
    assert "patched" in [e["kind"] for e in built["cache"]["entries"]] and built["cache"]["written"] == written
    values = json.loads((out / "values-ci-fixture-cu130-sm90-v0.20.1.json").read_text())
    jsonschema.validate(values, json.loads(VALUES_SCHEMA.read_text()))
    assert values["image"]["digest"] == built["manifest_digest"]
    stack = json.loads((out / "vllm-stack-values-ci-fixture-cu130-sm90-v0.20.1.yaml").read_text())
    jsonschema.validate(stack, json.loads(VLLM_STACK_SCHEMA.read_text()))
    assert stack["servingEngineSpec"]["modelSpec"][0]["tag"].endswith("@" + built["manifest_digest"])


CONTEXT = {
    "github": {"event_name": "push", "event": {"before": "abc"}, "repository_owner": "Me"},
    "vars": {"KILN_REPOSITORY": ""}, "needs": {"plan": {"outputs": {"count": "0", "matrix": '{"include": [{"a": 1}]}'}}},
    "matrix": {"image": "x"}, "inputs": {"all": True},
}


@pytest.mark.parametrize(("expression", "value"), [
    ("github.event_name != 'pull_request'", True),
    ("github.event_name == 'PUSH'", True),  # GitHub compares strings ignoring case
    ("needs.plan.outputs.count != '0'", False),
    ("fromJSON(needs.plan.outputs.matrix)", {"include": [{"a": 1}]}),
    ("vars.KILN_REPOSITORY || format('ghcr.io/{0}/{1}', github.repository_owner, matrix.image)", "ghcr.io/Me/x"),
    ("vars.MISSING", None),
    ("!inputs.all && true", False),
    ("github.event.pull_request.base.sha", None),
    ("contains('abc', 'B')", True),
    ("1 < 2 && (2 >= 2)", True),
    ("'it''s'", "it's"),
])
def test_expressions(expression, value):
    assert evaluate(expression, CONTEXT) == value


def test_interpolation_keeps_the_type_of_a_whole_expression():
    assert interpolate("${{ fromJSON(needs.plan.outputs.matrix) }}", CONTEXT) == {"include": [{"a": 1}]}
    assert interpolate("build ${{ matrix.image }} ${{ inputs.all }}", CONTEXT) == "build x true"
    with pytest.raises(ExpressionError, match="unknown context 'nope'"):
        evaluate("nope.x", CONTEXT)


def test_login_writes_the_registry_entry_only(tmp_path):
    config = tmp_path / "docker" / "config.json"
    config.parent.mkdir()
    config.write_text(json.dumps({"auths": {"other.example": {"auth": "b3RoZXI6eA=="}}}))
    env = {"DOCKER_CONFIG": str(tmp_path / "docker"), "KILN_REGISTRY_USER": "u", "KILN_REGISTRY_PASSWORD": "p"}
    assert login("registry.example:5000/team/image", env) == config
    auths = json.loads(config.read_text())["auths"]
    assert auths["registry.example:5000"] == {"auth": base64.b64encode(b"u:p").decode()}
    assert "other.example" in auths  # what was there stays
    assert config.stat().st_mode & 0o777 == 0o600
    # ghcr.io without secrets: the job's token
    login("ghcr.io/me/image", {"DOCKER_CONFIG": env["DOCKER_CONFIG"], "GITHUB_TOKEN": "t", "GITHUB_ACTOR": "me"})
    assert json.loads(config.read_text())["auths"]["ghcr.io"] == {"auth": base64.b64encode(b"me:t").decode()}


@pytest.mark.parametrize(("env", "message"), [
    ({}, "secrets KILN_REGISTRY_USER and KILN_REGISTRY_PASSWORD are not set"),
    ({"KILN_REGISTRY_USER": "u"}, "secret KILN_REGISTRY_PASSWORD is not set"),
    ({"KILN_REGISTRY_PASSWORD": "p"}, "secret KILN_REGISTRY_USER is not set"),
])
def test_a_missing_secret_is_one_line(tmp_path, env, message):
    script = paths.REPO / "ci" / "registry_login.py"
    result = subprocess.run([sys.executable, str(script), "quay.io/me/image"], capture_output=True, text=True,
                            env={"PATH": os.environ["PATH"], "DOCKER_CONFIG": str(tmp_path), **env})
    assert result.returncode == 1 and result.stderr == ""
    [line] = result.stdout.splitlines()
    assert line.startswith("::error::" + message) and "quay.io" in line, line
    assert not (tmp_path / "config.json").exists()


STATUS_WORKFLOW = """\
name: status
on: push
jobs:
  first:
    runs-on: ubuntu-latest
    steps:
      - name: login
        run: echo login >> "$MARKS"; exit 3
      - name: push
        if: github.event_name == 'push'
        run: echo push >> "$MARKS"
      - name: push-expr
        if: ${{ github.event_name == 'push' }}
        run: echo push-expr >> "$MARKS"
      - name: report
        if: failure() && github.event_name == 'push'
        run: echo report >> "$MARKS"
      - name: cleanup
        if: always()
        run: echo cleanup >> "$MARKS"
  after:
    needs: first
    if: github.event_name == 'push'
    runs-on: ubuntu-latest
    steps:
      - run: echo after >> "$MARKS"
  notify:
    needs: first
    if: always() && github.event_name == 'push'
    runs-on: ubuntu-latest
    steps:
      - run: echo notify >> "$MARKS"
"""


def test_a_step_if_without_a_status_function_does_not_run_after_a_failure(tmp_path):
    """GitHub reads a step's (and a job's) ``if:`` that calls no status function as
    ``success() && (…)``: after the login step failed, the push step is skipped; ``failure()``
    and ``always()`` steps and an ``always()`` job still run."""
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "--quiet")
    (repo / ".github" / "workflows").mkdir(parents=True)
    workflow = repo / ".github" / "workflows" / "status.yml"
    workflow.write_text(STATUS_WORKFLOW)
    _git(repo, "add", ".")
    _git(repo, "commit", "--quiet", "-m", "a workflow")
    marks = tmp_path / "marks"
    result = subprocess.run(
        [sys.executable, str(paths.REPO / "ci" / "run_workflow.py"), "--repo", str(repo), "--workflow",
         str(workflow), "--work", str(tmp_path / "work")],
        cwd=tmp_path, env={**os.environ, "MARKS": str(marks)}, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    assert marks.read_text().split() == ["login", "report", "cleanup", "notify"]
    assert "-- step push: skipped (if: success() && (github.event_name == 'push'))" in result.stdout
    assert "== job after: skipped (needs first, which did not succeed)" in result.stdout


@pytest.mark.parametrize(("condition", "text"), [
    ("github.event_name == 'push'", "success() && (github.event_name == 'push')"),
    ("${{ vars.X != '' }}", "success() && (vars.X != '')"),
    ("failure()", "failure()"),
    ("always() && inputs.all", "always() && inputs.all"),
    ("!cancelled()", "!cancelled()"),
    ("contains('success()', 'x')", "success() && (contains('success()', 'x'))"),  # in a string: not a call
    (True, "success() && (true)"),
])
def test_with_status(condition, text):
    assert with_status(condition) == text
