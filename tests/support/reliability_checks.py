"""What every reliability test checks after a build, with tools independent of kiln's OCI code.

    run_cli(argv) -> CliRun                 kiln's CLI in-process; stdout/stderr captured (fast
                                            command-line checks, a test that replaces a function)
    run_build(argv) -> CliRun               the same in a process of its own (an end-to-end build:
                                            tests/support/kiln_process.py says why)
    tag_state(host, repository, tag, creds=None) -> "absent" | "complete"
        skopeo: no manifest -> "absent"; otherwise ``skopeo copy`` of the whole image must
        succeed (every blob present and matching its digest) -> "complete"; else AssertionError
    assert_cache_verified(cache)            every ``blobs/sha256/<hex>`` file hashes to <hex>, every
                                            ``manifests/sha256-<hex>`` entry's bytes too; no
                                            temporary file left behind
    assert_one_line_error(run, *expected)   exit 2, the last stderr line is ``error: ...`` and
                                            holds every ``expected`` fragment
    layout_refs(layout) -> {ref name: manifest digest}   an OCI layout's index.json entries
    copy_out(layout, ref, work) -> digest   skopeo copies ``ref`` out of the layout whole (every
                                            blob present); the digest of the manifest it read
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kiln import commands
from tests.support.kiln_process import run_kiln

REF_NAME = "org.opencontainers.image.ref.name"


@dataclass
class CliRun:
    code: int
    out: str
    err: str

    @property
    def result(self) -> dict:
        assert self.code == 0, self.err
        return json.loads(self.out)


def run_cli(argv: list[str]) -> CliRun:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = commands.main(argv)
        except SystemExit as usage:  # argparse: a usage error exits 2
            code = usage.code
    return CliRun(code, out.getvalue(), err.getvalue())


def run_build(argv: list[str]) -> CliRun:
    return CliRun(*run_kiln(*argv))


def tag_state(host: str, repository: str, tag: str, creds: str | None = None) -> str:
    flags = ["--tls-verify=false"] + ([f"--creds={creds}"] if creds else [])
    ref = f"docker://{host}/{repository}:{tag}"
    inspected = subprocess.run(["skopeo", "inspect", "--raw", *flags, ref], capture_output=True, text=True)
    if inspected.returncode != 0:
        assert "manifest unknown" in inspected.stderr.lower(), inspected.stderr
        return "absent"
    with tempfile.TemporaryDirectory() as out:
        copied = subprocess.run(["skopeo", "copy", "--quiet", "--src-tls-verify=false",
                                 *(["--src-creds", creds] if creds else []), ref, f"dir:{out}"],
                                capture_output=True, text=True)
        assert copied.returncode == 0, f"{ref} names an incomplete image: {copied.stderr}"
    return "complete"


def assert_cache_verified(cache: Path) -> None:
    for kind in ("blobs", "manifests"):
        leftovers = [p.name for p in (cache / kind).rglob(".tmp*")] if (cache / kind).exists() else []
        assert leftovers == [], f"temporary files left in the {kind} cache: {leftovers}"
    blobs = cache / "blobs" / "sha256"
    for path in blobs.iterdir() if blobs.is_dir() else ():
        assert hashlib.sha256(path.read_bytes()).hexdigest() == path.name, f"corrupted cache entry {path}"
    manifests = cache / "manifests"
    for path in manifests.iterdir() if manifests.is_dir() else ():
        data = path.read_bytes().partition(b"\n")[2]  # "<media type>\n<manifest bytes>"
        assert "sha256-" + hashlib.sha256(data).hexdigest() == path.name, f"corrupted manifest entry {path}"


def assert_one_line_error(run: CliRun, *expected: str) -> str:
    assert run.code == 2, (run.code, run.err)
    lines = [line for line in run.err.splitlines() if line.strip()]
    assert lines and lines[-1].startswith("error: "), run.err
    assert "Traceback" not in run.err, run.err
    print(f"kiln said: {lines[-1]}")  # shown with -s / on failure: the rows of docs/RELIABILITY.md quote it
    for fragment in expected:
        assert fragment in lines[-1], (fragment, lines[-1])
    return lines[-1]


def layout_refs(layout: Path) -> dict[str, str]:
    index = json.loads((layout / "index.json").read_text())
    return {(m.get("annotations") or {}).get(REF_NAME, ""): m["digest"] for m in index["manifests"]
            if "artifactType" not in m}  # attestations have no name


def copy_out(layout: Path, ref: str, work: Path) -> str:
    target = Path(tempfile.mkdtemp(dir=work, prefix="copied-"))
    result = subprocess.run(["skopeo", "copy", "--quiet", f"oci:{layout}:{ref}", f"dir:{target}"],
                            capture_output=True, text=True)
    assert result.returncode == 0, f"oci:{layout}:{ref} is not complete: {result.stderr}"
    manifest = subprocess.run(["skopeo", "inspect", "--raw", f"oci:{layout}:{ref}"], capture_output=True, check=True)
    return "sha256:" + hashlib.sha256(manifest.stdout).hexdigest()
