"""Run a GitHub Actions workflow's jobs here, the way GitHub would, to prove the workflow works.

    python ci/run_workflow.py [--workflow .github/workflows/kiln.yml] [--repo .] [--ref HEAD]
        [--event push|pull_request|workflow_dispatch] [--before REV] [--base REV]
        [--input all=true] [--var NAME=VALUE] [--secret NAME=VALUE] [--owner NAME]
        [--skip-job test] [--work DIR]

It reads the workflow, orders the jobs by ``needs``, evaluates job and step ``if:``s (one that
calls no status function is ``success() && (…)``, as on GitHub) and every
``${{ }}`` (``ci/actions_expr.py``) against the event given, expands a job's matrix from the
outputs of the jobs it needs (the build matrix is what ``plan`` printed), and runs each job's
``run:`` steps in order with ``bash -eo pipefail`` in a fresh clone of the repository at the
commit (the ``actions/checkout`` step: a clone, of the depth asked for), with ``GITHUB_OUTPUT``,
``GITHUB_ENV``, job and step ``env``. Each job gets its own Docker auth file
(``DOCKER_CONFIG``), as a fresh runner machine has its own; everything else comes from this
process's environment, as on a self-hosted runner (so ``KILN_REGISTRIES`` can point the
images' registries at local ones).

``uses:`` steps: ``actions/checkout`` is the clone above, ``actions/upload-artifact`` copies its
``path`` under ``<work>/artifacts/<name>/``; ``actions/setup-python`` only sets up the runner
and is stubbed (a ``python`` on PATH: this interpreter's base). Any other action is refused,
naming it. ``--skip-job`` leaves a job out (e.g. ``test``, which runs the whole suite): its
dependents run as though it succeeded, and the summary says it was skipped on request.

Exit status: 0 when every job that ran succeeded, 1 otherwise, 2 for a bad invocation.
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import yaml

# ci/actions_expr.py, beside this script
from actions_expr import ExpressionError, evaluate, interpolate, to_string, truthy, with_status

REPO = Path(__file__).resolve().parent.parent
SETUP_ONLY = ("actions/setup-python",)  # actions that only prepare the runner machine: stubbed


class WorkflowError(Exception):
    pass


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout.strip()


def _pairs(items: list[str], option: str) -> dict[str, str]:
    found = {}
    for item in items:
        name, eq, value = item.partition("=")
        if not eq or not name:
            raise WorkflowError(f"{option} {item!r}: expected NAME=VALUE")
        found[name] = value
    return found


def _read_outputs(path: Path) -> dict[str, str]:
    """``name=value`` lines and ``name<<DELIM`` … ``DELIM`` blocks, as the runner reads them."""
    outputs: dict[str, str] = {}
    lines = path.read_text().splitlines() if path.exists() else []
    i = 0
    while i < len(lines):
        line = lines[i]
        if "<<" in line and ("=" not in line or line.index("<<") < line.index("=")):
            name, delim = line.split("<<", 1)
            end = lines.index(delim, i + 1)
            outputs[name] = "\n".join(lines[i + 1:end])
            i = end + 1
            continue
        if "=" in line:
            name, value = line.split("=", 1)
            outputs[name] = value
        i += 1
    return outputs


class Runner:
    def __init__(self, args: argparse.Namespace):
        self.workflow_path = Path(args.workflow).resolve()
        self.workflow = yaml.safe_load(self.workflow_path.read_text())
        self.repo = Path(args.repo).resolve()
        self.sha = _git(self.repo, "rev-parse", f"{args.ref}^{{commit}}")
        self.work = Path(args.work or tempfile.mkdtemp(prefix="kiln-workflow-")).resolve()
        self.work.mkdir(parents=True, exist_ok=True)
        self.skip = set(args.skip_job)
        unknown = self.skip - set(self.workflow["jobs"])
        if unknown:
            raise WorkflowError(f"--skip-job {', '.join(sorted(unknown))}: no such job in {self.workflow_path}")
        event: dict = {}
        if args.event == "push":
            event = {"before": _git(self.repo, "rev-parse", args.before) if args.before else "0" * 40,
                     "after": self.sha}
        elif args.event == "pull_request":
            event = {"pull_request": {"base": {"sha": _git(self.repo, "rev-parse", args.base or "HEAD~1")},
                                      "head": {"sha": self.sha}}}
        inputs = {k: (v if v not in ("true", "false") else v == "true") for k, v in _pairs(args.input, "--input").items()}
        event["inputs"] = inputs
        owner = args.owner
        self.secrets = _pairs(args.secret, "--secret")
        self.github = {
            "event_name": args.event, "event": event, "sha": self.sha, "ref": args.git_ref,
            "repository": f"{owner}/{self.repo.name}", "repository_owner": owner, "actor": owner,
            "workflow": self.workflow.get("name", ""), "run_id": "1", "run_number": "1",
            "token": self.secrets.get("GITHUB_TOKEN", ""),
        }
        self.context = {"github": self.github, "inputs": inputs, "vars": _pairs(args.var, "--var"),
                        "secrets": self.secrets, "runner": {"os": "Linux", "temp": str(self.work / "tmp")},
                        "env": {}, "matrix": {}, "needs": {}, "steps": {}, "strategy": {}, "job": {}}
        self.bin = self.work / "bin"  # setup-python's stub: `python` is this interpreter's base
        self.bin.mkdir(exist_ok=True)
        python = self.bin / "python"
        if not python.exists():
            python.symlink_to(getattr(sys, "_base_executable", sys.executable))
        self.results: dict[str, dict] = {}
        self.log: list[str] = []

    def say(self, line: str) -> None:
        print(line, flush=True)
        self.log.append(line)

    def order(self) -> list[str]:
        jobs, done, order = self.workflow["jobs"], set(), []
        while len(order) < len(jobs):
            ready = [name for name in jobs if name not in done and set(_needs(jobs[name])) <= done]
            if not ready:
                raise WorkflowError(f"{self.workflow_path}: the jobs' needs form a cycle")
            for name in ready:
                done.add(name)
                order.append(name)
        return order

    def run(self) -> int:
        for name in self.order():
            self.run_job(name, self.workflow["jobs"][name])
        self.say("summary:")
        for name, result in self.results.items():
            self.say(f"  {name}: {result['result']}")
        return 0 if all(r["result"] in ("success", "skipped", "skipped on request")
                        for r in self.results.values()) else 1

    def run_job(self, name: str, job: dict) -> None:
        needs = _needs(job)
        if name in self.skip:
            self.results[name] = {"result": "skipped on request", "outputs": {}}
            self.say(f"== job {name}: skipped on request (--skip-job)")
            return
        failed = [n for n in needs if self.results[n]["result"] not in ("success", "skipped on request")]
        context = {**self.context, "needs": {n: self.results[n] for n in needs},
                   "__status__": "failure" if failed else "success"}
        condition = with_status(job.get("if", "success()"))
        if failed and not truthy(_condition(condition, context)):
            self.results[name] = {"result": "skipped", "outputs": {}}
            self.say(f"== job {name}: skipped (needs {', '.join(failed)}, which did not succeed)")
            return
        if not truthy(_condition(condition, context)):
            self.results[name] = {"result": "skipped", "outputs": {}}
            self.say(f"== job {name}: skipped (if: {job['if']})")
            return
        strategy = interpolate(job.get("strategy", {}), context)
        outcomes, outputs = [], {}
        for matrix in _matrix(strategy.get("matrix")):
            instance = {**context, "matrix": matrix}
            title = interpolate(job.get("name", name), instance) if matrix else name
            ok, outputs = self.run_instance(name, to_string(title), job, instance)
            outcomes.append(ok)
            if not ok and strategy.get("fail-fast", True) is not False:
                break
        self.results[name] = {"result": "success" if all(outcomes) else "failure", "outputs": outputs}

    def run_instance(self, name: str, title: str, job: dict, context: dict) -> tuple[bool, dict]:
        self.say(f"== job {title}")
        home = self.work / "jobs" / f"{name}-{uuid.uuid4().hex[:8]}"
        workspace = home / "workspace"
        (home / "docker").mkdir(parents=True)
        workspace.mkdir()  # a runner's workspace exists before any checkout
        (self.work / "tmp").mkdir(exist_ok=True)
        job_env = {k: to_string(v) for k, v in interpolate(job.get("env", {}), context).items()}
        extra_env: dict[str, str] = {}
        context = {**context, "env": job_env, "steps": {}, "__workspace__": str(workspace)}
        status = "success"
        for index, step in enumerate(job.get("steps", [])):
            label = step.get("name") or step.get("uses") or step.get("run", "").splitlines()[0]
            context["__status__"] = status
            context["env"] = {**job_env, **extra_env}
            condition = with_status(step.get("if", "success()"))  # no status function: success() && (…)
            if not truthy(_condition(condition, context)):
                self.say(f"-- step {label}: skipped (if: {condition})")
                continue
            self.say(f"-- step {label}")
            env = {**context["env"], **{k: to_string(v) for k, v in interpolate(step.get("env", {}), context).items()}}
            try:
                ok, outputs, new_env = self.run_step(step, env, context, workspace, home, index)
            except (WorkflowError, ExpressionError, subprocess.CalledProcessError) as err:
                self.say(f"   error: {err}")
                ok, outputs, new_env = False, {}, {}
            extra_env.update(new_env)
            if "id" in step:
                context["steps"][step["id"]] = {"outputs": outputs, "outcome": "success" if ok else "failure"}
            if not ok:
                status = "failure"
                self.say(f"-- step {label}: failed")
        outputs = {}
        if status == "success":
            outputs = {k: to_string(interpolate(v, context)) for k, v in job.get("outputs", {}).items()}
        self.say(f"== job {title}: {status}")
        return status == "success", outputs

    def run_step(self, step: dict, env: dict[str, str], context: dict, workspace: Path, home: Path,
                 index: int) -> tuple[bool, dict, dict]:
        if "uses" in step:
            return self.run_action(step, context, workspace), {}, {}
        script = interpolate(step["run"], context)
        output_file, env_file = home / f"output-{index}", home / f"env-{index}"
        output_file.touch()
        env_file.touch()
        process_env = {**os.environ, **env,
                       "PATH": f"{self.bin}{os.pathsep}{os.environ.get('PATH', '')}",
                       "CI": "true", "GITHUB_ACTIONS": "true", "GITHUB_WORKSPACE": str(workspace),
                       "GITHUB_OUTPUT": str(output_file), "GITHUB_ENV": str(env_file),
                       "GITHUB_STEP_SUMMARY": str(home / "summary.md"), "RUNNER_TEMP": str(self.work / "tmp"),
                       "GITHUB_EVENT_NAME": self.github["event_name"], "GITHUB_SHA": self.sha,
                       "GITHUB_REF": self.github["ref"], "GITHUB_REPOSITORY": self.github["repository"],
                       "GITHUB_REPOSITORY_OWNER": self.github["repository_owner"],
                       "GITHUB_ACTOR": self.github["actor"], "DOCKER_CONFIG": str(home / "docker")}
        cwd = workspace / step.get("working-directory", ".")
        code = subprocess.run(["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c", script],
                              cwd=cwd, env=process_env).returncode
        if code != 0:
            self.say(f"   exit status {code}")
        return code == 0, _read_outputs(output_file), _read_outputs(env_file)

    def run_action(self, step: dict, context: dict, workspace: Path) -> bool:
        action, _, _version = step["uses"].partition("@")
        with_ = {k: to_string(v) for k, v in interpolate(step.get("with", {}), context).items()}
        if action == "actions/checkout":
            depth = int(with_.get("fetch-depth", "1") or 0)
            workspace.mkdir(parents=True, exist_ok=True)
            _git(workspace, "init", "--quiet")
            fetch = ["fetch", "--quiet", "--no-tags"] + ([f"--depth={depth}"] if depth else [])
            refs = [self.sha] if depth else [self.sha, "+refs/heads/*:refs/remotes/origin/*"]
            _git(workspace, *fetch, f"file://{self.repo}", *refs)
            _git(workspace, "checkout", "--quiet", "-B", self.github["ref"].rsplit("/", 1)[-1] or "main", self.sha)
            self.say(f"   checked out {self.sha[:12]} (depth {depth or 'full'})")
            return True
        if action in SETUP_ONLY:
            self.say(f"   stubbed: {action} only sets up the runner (python is {self.bin / 'python'})")
            return True
        if action == "actions/upload-artifact":
            dest = self.work / "artifacts" / with_["name"]
            for pattern in with_["path"].split():
                for source in workspace.glob(pattern.rstrip("/")):
                    target = dest / source.relative_to(workspace)
                    if source.is_dir():
                        shutil.copytree(source, target, dirs_exist_ok=True)
                    else:
                        target.parent.mkdir(parents=True, exist_ok=True)
                        shutil.copy2(source, target)
            self.say(f"   uploaded {with_['path']} to {dest}")
            return True
        raise WorkflowError(f"uses: {step['uses']}: this runner cannot run that action")


def _needs(job: dict) -> list[str]:
    needs = job.get("needs", [])
    return [needs] if isinstance(needs, str) else list(needs)


def _condition(condition, context: dict):
    if isinstance(condition, bool):
        return condition
    text = str(condition).strip()
    if text.startswith("${{") and text.endswith("}}"):
        text = text[3:-2]
    return evaluate(text, context)


def _matrix(matrix) -> list[dict]:
    """The job instances of a matrix: the product of its axes, then ``include`` entries."""
    if not matrix:
        return [{}]
    axes = {k: v for k, v in matrix.items() if k not in ("include", "exclude")}
    combos = [dict(zip(axes, values, strict=True)) for values in itertools.product(*axes.values())] if axes else []
    excluded = matrix.get("exclude", [])
    combos = [c for c in combos if not any(all(c.get(k) == v for k, v in e.items()) for e in excluded)]
    for entry in matrix.get("include", []):
        matched = [c for c in combos if all(c.get(k) == v for k, v in entry.items() if k in axes)]
        if matched and axes:
            for combo in matched:
                combo.update(entry)
        else:
            combos.append(dict(entry))
    return combos or [{}]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ci/run_workflow.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workflow", default=str(REPO / ".github" / "workflows" / "kiln.yml"))
    parser.add_argument("--repo", default=str(REPO), help="the repository to clone (default: this one)")
    parser.add_argument("--ref", default="HEAD", help="the commit to run on (default: HEAD)")
    parser.add_argument("--git-ref", default="refs/heads/main", help="github.ref (default: %(default)s)")
    parser.add_argument("--event", choices=("push", "pull_request", "workflow_dispatch"), default="push")
    parser.add_argument("--before", help="push: github.event.before (default: 000…, a new branch)")
    parser.add_argument("--base", help="pull_request: the base commit (default: HEAD~1)")
    parser.add_argument("--input", action="append", default=[], metavar="NAME=VALUE", help="workflow_dispatch input")
    parser.add_argument("--var", action="append", default=[], metavar="NAME=VALUE", help="a repository variable")
    parser.add_argument("--secret", action="append", default=[], metavar="NAME=VALUE", help="a repository secret")
    parser.add_argument("--owner", default="kiln-local", help="github.repository_owner (default: %(default)s)")
    parser.add_argument("--skip-job", action="append", default=[], metavar="JOB", help="leave a job out")
    parser.add_argument("--work", help="where the jobs' clones and artifacts go (default: a new temporary directory)")
    args = parser.parse_args(argv)
    try:
        runner = Runner(args)
        print(f"workflow {runner.workflow_path} on {runner.sha[:12]} ({args.event}); work in {runner.work}", flush=True)
        return runner.run()
    except (WorkflowError, ExpressionError, subprocess.CalledProcessError, OSError) as err:
        detail = getattr(err, "stderr", None)
        print(f"error: {err}{': ' + detail.strip() if detail else ''}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
