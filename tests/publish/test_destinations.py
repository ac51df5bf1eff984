"""No output of kiln's ever lands on, in or around an input it reads, on a special file, or
inside another OCI layout: each refused before the first request (``kiln.publish.destinations``).

Each case: exit 2, one ``error:`` line naming the option, the path and the input; no request
reached Docker Hub; nothing under the test's directory created, changed or removed (the pins
file and definitions keep their bytes, the cache directory is not created).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kiln import paths
from tests.support.refusals import assert_refused, build, snapshot

pytestmark = [pytest.mark.reliability, pytest.mark.isolated]


def _layout(root: Path) -> Path:
    """A minimal OCI layout (no images): what skopeo writes for an empty one."""
    root.mkdir()
    (root / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    (root / "index.json").write_text('{"schemaVersion": 2, "manifests": []}')
    (root / "blobs" / "sha256").mkdir(parents=True)
    return root


def _cases(ws: Path, tmp: Path) -> dict[str, tuple[list[str], tuple[str, ...]]]:
    cache, registries, auth = tmp / "kiln-cache", tmp / "registries.toml", tmp / "docker-config" / "config.json"
    return {
        "--values the pins file, relative": (["--values", "pins.toml"],
                                             ("--values pins.toml", "is kiln's pins file (an input)")),
        "--values an image definition": (["--values", "defs/e2e-p65.toml"],
                                         ("--values defs/e2e-p65.toml", "is an image definition (an input)")),
        "--values a symlink to the pins file": (["--values", "link.json"],
                                                ("--values link.json", "is kiln's pins file")),
        "--docker-archive a hard link to the pins file, --force": (
            ["--docker-archive", "hard.tar", "--force"], ("--docker-archive hard.tar", "is kiln's pins file")),
        "--values another layout's index.json": (
            ["--values", "other/index.json"], ("--values other/index.json", f"inside the OCI layout {ws}/other")),
        "--oci inside another layout": (["--oci", "other/nested"], ("--oci other/nested", "inside the OCI layout")),
        "--oci inside the definitions directory": (
            ["--oci", "defs/out"], ("--oci defs/out", f"is inside the image definitions directory {ws}/defs (an input)")),
        "--values the registries file": (["--values", str(registries)], ("is the registries file (an input)",)),
        "--values the registries file given by --registries": (
            ["--values", "regs.toml", "--registries", f"{ws}/regs.toml"], ("--values regs.toml", "registries file")),
        "--docker-archive containers' registries.conf, --force": (  # $CONTAINERS_REGISTRIES_CONF (isolating fixture)
            ["--docker-archive", os.environ.get("CONTAINERS_REGISTRIES_CONF", ""), "--force"],
            ("is containers' registries.conf (an input)",)),
        "--values the registry auth file": (["--values", str(auth)], ("is the registry auth file (an input)",)),
        "--oci inside the cache": (["--oci", f"{cache}/layout"], (f"is inside kiln's cache {cache} (an input)",)),
        "--oci around the cache": (["--oci", str(tmp)], (f"--oci {tmp}: would hold",)),
        "--oci inside kiln's own code": (["--oci", str(paths.REPO / "kiln" / "kiln-layout")],
                                         (f"is inside kiln's own code {paths.REPO / 'kiln'} (an input)",)),
        "--values kiln's own Dockerfile": (["--values", str(paths.REPO / "Dockerfile")],
                                           ("is kiln's own Dockerfile (an input)",)),
        "--docker-archive /dev/full --force": (["--docker-archive", "/dev/full", "--force"],
                                               ("--docker-archive /dev/full: is a character device",
                                                "not a regular file")),
        "--values a FIFO": (["--values", "fifo"], ("--values fifo: is a FIFO, not a regular file",)),
        "--docker-archive a FIFO, --force": (["--docker-archive", "fifo", "--force"], ("is a FIFO",)),
    }


def _prepare(ws: Path) -> None:
    (ws / "link.json").symlink_to("pins.toml")
    os.link(ws / "pins.toml", ws / "hard.tar")
    _layout(ws / "other")
    os.mkfifo(ws / "fifo")


CASES = sorted(_cases(Path("/ws"), Path("/tmp")))


@pytest.mark.parametrize("case", CASES)
def test_an_output_that_touches_an_input_is_refused_before_any_work(workspace, hub, tmp_path, case):
    """In a subprocess for the special files (today they hang: ``/dev/full`` read forever, a
    FIFO opened with no writer); in-process otherwise."""
    _prepare(workspace)
    argv, expected = _cases(workspace, tmp_path)[case]
    before = snapshot(tmp_path)
    if "/dev/full" in argv or "fifo" in argv:
        run = _build_in_a_process(workspace, hub, argv)
    else:
        run = build(workspace, hub, *argv)
    line = assert_refused(run, hub, tmp_path, before, *expected)
    assert "choose another path" in line or "not a regular file" in line


def _build_in_a_process(workspace: Path, hub, argv: list[str]):
    from tests.support.reliability_checks import CliRun

    command = [sys.executable, str(paths.REPO / "build.py"), "--pins", str(workspace / "pins.toml"), "--images",
               str(workspace / "defs"), "build", "--image", "e2e-p65", "--pin", "v0.20.1", "--sm", "120",
               "--mirror", hub.mirror, *argv]
    try:
        done = subprocess.run(command, cwd=workspace, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{' '.join(argv)}: still running after 60 s (reading a special file?)")
    return CliRun(done.returncode, done.stdout, done.stderr)


@pytest.mark.parametrize("redirect", [">>", ">"])
def test_standard_output_redirected_onto_the_pins_file_is_refused(workspace, redirect):
    """``pin list --json >> pins.toml`` used to append JSON to the pins file; with ``>`` the
    shell has emptied it before kiln starts, and the error says so."""
    pins = workspace / "pins.toml"
    original = pins.read_bytes()
    command = f"{sys.executable} {paths.REPO / 'build.py'} --pins pins.toml pin list --json {redirect} pins.toml"
    done = subprocess.run(["sh", "-c", command], cwd=workspace, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: standard output {pins}: is kiln's pins file"), lines
    if redirect == ">>":
        assert pins.read_bytes() == original
    else:
        assert pins.read_bytes() == b"" and "it is empty now: a '>' redirection empties the file" in lines[0]


def test_patches_doc_onto_the_pins_file_is_refused(workspace):
    from tests.support.reliability_checks import assert_one_line_error, run_cli

    pins = workspace / "pins.toml"
    original = pins.read_bytes()
    run = run_cli(["--pins", str(pins), "patches", "--doc", str(pins)])
    assert_one_line_error(run, f"--doc {pins}: is kiln's pins file (an input)")
    assert pins.read_bytes() == original


def test_apply_out_inside_the_patch_catalogue_is_refused(tmp_path):
    from tests.support.reliability_checks import assert_one_line_error, run_cli

    out = paths.PATCHSETS / "kiln-test-tree"
    run = run_cli(["apply", "--vllm", "0.33.0", "--patch", "P999", "--out", str(out)])
    assert_one_line_error(run, f"--out {out}: is inside the patch catalogue {paths.PATCHSETS} (an input)")
    assert not out.exists() and not (tmp_path / "kiln-cache").exists()


def test_context_out_inside_the_definitions_directory_is_refused(workspace, hub, tmp_path):
    from tests.support.reliability_checks import run_cli

    before = snapshot(tmp_path)
    run = run_cli(["--pins", str(workspace / "pins.toml"), "--images", str(workspace / "defs"), "context",
                   "--image", "e2e-p65", "--pin", "v0.20.1", "--sm", "120", "--mirror", hub.mirror,
                   "--out", "defs/context"])
    assert_refused(run, hub, tmp_path, before, "--out defs/context: is inside the image definitions directory")


def test_a_layout_index_with_a_foreign_entry_is_left_as_it_was(workspace, hub, tmp_path):
    """The refusal of ``--values other/index.json`` leaves the other layout's index as it was
    (it used to be replaced by Helm values: the layout lost its images)."""
    layout = _layout(workspace / "other")
    index = {"schemaVersion": 2, "manifests": [{"mediaType": "application/vnd.oci.image.manifest.v1+json",
                                                "digest": "sha256:" + "cd" * 32, "size": 3,
                                                "annotations": {"org.opencontainers.image.ref.name": "keep"}}]}
    (layout / "index.json").write_text(json.dumps(index))
    before = snapshot(tmp_path)
    run = build(workspace, hub, "--values", str(layout / "index.json"))
    assert_refused(run, hub, tmp_path, before, "inside the OCI layout")
    assert json.loads((layout / "index.json").read_text()) == index
