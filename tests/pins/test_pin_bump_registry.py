"""``build.py pin bump --to IMAGE`` against a real docker-registry standing in for Docker Hub.

The candidate is the fixture base plus one layer, built with umoci and pushed with skopeo as
``vllm/vllm-openai:v0.20.2``: the layer whites out ``tool_parsers/qwen3coder_tool_parser.py`` (P64's
target, and P61c's), and the image still carries vLLM 0.20.1 in its dist-info, so the bump must read the
version from the image, not from the tag. Both pins' sources are read from the images
(``ImageSource``), the candidate's digest is locked as skopeo sees it.
"""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path

import pytest

from kiln import commands
from tests.support import TEST_IMAGES
from tests.support.registry import REPO, SITE, VLLM_VERSION, free_port, run

pytestmark = pytest.mark.registry

IMAGES = TEST_IMAGES
CANDIDATE = f"{REPO}:v0.20.2"
GONE = "tool_parsers/qwen3coder_tool_parser.py"

PINS_TEXT = f"""\
# kiln pins for the bump test
[pins."v0.20.1"]
role = "current"
image = "docker.io/{REPO}:v{VLLM_VERSION}"
vllm = "{VLLM_VERSION}"
cuda = "cu130"
digest = ""
"""


@pytest.fixture(scope="module")
def candidate(tmp_path_factory, base_layout, registry_plain) -> str:
    """Push the candidate image; return its digest as skopeo sees it."""
    work = tmp_path_factory.mktemp("bump-candidate")
    layout = work / "layout"
    (layout / "blobs/sha256").mkdir(parents=True)
    for name in ("index.json", "oci-layout"):
        (layout / name).write_bytes((base_layout.path / name).read_bytes())
    for blob in (base_layout.path / "blobs/sha256").iterdir():
        os.link(blob, layout / "blobs/sha256" / blob.name)  # blobs are immutable: share them
    whiteout = work / "tree" / SITE / "vllm" / Path(GONE).parent / f".wh.{Path(GONE).name}"
    whiteout.parent.mkdir(parents=True)
    whiteout.write_bytes(b"")
    run("tar", "--sort=name", "--owner=0", "--group=0", "--numeric-owner", "--format=pax",
        "--mtime=2024-01-01T00:00:00Z", "-C", work / "tree", "-cf", work / "drift.tar", ".")
    run("umoci", "raw", "add-layer", "--image", f"{layout}:base", "--tag", "drift",
        "--history.created_by", "fixture: P64's target removed", work / "drift.tar")
    registry_plain.push(f"oci:{layout}:drift", CANDIDATE)
    return registry_plain.digest_of(CANDIDATE)


def bump(capsys, pins: Path, record: Path, *extra: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = commands.main([str(a) for a in ("--pins", pins, "--record", record, "--images", IMAGES, "pin", "bump", *extra)])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture
def files(tmp_path) -> tuple[Path, Path]:
    pins, record = tmp_path / "pins.toml", tmp_path / "verdicts.toml"
    pins.write_text(PINS_TEXT)
    record.write_text('# the record\n\n["v0.20.1"]\nP65 = "APPLIES"\n')
    return pins, record


def test_bump_to_image_locks_digest_and_reads_version_from_image(capsys, files, registry_plain, candidate):
    pins, record = files
    code, out, err = bump(capsys, pins, record, "--to", f"docker.io/{CANDIDATE}", "--mirror", registry_plain.mirror,
                          "--write", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["to"]["name"] == "v0.20.2"  # the tag names the pin
    assert report["to"]["vllm"] == VLLM_VERSION  # the version comes from the image's dist-info
    assert report["to"]["digest"] == candidate
    # both sides read from the images (the candidate: its new layer, the app layer, the vLLM layer)
    assert report["from"]["source"].startswith(f"image docker.io/{REPO}:v{VLLM_VERSION}@sha256:")
    assert report["to"]["source"].startswith(f"image docker.io/{CANDIDATE}@{candidate} (3 of 6 layers read)")
    new = {row["patch"]: row["new"] for row in report["patches"]}
    old = {row["patch"]: row["old"] for row in report["patches"]}
    # the removed file is the only difference between the two images: both its patches lose it
    for pid in ("P61c", "P64"):
        assert old[pid] == "APPLIES" and new.pop(pid) == "TARGET_GONE"
    assert new == {pid: verdict for pid, verdict in old.items() if pid not in ("P61c", "P64")}
    assert old["P65"] == "APPLIES"
    assert report["reanchor"] == ["P61c", "P64"] and report["retire"] == []
    assert report["ok"] is True and report["written"] is True and report["forced"] == []
    image = next(i for i in report["images"] if i["image"] == "e2e-p65")
    assert image["broken"] == [] and image["builds_on_candidate"] is False

    data = tomllib.loads(pins.read_text())["pins"]
    assert data == {
        "v0.20.2": {"role": "current", "image": f"docker.io/{CANDIDATE}", "vllm": VLLM_VERSION, "cuda": "cu130",
                    "digest": candidate},
        "v0.20.1": {"role": "rollback", "image": f"docker.io/{REPO}:v{VLLM_VERSION}", "vllm": VLLM_VERSION,
                    "cuda": "cu130", "digest": ""},
    }
    assert pins.read_text().startswith("# kiln pins for the bump test\n")
    recorded = tomllib.loads(record.read_text())
    assert recorded["v0.20.2"] == {row["patch"]: row["new"] for row in report["patches"]}
    assert recorded["v0.20.1"] == {"P65": "APPLIES"}

    # the digest is the one `pin lock` would write: locking again keeps it and only adds the
    # platforms (bump writes a digest alone, a lock from before pins recorded platforms); then
    # a lock changes nothing
    for status in ("completed", "unchanged"):
        capsys.readouterr()
        assert commands.main(["--pins", str(pins), "pin", "lock", "v0.20.2", "--mirror", registry_plain.mirror,
                              "--json"]) == 0
        locked = json.loads(capsys.readouterr().out)["pins"][0]
        assert (locked["status"], locked["digest"], locked["previous"]) == (status, candidate, candidate)
    assert tomllib.loads(pins.read_text())["pins"]["v0.20.2"]["platforms"] == {"linux/amd64": candidate}


@pytest.mark.parametrize(("target", "mirror", "expected"), [
    (f"docker.io/{CANDIDATE}", "closed", "unreachable"),
    (f"docker.io/{REPO}:v9.9.9", "plain", "not found"),
])
def test_unreachable_or_missing_image(capsys, files, registry_plain, candidate, target, mirror, expected):
    pins, record = files
    before = pins.read_bytes(), record.read_bytes()
    option = registry_plain.mirror if mirror == "plain" else f"docker.io=http://127.0.0.1:{free_port()}"
    code, _, err = bump(capsys, pins, record, "--to", target, "--mirror", option, "--write", "--force")
    assert code == 2
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: --to {target}:") and expected in lines[0], err
    assert (pins.read_bytes(), record.read_bytes()) == before
    assert sorted(p.name for p in pins.parent.iterdir() if p.name.startswith(".")) == []
