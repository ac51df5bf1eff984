"""``build`` pieces that need no registry: lock policy, CUDA flavour, argument errors."""

from __future__ import annotations

import pytest
from packaging.version import Version

from kiln import commands
from kiln.errors import KilnError
from kiln.image.prepare import check_lock
from kiln.pins import Pin
from tests.support import TEST_IMAGES

IMAGES = ["--images", str(TEST_IMAGES)]
DIGEST = "sha256:" + "a" * 64
OTHER = "sha256:" + "b" * 64


def _pin(digest: str = DIGEST, cuda: str = "cu130") -> Pin:
    return Pin("v0.20.1", "current", "docker.io/vllm/vllm-openai:v0.20.1", Version("0.20.1"), cuda, digest)


def test_lock_policy():
    check_lock(_pin(), DIGEST, allow_unlocked=False)  # locked and matching
    with pytest.raises(KilnError, match=r"not locked .* pin lock v0.20.1.*--allow-unlocked"):
        check_lock(_pin(""), DIGEST, allow_unlocked=False)
    with pytest.raises(KilnError, match=f"locked to {DIGEST} but .* now resolves to {OTHER}"):
        check_lock(_pin(), OTHER, allow_unlocked=False)
    check_lock(_pin(""), DIGEST, allow_unlocked=True)
    check_lock(_pin(), OTHER, allow_unlocked=True)


def test_sm_outside_the_image_is_refused(capsys):
    code = commands.main([*IMAGES, "build", "--image", "e2e-p65", "--pin", "v0.20.1", "--sm", "75", "--oci", "/nonexistent/x"])
    assert code == 2
    assert "sm 75 is not one of the image's sms" in capsys.readouterr().err


def test_unknown_image_and_pin(capsys):
    assert commands.main([*IMAGES, "build", "--image", "nope", "--pin", "v0.20.1", "--sm", "120"]) == 2
    assert "unknown image 'nope'" in capsys.readouterr().err
    assert commands.main([*IMAGES, "build", "--image", "e2e-p65", "--pin", "v9", "--sm", "120"]) == 2
    assert "unknown pin 'v9'" in capsys.readouterr().err
