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




@pytest.mark.reliability
@pytest.mark.parametrize("text", ["127.0.0.1:99999/k/x", "127.0.0.1:0/k/x", "registry.example:65536/k/x",
                                  "[::1]:70000/k/x"])
def test_a_port_outside_1_to_65535_is_refused_at_parse_time(text):
    """urllib3 refused it only at the first request, as a LocationParseError traceback."""
    port = text.split("/")[0].rsplit(":", 1)[1]
    with pytest.raises(KilnError, match=f"port '{port}' of .* is not a TCP port \\(1 to 65535\\)"):
        parse_reference(text)


@pytest.mark.parametrize("text", ["127.0.0.1:65535/k/x", "127.0.0.1:1/k/x", "[::1]:5000/k/x", "[::1]/k/x"])
def test_ports_inside_the_range_parse(text):
    assert parse_reference(text).repository == "k/x"


@pytest.mark.reliability
@pytest.mark.parametrize("argv, expected", [
    (["build", "--image", "e2e-p65", "--pin", "v0.20.1", "--sm", "120", "--push",
      "--repository", "127.0.0.1:99999/k/x", "--mirror", "docker.io=127.0.0.1:9"], "--repository: image reference '127.0.0.1:99999/k/x': port '99999'"),
    (["build", "--image", "e2e-p65", "--pin", "v0.20.1", "--sm", "120", "--oci", "{tmp}/out",
      "--mirror", "docker.io=127.0.0.1:99999"], "--mirror 'docker.io=127.0.0.1:99999': port '99999'"),
    (["build", "--image", "e2e-p65", "--pin", "v0.20.1", "--sm", "120", "--oci", "{tmp}/out",
      "--insecure-registry", "127.0.0.1:0"], "--insecure-registry '127.0.0.1:0': port '0'"),
    (["pin", "lock"], "pins.toml: pins.v0.20.1.image"),
], ids=["build --push --repository", "--mirror", "--insecure-registry", "pin lock"])
def test_a_bad_port_is_one_line_before_any_work(tmp_path, argv, expected):
    """Each used to raise LocationParseError (``build --push``: after the pull, the patching and
    the bake); now one line at parse time, nothing written."""
    from tests.support import TEST_IMAGES
    from tests.support.reliability_checks import assert_one_line_error, run_cli

    pins = tmp_path / "pins.toml"
    image = "127.0.0.1:99999/vllm/vllm-openai:v0.20.1" if argv[0] == "pin" else "docker.io/vllm/vllm-openai:v0.20.1"
    pins.write_text(f'[pins."v0.20.1"]\nrole = "current"\nimage = "{image}"\nvllm = "0.20.1"\ncuda = "cu130"\n')
    before = pins.read_bytes()
    run = run_cli(["--pins", str(pins), "--images", str(TEST_IMAGES), *(a.format(tmp=tmp_path) for a in argv)])
    line = assert_one_line_error(run, expected.replace("pins.toml", str(pins)))
    assert "port" in line
    assert pins.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pins.toml"]  # no output, no cache
