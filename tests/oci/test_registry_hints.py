"""A failed registry contact says what is wrong in a way that works when followed.

A user wrote ``--mirror docker.io=127.0.0.1:5055`` for a plain-HTTP registry and was told to
pass ``--insecure-registry https://127.0.0.1:5055``, which did not help. These tests follow
the hint the error gives, literally, and check the command then works; and an unresolvable
host is named as a DNS failure.
"""

from __future__ import annotations

import re
import shlex

import pytest

from tests.support.cli import run
from tests.support.registry import VLLM_VERSION

pytestmark = pytest.mark.registry

PIN = f"v{VLLM_VERSION}"


def _pins(tmp_path, registry=None):
    path = tmp_path / "pins.toml"
    digest = f'digest = "{registry.digest_of(f"vllm/vllm-openai:{PIN}")}"\n' if registry else ""
    path.write_text(f'[pins."{PIN}"]\nrole = "current"\nimage = "docker.io/vllm/vllm-openai:{PIN}"\n'
                    f'vllm = "{VLLM_VERSION}"\ncuda = "cu130"\n{digest}')
    return path


def lock_failure(code: int, out: str, err: str) -> str:
    """``pin lock`` of the one pin failed: exit 1, the stderr summary, the reason in the pin's row
    (a failed pin is reported in its row like the others, and the others are still locked)."""
    assert code == 1, err
    assert "1 of 1 pins not locked" in err, err
    [row] = [line for line in out.splitlines() if line.strip().startswith("failed")]
    return " ".join(row.split())


def test_plain_http_mirror_hint_works_when_followed(tmp_path, capsys, registry_plain):
    pins = _pins(tmp_path)
    argv = ["--pins", pins, "pin", "lock", "--mirror", f"docker.io={registry_plain.host}"]  # no http://
    code, out, err = run(capsys, *argv)
    line = lock_failure(code, out, err)
    assert "plain HTTP" in line
    hint = re.search(r"--insecure-registry (\S+)", line)
    assert hint and hint.group(1) == registry_plain.host, line  # not https://HOST: that is for TLS
    code, out, err = run(capsys, *argv, *shlex.split(hint.group(0)))
    assert code == 0, err
    assert registry_plain.digest_of(f"vllm/vllm-openai:{PIN}") in pins.read_text()


def test_the_alternative_hint_works_too(tmp_path, capsys, registry_plain):
    pins = _pins(tmp_path)
    code, out, err = run(capsys, "--pins", pins, "pin", "lock", "--mirror", f"docker.io={registry_plain.host}")
    alternative = re.search(r"write the mirror as (http://\S+?)\)", lock_failure(code, out, err))
    assert alternative, err
    code, _, err = run(capsys, "--pins", pins, "pin", "lock", "--mirror", f"docker.io={alternative.group(1)}")
    assert code == 0, err


def test_unresolvable_mirror_is_named_as_dns(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("KILN_REGISTRY_RETRIES", "0")
    code, out, err = run(capsys, "--pins", _pins(tmp_path), "pin", "lock",
                         "--mirror", "docker.io=http://no-such-registry.invalid:5000")
    line = lock_failure(code, out, err)
    assert "cannot resolve host no-such-registry.invalid (DNS lookup failed)" in line, line
