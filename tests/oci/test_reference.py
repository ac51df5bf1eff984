"""Image references and transports, as users type them."""


import pytest

from kiln.errors import KilnError
from kiln.oci.reference import (
    parse_reference,
)

pytestmark = pytest.mark.isolated

DIGEST = "sha256:" + "ab" * 32


@pytest.mark.parametrize(
    ("text", "registry", "repository", "tag", "digest"),
    [
        ("docker.io/vllm/vllm-openai:v0.20.1", "docker.io", "vllm/vllm-openai", "v0.20.1", None),
        ("vllm/vllm-openai", "docker.io", "vllm/vllm-openai", "latest", None),
        ("ubuntu:24.04", "docker.io", "library/ubuntu", "24.04", None),
        ("index.docker.io/ubuntu", "docker.io", "library/ubuntu", "latest", None),
        ("127.0.0.1:5000/vllm/vllm-openai:nightly", "127.0.0.1:5000", "vllm/vllm-openai", "nightly", None),
        ("localhost/a/b", "localhost", "a/b", "latest", None),
        (f"ghcr.io/o/r@{DIGEST}", "ghcr.io", "o/r", None, DIGEST),
        (f"vllm/vllm-openai:v1@{DIGEST}", "docker.io", "vllm/vllm-openai", "v1", DIGEST),
    ],
)
def test_parse_reference(text, registry, repository, tag, digest):
    ref = parse_reference(text)
    assert (ref.registry, ref.repository, ref.tag, ref.digest) == (registry, repository, tag, digest)
    assert ref.ref == (digest or tag)
    assert parse_reference(str(ref)) == ref  # canonical form round-trips


@pytest.mark.parametrize("text", ["", "Vllm/X", "a b", "x@sha256:12", "x@md5:" + "a" * 32, "http://h/x",
                                  "foo//bar", ":tag", "x:ta$g"])
def test_malformed_reference_is_one_clear_error(text):
    with pytest.raises(KilnError, match="image reference"):
        parse_reference(text)


def test_pinned_keeps_tag_and_adds_digest():
    ref = parse_reference("vllm/vllm-openai:v0.20.1").pinned(DIGEST)
    assert str(ref) == f"docker.io/vllm/vllm-openai:v0.20.1@{DIGEST}"
    assert ref.ref == DIGEST


