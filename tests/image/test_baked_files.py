"""``[[files]]``: a build puts each baked file in kiln's layer at its path, records its sha256 in
the audit file, and the image stays reproducible; the Dockerfile context carries the same file.

Same fixture base and registry as ``test_build_e2e.py`` (one P65 build on the vLLM-shaped image).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tarfile

import pytest

from tests.image.test_build_e2e import IMAGE, SM, Project
from tests.support import TEST_IMAGES
from tests.support.kiln_process import run_kiln
from tests.support.registry import VLLM_VERSION

pytestmark = pytest.mark.registry

TEMPLATE = "{#- a chat template baked by the build test -#}\n{{ messages[0].content }}\n"
IMAGE_PATH = "/opt/kiln/chat-templates/test.jinja"


@pytest.fixture
def project(tmp_path, registry_plain) -> Project:
    return Project(tmp_path, registry_plain, registry_plain.digest_of(f"vllm/vllm-openai:v{VLLM_VERSION}"))


@pytest.fixture
def images(tmp_path):
    """The build tests' e2e-p65 definition, baking one file and serving with it."""
    directory = tmp_path / "images"
    (directory / "files").mkdir(parents=True)
    (directory / "files" / "chat.jinja").write_text(TEMPLATE)
    definition = (TEST_IMAGES / f"{IMAGE}.toml").read_text()
    definition += (f'\n[[files]]\nsource = "files/chat.jinja"\npath = "{IMAGE_PATH}"\n'
                   f'\n[serve]\nargs = ["--chat-template", "{IMAGE_PATH}"]\n')
    (directory / f"{IMAGE}.toml").write_text(definition)
    return directory


def _build(project: Project, capsys, images, *extra: str, command: str = "build") -> dict:
    argv = ["--pins", str(project.pins()), "--images", str(images), command, "--image", IMAGE, "--pin", "v0.20.1",
            "--sm", str(SM), "--mirror", project.registry.mirror, "--json", *extra]
    code, out, err = run_kiln(*argv)
    assert code == 0, err
    return json.loads(out)


def test_baked_file_is_in_the_layer_recorded_and_reproducible(project, capsys, tmp_path, images, base_layout):
    first = _build(project, capsys, images, "--oci", str(tmp_path / "one"))
    with tarfile.open(tmp_path / "one" / "blobs/sha256" / first["layer_digest"].split(":")[1], "r:gz") as tar:
        member = tar.getmember(IMAGE_PATH.lstrip("/"))
        baked = tar.extractfile(member).read()
        audit = json.loads(tar.extractfile("opt/kiln/manifest.json").read())
    assert baked == TEMPLATE.encode()
    assert (member.mode, member.uid, member.gid) == (0o644, 0, 0)
    assert audit["baked"] == {IMAGE_PATH: {"source": "images/files/chat.jinja",
                                           "sha256": hashlib.sha256(TEMPLATE.encode()).hexdigest()}}

    # the same inputs give the same image, with a cold cache too
    shutil.rmtree(tmp_path / "kiln-cache", ignore_errors=True)
    second = _build(project, capsys, images, "--oci", str(tmp_path / "two"))
    assert second["manifest_digest"] == first["manifest_digest"]

    # a changed template is a changed image
    (images / "files" / "chat.jinja").write_text(TEMPLATE + "{# edited #}\n")
    third = _build(project, capsys, images, "--oci", str(tmp_path / "three"))
    assert third["layer_digest"] != first["layer_digest"]

    # the Dockerfile context is written from the same layer contents
    _build(project, capsys, images, "--out", str(tmp_path / "ctx"), command="context")
    assert (tmp_path / "ctx" / "rootfs" / IMAGE_PATH.lstrip("/")).read_text() == TEMPLATE + "{# edited #}\n"
