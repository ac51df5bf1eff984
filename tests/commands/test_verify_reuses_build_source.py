"""``verify --pin`` after a ``build`` of the pin reads the source the build read (kiln's cache:
the tree from the base's vLLM layers, recorded by the image's digest), not the release wheel
fetched again: the same files the build patched, nothing downloaded."""

from __future__ import annotations

import json

import pytest

from kiln import commands
from kiln.source.wheel import WheelSource
from tests.support import TEST_IMAGES
from tests.support.registry import VLLM_VERSION

pytestmark = pytest.mark.registry


def _main(capsys, *argv) -> tuple[int, str, str]:
    capsys.readouterr()
    code = commands.main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_verify_pin_after_a_build_fetches_nothing(tmp_path, capsys, registry_plain, monkeypatch):
    digest = registry_plain.digest_of(f"vllm/vllm-openai:v{VLLM_VERSION}")
    pins = tmp_path / "pins.toml"
    pins.write_text(f'[pins."v0.20.1"]\nrole = "current"\nimage = "docker.io/vllm/vllm-openai:v{VLLM_VERSION}"\n'
                    f'vllm = "{VLLM_VERSION}"\ncuda = "cu130"\ndigest = "{digest}"\n')
    fetched: list[str] = []

    def no_wheel(self):
        fetched.append(str(self.version))
        raise AssertionError(f"fetched the vllm {self.version} wheel again")

    monkeypatch.setattr(WheelSource, "fetch", no_wheel)
    # before any build, verify needs the release wheel (the spy stands in for PyPI)
    with pytest.raises(AssertionError, match="fetched the vllm 0.20.1 wheel again"):
        _main(capsys, "--pins", pins, "verify", "--pin", "v0.20.1", "--json")
    assert fetched == ["0.20.1"]

    code, out, err = _main(capsys, "--pins", pins, "--images", TEST_IMAGES, "build", "--image", "e2e-p65",
                           "--pin", "v0.20.1", "--sm", "120", "--mirror", registry_plain.mirror,
                           "--oci", tmp_path / "out", "--json")
    assert code == 0, err

    code, out, err = _main(capsys, "--pins", pins, "verify", "--pin", "v0.20.1", "--json")
    assert fetched == ["0.20.1"], "verify fetched the source again"
    data = json.loads(out)
    assert data["origin"].startswith("image ") and "layers read" in data["origin"], data["origin"]
    assert code == 0, (err, data["differences"])  # the build's files give the recorded verdicts
