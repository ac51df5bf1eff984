"""The GitHub Actions workflow in ``.github/workflows/kiln.yml``: its structure and wiring.

``tests/test_run_workflow.py`` runs it (``ci/run_workflow.py``); this checks what a run on one
event cannot: the jobs and their ``needs``, the plan job's outputs feeding the build matrix,
the matrix keys the build uses existing in ``plan``'s real output, secrets reaching only the
login step, the destination and pin rules, and every ``build.py`` command line parsing with
kiln's own argument parser (a renamed option fails here, not in CI).
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess

import pytest
import yaml

from kiln import commands, paths

WORKFLOW = paths.REPO / ".github" / "workflows" / "kiln.yml"
_EXPR = re.compile(r"\$\{\{\s*(.*?)\s*\}\}")
_SHELL_VAR = re.compile(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?")


@pytest.fixture(scope="module")
def workflow() -> dict:
    return yaml.safe_load(WORKFLOW.read_text())


@pytest.fixture(scope="module")
def matrix_entry() -> dict:
    """One entry of the matrix ``plan --all`` prints for this repository."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert commands.main(["plan", "--all"]) == 0
    include = json.loads(out.getvalue())["include"]
    assert include, "the repository defines at least one image"
    return include[0]


def _walk(node, path=()):
    if isinstance(node, dict):
        for key, value in node.items():
            yield path + (key,), key, value
            yield from _walk(value, path + (key,))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _walk(value, path + (i,))


def test_triggers_jobs_and_needs(workflow):
    triggers = workflow.get("on", workflow.get(True))  # YAML 1.1 reads a bare `on` as true
    assert {"push", "pull_request", "workflow_dispatch"} <= set(triggers)
    jobs = workflow["jobs"]
    assert set(jobs) == {"test", "plan", "build", "release-train", "warm"}
    # the whole release train, against the record (a difference or a crash fails the run)
    assert ".venv/bin/python build.py verify --vllm 0.20.1..0.33.0" in [s.get("run") for s in jobs["release-train"]["steps"]]
    assert set(jobs["build"]["needs"]) == {"plan", "test"}  # nothing is built from a red tree
    # the optional warm job: only on a runner the repository names (a GPU's), only after the push
    warm = jobs["warm"]
    assert set(warm["needs"]) == {"plan", "build"} and warm["runs-on"] == (
        "${{ fromJSON(vars.KILN_WARM_RUNNER || '[\"self-hosted\", \"gpu\"]') }}")
    assert warm["if"].startswith("vars.KILN_WARM_RUNNER != '' && github.event_name != 'pull_request'")
    assert "needs" not in jobs["plan"] and "needs" not in jobs["test"]
    assert [s.get("run") for s in jobs["test"]["steps"] if "run" in s] == ["ci/test"]
    for path, key, _ in _walk(workflow):
        assert key != "continue-on-error", path
    for job in jobs.values():
        for step in job["steps"]:
            if "uses" in step:
                assert re.fullmatch(r"[\w.-]+/[\w.-]+@v\d+", step["uses"]), step["uses"]


def test_plan_outputs_feed_the_build_matrix(workflow):
    plan, build = workflow["jobs"]["plan"], workflow["jobs"]["build"]
    assert build["strategy"]["matrix"] == "${{ fromJSON(needs.plan.outputs.matrix) }}"
    assert build["strategy"]["fail-fast"] is False  # one broken SM does not hide the others
    assert "needs.plan.outputs.count != '0'" in build["if"]  # GitHub rejects an empty matrix
    steps = {s["id"]: s for s in plan["steps"] if "id" in s}
    for output in ("matrix", "count"):
        match = re.fullmatch(r"\$\{\{ steps\.(\w+)\.outputs\.(\w+) \}\}", plan["outputs"][output])
        assert match and match.group(2) == output, plan["outputs"][output]
        step = steps[match.group(1)]
        assert re.search(rf'echo "{output}=.*>> "\$GITHUB_OUTPUT"', step["run"]), output
    # plan needs the history it diffs against
    checkout = next(s for s in plan["steps"] if s.get("uses", "").startswith("actions/checkout@"))
    assert checkout["with"]["fetch-depth"] == 0


def test_matrix_keys_used_exist_in_plan_output(workflow, matrix_entry):
    expressions = _EXPR.findall(WORKFLOW.read_text())
    used = {key for expr in expressions for key in re.findall(r"\bmatrix\.(\w+)", expr)}
    assert used and used <= set(matrix_entry), used - set(matrix_entry)


def test_secrets_reach_only_the_login_step(workflow):
    logins = []
    for job in workflow["jobs"].values():
        for step in job["steps"]:
            assert "secrets." not in step.get("run", "")
            if "secrets." in json.dumps(step.get("env", {})) or "secrets." in json.dumps(step.get("with", {})):
                logins.append(step)
        assert "secrets." not in json.dumps(job.get("env", {}))
    assert len(logins) == 2  # the build job's and the optional warm job's, the same step
    assert logins[0] == logins[1]
    login = logins[0]
    assert login["run"] == '.venv/bin/python ci/registry_login.py "$REPOSITORY"'
    assert login["if"] == "github.event_name != 'pull_request'"  # a pull request gets no credentials
    assert set(login["env"]) == {"REPOSITORY", "KILN_REGISTRY_USER", "KILN_REGISTRY_PASSWORD", "GITHUB_TOKEN"}


def test_only_steps_that_set_up_the_runner_are_actions(workflow):
    """Every other step is a `run:` the local runner executes as GitHub would."""
    used = {step["uses"].split("@")[0] for job in workflow["jobs"].values() for step in job["steps"] if "uses" in step}
    assert used == {"actions/checkout", "actions/setup-python", "actions/upload-artifact", "actions/cache"}
    assert not any("uses" in s and s["uses"].startswith("actions/cache") for s in workflow["jobs"]["build"]["steps"])


def test_destination_and_pin_rules(workflow):
    build = workflow["jobs"]["build"]
    assert build["permissions"]["packages"] == "write"  # GITHUB_TOKEN pushes to ghcr.io
    steps = build["steps"]
    names = [s.get("id") or s.get("name") or s.get("uses") or s["run"] for s in steps]
    dest = next(s for s in steps if s.get("id") == "dest")
    assert dest["env"]["TEMPLATE"] == "${{ vars.KILN_REPOSITORY }}"
    script = dest["run"]
    for template, owner, expected in (("", "Some-Owner", "ghcr.io/some-owner/qwen3.6-27b-tq"),
                                      ("registry.example/team/vllm-{image}", "x", "registry.example/team/vllm-qwen3.6-27b-tq")):
        out = subprocess.run(["bash", "-eo", "pipefail", "-c", script.replace('>> "$GITHUB_OUTPUT"', "")],
                             env={"TEMPLATE": template, "OWNER": owner, "IMAGE": "qwen3.6-27b-tq", "PATH": "/usr/bin:/bin"},
                             capture_output=True, text=True, check=True).stdout
        assert out.strip() == f"repository={expected}"
    lock = next(s for s in steps if "pin lock" in s.get("run", ""))
    assert lock["if"] == "vars.KILN_REQUIRE_LOCKED_PINS != 'true'"
    # the lock comes before the login and the build; the destination before both
    first_build = next(i for i, s in enumerate(steps) if "build.py build" in s.get("run", ""))
    assert names.index("dest") < steps.index(lock) < first_build
    for step in steps:
        if "build.py build" in step.get("run", ""):
            assert step["env"]["REPOSITORY"] == "${{ steps.dest.outputs.repository }}"


def test_the_matrix_shares_one_build_cache(workflow, matrix_entry):
    steps = workflow["jobs"]["build"]["steps"]
    cache = next(s for s in steps if s.get("id") == "cache")
    assert "matrix." not in str(cache)  # the same repository for every build of the matrix
    for var, template, owner, expected in (
            ("", "", "Some-Owner", "ghcr.io/some-owner/kiln-cache"),
            ("", "registry.example/team/vllm-{image}", "x", "registry.example/team/vllm-kiln-cache"),
            ("cache.example/kiln/cache", "registry.example/team/{image}", "x", "cache.example/kiln/cache")):
        out = subprocess.run(["bash", "-eo", "pipefail", "-c", cache["run"].replace('>> "$GITHUB_OUTPUT"', "")],
                             env={"CACHE": var, "TEMPLATE": template, "OWNER": owner, "PATH": "/usr/bin:/bin"},
                             capture_output=True, text=True, check=True).stdout
        assert out.strip() == f"repository={expected}"
    parser = commands.build_parser()
    job_env = workflow["jobs"]["build"]["env"]
    builds = [(step, parser.parse_args([_expand(t, {**job_env, **step["env"]}, matrix_entry) for t in raw]))
              for step in steps for raw in _commands(step.get("run", "")) if raw[0] == "build"]
    assert len(builds) == 2
    for step, args in builds:
        assert step["env"]["CACHE"] == "${{ steps.cache.outputs.repository }}"
        assert args.cache_from == ["EXPR"]  # "$CACHE": the step's expression
        # main writes the cache; a pull request (no login, nothing pushed) only reads it
        assert args.cache_to == (["EXPR"] if args.push else None)


def _commands(script: str) -> list[list[str]]:
    """Each build.py invocation in a run script, as its argument list (after ``build.py``)."""
    found = []
    for line in script.replace("\\\n", " ").splitlines():
        if "build.py" not in line or line.strip().startswith("echo "):  # a message, not a command
            continue
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        tokens = list(lexer)
        start = next(i for i, t in enumerate(tokens) if t.endswith("build.py")) + 1
        args = []
        for token in tokens[start:]:
            if token in (">", ">>", "|", "||", "&&", ";", "<"):
                break
            args.append(token)
        found.append(args)
    return found


def _expand(token: str, env: dict[str, str], matrix_entry: dict) -> str:
    def expression(match: re.Match) -> str:
        name = match.group(1)
        if name.startswith("matrix."):
            return str(matrix_entry[name.removeprefix("matrix.")])
        return "EXPR"

    def variable(match: re.Match) -> str:
        value = env.get(match.group(1))
        return _EXPR.sub(expression, value) if value is not None else "HEAD~1"  # a shell variable

    return _SHELL_VAR.sub(variable, _EXPR.sub(expression, token))


def test_every_build_py_command_parses(workflow, matrix_entry):
    parser = commands.build_parser()
    seen: dict[str, list] = {}
    for job_name, job in workflow["jobs"].items():
        for step in job["steps"]:
            env = {**job.get("env", {}), **step.get("env", {})}
            for raw in _commands(step.get("run", "")):
                argv = [_expand(t, env, matrix_entry) for t in raw]
                try:
                    args = parser.parse_args(argv)
                except SystemExit:
                    pytest.fail(f"{job_name}: `build.py {' '.join(raw)}` does not parse with kiln's CLI")
                seen.setdefault(args.command, []).append((job_name, step.get("if", ""), args))
    assert {job for job, _, _ in seen["plan"]} == {"plan"}
    assert {bool(a.all) for _, _, a in seen["plan"]} == {True, False}
    warm_builds = [args for job, _, args in seen["build"] if job == "warm"]
    builds = [entry for entry in seen["build"] if entry[0] != "warm"]
    assert {job for job, _, _ in builds} == {"build"}
    # the warm job: the bundle of the pushed image's boot, baked and written to the shared cache
    [warmed] = [args for job, _, args in seen["warm"] if job == "warm"]
    [warm_build] = warm_builds
    assert (warmed.image, warmed.pin, warmed.sm) == (warm_build.image, warm_build.pin, warm_build.sm) == (
        matrix_entry["image"], matrix_entry["pin"], matrix_entry["sm"])
    assert warm_build.warm == warmed.out and warm_build.platform and warm_build.push
    assert warm_build.cache_from == warm_build.cache_to == ["EXPR"]
    for _, condition, args in builds:
        assert (args.image, args.pin, args.sm) == (matrix_entry["image"], matrix_entry["pin"], matrix_entry["sm"])
        assert args.values and args.json and args.repository
        # main pushes; a pull request builds without pushing
        assert args.push == (condition == "github.event_name != 'pull_request'"), condition
    assert sorted(a.push for _, _, a in builds) == [False, True]


def test_builds_run_kiln_on_the_python_of_vllms_images(workflow):
    """kiln compiles Triton kernels with the wheel for its own Python: the build job runs the
    images' Python (``python3.12/dist-packages`` in vLLM's images, as in the test fixtures)."""
    from tests.support.registry import SITE

    image_python = re.search(r"python(\d+\.\d+)/", SITE).group(1)
    [setup] = [s for s in workflow["jobs"]["build"]["steps"] if s.get("uses", "").startswith("actions/setup-python")]
    assert str(setup["with"]["python-version"]) == image_python == "3.12"
