"""Local outputs follow the umask, as any file a user writes: not private to the builder.

A user saw the OCI layout created 0700 and the docker-archive 0600 (staged with
``mkdtemp``/``mkstemp``), so another account (a CI runner, ``skopeo`` under sudo) could not
read them. Built for real (e2e-p65 against the fixture registry) under two umasks.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

from kiln import paths
from tests.support import TEST_IMAGES
from tests.support.registry import VLLM_VERSION

pytestmark = pytest.mark.registry


@pytest.mark.parametrize(("umask", "directory", "file"), [(0o022, 0o755, 0o644), (0o027, 0o750, 0o640)])
def test_layout_and_archive_modes_follow_the_umask(tmp_path, registry_plain, umask, directory, file):
    name = f"vllm/vllm-openai:v{VLLM_VERSION}"
    pins = tmp_path / "pins.toml"
    pins.write_text(f'[pins."v{VLLM_VERSION}"]\nrole = "current"\nimage = "docker.io/{name}"\n'
                    f'vllm = "{VLLM_VERSION}"\ncuda = "cu130"\ndigest = "{registry_plain.digest_of(name)}"\n')
    layout, archive = tmp_path / "out" / "layout", tmp_path / "out" / "image.tar"
    done = subprocess.run(
        [sys.executable, str(paths.REPO / "build.py"), "--pins", str(pins), "--images", str(TEST_IMAGES), "build",
         "--image", "e2e-p65", "--pin", f"v{VLLM_VERSION}", "--sm", "120", "--mirror", registry_plain.mirror,
         "--oci", str(layout), "--docker-archive", str(archive)],
        env=os.environ.copy(), capture_output=True, text=True, timeout=600, preexec_fn=lambda: os.umask(umask))
    assert done.returncode == 0, done.stderr[-2000:]

    def mode(path) -> int:
        return stat.S_IMODE(path.stat().st_mode)

    assert mode(layout) == directory and mode(layout / "blobs") == directory
    assert mode(layout / "blobs" / "sha256") == directory
    assert {mode(p) for p in (layout / "blobs" / "sha256").iterdir()} == {file}
    assert mode(layout / "index.json") == file and mode(layout / "oci-layout") == file
    assert mode(archive) == file
