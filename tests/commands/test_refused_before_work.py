"""What is refused before the first network request: hostile pin names, unwritable or clashing
output paths, a bad ``--sm``. Each: exit 2, one ``error:`` line naming the option or file, the
field and the value, no traceback; no request reached the registry (a ``FaultProxy`` stands in
for Docker Hub and counts what it is sent), nothing written, not even the cache directory.
"""

from __future__ import annotations

import pytest

from kiln.commands import main
from tests.support import TEST_IMAGES
from tests.support.reliability_checks import CliRun, assert_one_line_error, run_cli

pytestmark = [pytest.mark.reliability, pytest.mark.isolated]

DIGEST = "sha256:" + "ab" * 32


def _pins(name: str = "v0.20.1") -> str:
    return (f'[pins."{name}"]\nrole = "current"\nimage = "docker.io/vllm/vllm-openai:v0.20.1"\n'
            f'vllm = "0.20.1"\ncuda = "cu130"\ndigest = "{DIGEST}"\n')


@pytest.fixture
def workspace(tmp_path, monkeypatch):
    root = tmp_path / "ws"
    root.mkdir()
    (root / "pins.toml").write_text(_pins())
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))
    return root


def _build(workspace, hub, *extra: str, pin: str = "v0.20.1", sm: str = "120") -> CliRun:
    return run_cli(["--pins", str(workspace / "pins.toml"), "--images", str(TEST_IMAGES), "build",
                    "--image", "e2e-p65", "--pin", pin, "--sm", sm, "--mirror", hub.mirror, *extra])


def _refused(run: CliRun, workspace, hub, before: set, *expected: str) -> str:
    line = assert_one_line_error(run, *expected)
    assert hub.requests() == [], [s.path for s in hub.requests()]
    assert not (workspace.parent / "cache").exists()  # not even the cache directory
    assert {p for p in workspace.parent.rglob("*")} == before
    return line


def _snapshot(workspace) -> set:
    return set(workspace.parent.rglob("*"))


@pytest.mark.parametrize("name", ["../../evil", "v0.20.1 x;$(id)", ".hidden", "a" * 129])
def test_hostile_pin_name_is_refused_at_load(workspace, hub, name):
    pins = workspace / "pins.toml"
    pins.write_text(_pins(name))
    before = _snapshot(workspace)
    run = _build(workspace, hub, "--oci", str(workspace / "out"), "--push", "--repository",
                 f"{hub.host}/test/evil", pin=name)
    line = _refused(run, workspace, hub, before, str(pins), "pins", f"pin name {name!r}", "not a valid OCI tag")
    assert line.startswith(f"error: {pins}: pins: ")


OUTPUT_CASES = {
    "--oci in /proc": (["--oci", "/proc/kiln-oci"], ("--oci /proc/kiln-oci", "cannot write in /proc")),
    "--oci below a file": (["--oci", "/etc/passwd/oci"], ("--oci /etc/passwd/oci", "/etc/passwd is not a directory")),
    "--docker-archive in /proc": (["--docker-archive", "/proc/kiln.tar"],
                                  ("--docker-archive /proc/kiln.tar", "cannot write in /proc")),
    "--values in /proc": (["--values", "/proc/kiln-values.json"],
                          ("--values /proc/kiln-values.json", "cannot write in /proc")),
    "--docker-archive is a directory": (["--docker-archive", "{ws}"], ("--docker-archive {ws}", "is a directory")),
    "--oci and --docker-archive on one path": (
        ["--oci", "{ws}/same", "--docker-archive", "{ws}/same", "--push"],
        ("--oci {ws}/same and --docker-archive {ws}/same", "cannot write the same place")),
    "--docker-archive inside --oci": (
        ["--oci", "{ws}/out", "--docker-archive", "{ws}/out/image.tar", "--push"],
        ("--oci {ws}/out and --docker-archive {ws}/out/image.tar", "cannot write the same place")),
    "--values spelled differently, same file as --docker-archive": (
        ["--docker-archive", "{ws}/a.tar", "--values", "{ws}/./sub/../a.tar"],
        ("--docker-archive {ws}/a.tar and --values {ws}/a.tar", "cannot write the same place")),
}


@pytest.mark.parametrize("case", sorted(OUTPUT_CASES))
def test_unwritable_or_clashing_outputs_are_refused_before_the_pull(workspace, hub, case):
    argv, expected = OUTPUT_CASES[case]
    argv = [a.format(ws=workspace) for a in argv]
    if "--push" in argv:
        argv += ["--repository", f"{hub.host}/test/clash", "--insecure-registry", hub.host]
    before = _snapshot(workspace)
    run = _build(workspace, hub, *argv)
    _refused(run, workspace, hub, before, *(e.format(ws=workspace) for e in expected))


def test_a_file_that_is_not_a_docker_archive_is_not_replaced_even_with_force(workspace, hub):
    target = workspace / "notes.txt"
    target.write_text("not an image\n")
    before = _snapshot(workspace)
    run = _build(workspace, hub, "--docker-archive", str(target), "--force")
    _refused(run, workspace, hub, before, f"--docker-archive {target}", "not a tar archive")
    assert target.read_text() == "not an image\n"


def test_an_existing_docker_archive_needs_force(workspace, hub):
    target = workspace / "image.tar"
    target.write_bytes(b"\0" * 1024)  # an empty tar archive
    before = _snapshot(workspace)
    run = _build(workspace, hub, "--docker-archive", str(target))
    _refused(run, workspace, hub, before, f"--docker-archive {target}", "already exists", "--force")


@pytest.mark.parametrize("sm", ["abc", "sm_42", "1e3"])
def test_bad_sm_is_a_one_line_usage_error(workspace, hub, sm):
    before = _snapshot(workspace)
    run = _build(workspace, hub, "--oci", str(workspace / "out"), sm=sm)
    _refused(run, workspace, hub, before, "argument --sm", sm)


def test_apply_with_an_unknown_patch_creates_no_cache(workspace, tmp_path):
    run = run_cli(["apply", "--vllm", "0.33.0", "--patch", "P999", "--out", str(tmp_path / "tree")])
    assert_one_line_error(run, "unknown patch 'P999'")
    assert not (tmp_path / "cache").exists() and not (tmp_path / "tree").exists()


@pytest.mark.parametrize("command, names", [
    (["build"], ("layer_bytes", "build_bytes", "layers", "deadline", "stall_warning", "connect_timeout", "read_timeout")),
    (["context"], ("layer_bytes", "build_bytes", "layers", "deadline", "stall_warning", "connect_timeout", "read_timeout")),
    (["values"], ("connect_timeout", "read_timeout")),
    (["pin", "lock"], ("connect_timeout", "read_timeout")),
    (["pin", "bump"], ("connect_timeout", "read_timeout")),
])
def test_limits_are_listed_in_help_with_their_variables(capsys, command, names):
    from kiln.oci.limits import KNOBS

    with pytest.raises(SystemExit):
        main([*command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for name in names:
        assert KNOBS[name].option in text and f"${KNOBS[name].env}" in text, name


def test_a_connect_timeout_names_its_limit():
    import requests

    from kiln.oci.failures import connection_problem
    from kiln.oci.limits import Limits

    text = connection_problem("registry.example:443", requests.exceptions.ConnectTimeout("timed out"),
                              Limits(connect_timeout=7))
    assert text == ("unreachable (no connection within the connect timeout of 7 s; raise it with "
                    "--connect-timeout or KILN_REGISTRY_CONNECT_TIMEOUT)")
