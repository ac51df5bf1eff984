"""RegistryClient against the real docker-registry: resolve, auth flows, errors, push primitives."""

import base64
import hashlib
import json
import os
import subprocess

import pytest

from kiln.errors import KilnError
from kiln.oci.endpoints import RegistryConfig
from kiln.oci.image import RemoteImage
from kiln.oci.mediatypes import DOCKER_MANIFEST, OCI_INDEX, OCI_MANIFEST
from kiln.oci.reference import parse_reference
from kiln.oci.registry import RegistryClient
from tests.support.registry import PASSWORD, REPO, USER, read_blob

pytestmark = pytest.mark.registry
TAG = "v0.20.1"


def client(server, **kw) -> RegistryClient:
    return RegistryClient.for_registry(server.host, RegistryConfig(insecure={server.host}), **kw)


def docker_config(tmp_path, monkeypatch, host, user, password):
    directory = tmp_path / "cfg"
    directory.mkdir()
    auth = base64.b64encode(f"{user}:{password}".encode()).decode()
    (directory / "config.json").write_text(json.dumps({"auths": {host: {"auth": auth}}}))
    monkeypatch.setenv("DOCKER_CONFIG", str(directory))


def test_resolve_tag_to_the_digest_skopeo_sees(registry_plain):
    c = client(registry_plain)
    for tag in (TAG, f"{TAG}-index", f"{TAG}-docker"):
        assert c.resolve(REPO, tag) == registry_plain.digest_of(f"{REPO}:{tag}")


def test_media_type_comes_from_content_type(registry_plain):
    c = client(registry_plain)
    assert c.get_manifest(REPO, TAG).media_type == OCI_MANIFEST
    assert c.get_manifest(REPO, f"{TAG}-docker").media_type == DOCKER_MANIFEST
    index = c.get_manifest(REPO, f"{TAG}-index")
    assert index.media_type == OCI_INDEX
    assert hashlib.sha256(index.data).hexdigest() == index.digest.split(":")[1]
    assert c.get_manifest(REPO, index.digest).data == index.data  # by digest, verified


def test_index_resolves_to_amd64_ignoring_attestation(registry_plain, tmp_path):
    ref = parse_reference(f"{registry_plain.host}/{REPO}:{TAG}-index")
    image = RemoteImage(ref, client(registry_plain), manifest_cache=tmp_path / "m")
    assert image.manifest().digest == registry_plain.digest_of(f"{REPO}:{TAG}")
    assert image.config()["architecture"] == "amd64"


def test_unknown_tag_is_a_clear_error(registry_plain):
    with pytest.raises(KilnError, match=r"vllm/vllm-openai:no-such-tag: not found"):
        client(registry_plain).resolve(REPO, "no-such-tag")
    with pytest.raises(KilnError, match="not found"):
        client(registry_plain).get_manifest("nobody/nothing", "latest")


def test_unreachable_registry_is_a_clear_error():
    c = RegistryClient.for_registry("127.0.0.1:9", RegistryConfig(insecure={"127.0.0.1:9"}), retries=0)
    with pytest.raises(KilnError, match="127.0.0.1:9: unreachable"):
        c.resolve(REPO, TAG)


def test_anonymous_bearer_flow(registry_token):
    expected = registry_token.digest_of(f"{REPO}:{TAG}")
    c = client(registry_token)
    assert c.resolve(REPO, TAG) == expected
    c.get_manifest(REPO, TAG)  # second request reuses the cached token
    seen = registry_token.token_server.requests_seen[-1]
    assert seen["user"] is None and seen["scopes"] == [f"repository:{REPO}:pull"]
    assert c.auth.token_requests == 1


def test_authenticated_bearer_flow_from_docker_config(registry_token, tmp_path, monkeypatch):
    docker_config(tmp_path, monkeypatch, registry_token.host, USER, PASSWORD)
    c = client(registry_token)
    c.resolve(REPO, TAG)
    assert registry_token.token_server.requests_seen[-1]["user"] == USER


def test_wrong_password_for_token_service(registry_token, tmp_path, monkeypatch):
    docker_config(tmp_path, monkeypatch, registry_token.host, USER, "wrong-secret-123")
    with pytest.raises(KilnError, match="refused user 'testuser'") as err:
        client(registry_token).resolve(REPO, TAG)
    assert "wrong-secret-123" not in str(err.value)


def test_anonymous_push_is_denied_clearly(registry_token):
    with pytest.raises(KilnError, match=r"access denied .*anonymous access; log in"):
        client(registry_token).upload_blob("test/denied", "sha256:" + hashlib.sha256(b"x").hexdigest(), b"x")


def test_basic_auth_from_env_vars(registry_basic, monkeypatch):
    monkeypatch.setenv("KILN_REGISTRY_USER", USER)
    monkeypatch.setenv("KILN_REGISTRY_PASSWORD", PASSWORD)
    assert client(registry_basic).resolve(REPO, TAG) == registry_basic.digest_of(f"{REPO}:{TAG}")


def test_basic_auth_wrong_password(registry_basic, monkeypatch):
    monkeypatch.setenv("KILN_REGISTRY_USER", USER)
    monkeypatch.setenv("KILN_REGISTRY_PASSWORD", "hunter2-wrong")
    with pytest.raises(KilnError, match="credentials rejected") as err:
        client(registry_basic).resolve(REPO, TAG)
    assert "hunter2" not in str(err.value)


def test_basic_auth_without_credentials(registry_basic):
    with pytest.raises(KilnError, match="needs a login"):
        client(registry_basic).resolve(REPO, TAG)


def test_mirror_maps_docker_hub_to_the_local_registry(registry_plain):
    config = RegistryConfig.load([registry_plain.mirror])
    ref = parse_reference(f"vllm/vllm-openai:{TAG}")
    assert ref.registry == "docker.io"
    c = RegistryClient.for_registry(ref.registry, config)
    assert c.endpoint.host == registry_plain.host
    assert c.resolve(ref.repository, ref.ref) == registry_plain.digest_of(f"{REPO}:{TAG}")


def test_push_primitives_mount_upload_manifest(registry_token, base_layout, monkeypatch):
    monkeypatch.setenv("KILN_REGISTRY_USER", USER)
    monkeypatch.setenv("KILN_REGISTRY_PASSWORD", PASSWORD)
    c = client(registry_token)
    base = c.get_manifest(REPO, TAG)
    target = "test/kiln-pushed"
    tokens = registry_token.token_server.requests_seen
    for descriptor in [base.config, *base.layers]:
        assert not c.blob_exists(target, descriptor.digest)
        assert c.mount_blob(target, descriptor.digest, REPO)
        assert c.blob_exists(target, descriptor.digest)
    # one token covered both repositories
    assert any(sorted(t["scopes"]) == [f"repository:{target}:pull,push", f"repository:{REPO}:pull"] for t in tokens)
    # a mount the registry refuses (digest unknown in the source) answers False; then upload
    data = os.urandom(300_000)
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    assert not c.mount_blob(target, digest, REPO)
    c.upload_blob(target, digest, data, chunk_size=64 * 1024)  # PATCH chunks following Location
    small = b'{"kiln": "monolithic"}'
    small_digest = "sha256:" + hashlib.sha256(small).hexdigest()
    c.upload_blob(target, small_digest, small)
    assert read_blob(c, target, digest) == data and read_blob(c, target, small_digest) == small
    # manifest PUT: byte-exact, the digest is over the bytes sent
    assert c.put_manifest(target, "copied", base.data, base.media_type) == base.digest
    skopeo = subprocess.run(["skopeo", "inspect", "--raw", "--tls-verify=false", f"--creds={USER}:{PASSWORD}",
                             f"docker://{registry_token.host}/{target}:copied"], capture_output=True, check=True)
    assert skopeo.stdout == base.data


def test_upload_with_wrong_digest_is_refused(registry_plain):
    c = client(registry_plain)
    with pytest.raises(KilnError, match="DIGEST_INVALID|HTTP 400"):
        c.upload_blob("test/bad", "sha256:" + "0" * 64, b"not matching")



def _skopeo_tags(server) -> list[str]:
    creds = [f"--creds={server.username}:{server.password}"] if server.username else []
    out = subprocess.run(["skopeo", "list-tags", "--tls-verify=false", *creds, f"docker://{server.host}/{REPO}"],
                         capture_output=True, check=True, text=True).stdout
    return json.loads(out)["Tags"]


def test_tag_list_is_every_tag_once_and_bounded(registry_plain):
    expected = _skopeo_tags(registry_plain)
    assert len(expected) > 5  # the fixture images: a release, its variants and a nightly
    c = client(registry_plain)
    assert sorted(c.list_tags(REPO)) == sorted(expected)
    # docker-registry 2.8 ignores `n` and `last` and sends no Link: the full page asks for the next
    # (`?n=2&last=`), which repeats the same tags, and the listing stops there
    before = c.stats.requests
    assert sorted(c.list_tags(REPO, page_size=2)) == sorted(expected)
    assert c.stats.requests - before == 2
    with pytest.raises(KilnError, match=rf"{REPO} tag list: more than 3 tags"):
        c.list_tags(REPO, max_tags=3)
    with pytest.raises(KilnError, match="a page larger than 20 bytes"):
        c.list_tags(REPO, max_body=20)
    with pytest.raises(KilnError, match="nobody/nothing"):
        c.list_tags("nobody/nothing")


def test_tag_list_through_token_auth(registry_token):
    c = client(registry_token)
    assert c.list_tags(REPO) == _skopeo_tags(registry_token)
    assert registry_token.token_server.requests_seen[-1]["scopes"] == [f"repository:{REPO}:pull"]


class _PagedTags:
    """The pagination docker-registry 2.8 does not do (distribution 3, Docker Hub): ``n`` and
    ``last`` honoured, a ``Link: <...>; rel="next"`` while more tags follow."""

    def __init__(self, tags: list[str], link_host: str | None = None):
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
        from threading import Thread
        from urllib.parse import parse_qs, urlsplit

        self.paths = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):  # noqa: N802
                outer.paths.append(self.path)
                query = parse_qs(urlsplit(self.path).query)
                n, last = int(query["n"][0]), query.get("last", [""])[0]
                rest = [t for t in tags if t > last]
                page = rest[:n]
                data = json.dumps({"name": REPO, "tags": page}).encode()
                self.send_response(200)
                if len(rest) > n:
                    target = f"http://{link_host}" if link_host else ""
                    self.send_header("Link", f'<{target}/v2/{REPO}/tags/list?n={n}&last={page[-1]}>; rel="next"')
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.host = f"127.0.0.1:{self.server.server_address[1]}"
        Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def test_tag_list_follows_next_links_and_stays_on_the_registry():
    tags = sorted(f"nightly-{i:040x}" for i in range(7))
    server = _PagedTags(tags)
    try:
        c = RegistryClient.for_registry(server.host, RegistryConfig(insecure={server.host}))
        assert c.list_tags(REPO, page_size=3) == tags
        assert server.paths == [f"/v2/{REPO}/tags/list?n=3", f"/v2/{REPO}/tags/list?n=3&last={tags[2]}",
                                f"/v2/{REPO}/tags/list?n=3&last={tags[5]}"]
        with pytest.raises(KilnError, match="tag list: more than 2 pages"):
            c.list_tags(REPO, page_size=3, max_pages=2)
    finally:
        server.close()
    elsewhere = _PagedTags(tags, link_host="127.0.0.2:1")
    try:
        c = RegistryClient.for_registry(elsewhere.host, RegistryConfig(insecure={elsewhere.host}))
        with pytest.raises(KilnError, match=r"next page on another host \(127.0.0.2:1\)"):
            c.list_tags(REPO, page_size=3)
        assert len(elsewhere.paths) == 1
    finally:
        elsewhere.close()
