"""An HTTP client for one registry (OCI distribution API v2), pull and push primitives.

Public API:
    TransferStats()   .requests .bytes_down .bytes_up .blobs_fetched .blobs_uploaded .mounted
    RegistryClient(endpoint, session=None, auth=None, stats=None, retries=3)
        RegistryClient.for_registry(registry, config=None, **kw) -> RegistryClient
        .resolve(repo, ref) -> str                      digest by HEAD (GET when no header)
        .get_manifest(repo, ref) -> Manifest            verified bytes, media type from Content-Type
        .blob_exists(repo, digest) -> bool
        .blob_stream(repo, digest) -> ctx[readable]     raw bytes, NOT verified (for the blob cache)
        .open_blob(repo, digest, size=None) -> ctx[VerifyingReader]  verified on leaving the block
        .get_blob(repo, digest, size=None) -> bytes     verified
        .mount_blob(repo, digest, from_repo) -> bool    False when the registry refused (202)
        .upload_blob(repo, digest, data, chunk_size=None)   bytes or Path; monolithic or PATCH chunks
        .put_manifest(repo, ref, data, media_type) -> str   byte-exact, returns the digest

Every request carries the scopes it needs; ``RegistryAuth`` turns 401 challenges into tokens.
GET/HEAD and replayable bodies are retried (bounded, exponential backoff, ``Retry-After``
honoured) on connection errors, 429 and 5xx. Errors name the registry, repository and digest
or tag, never credentials.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote, urljoin

import requests

from kiln.errors import KilnError
from kiln.oci.auth import RegistryAuth, pull_scope, push_scope
from kiln.oci.digest import VerifyingReader, check_digest, sha256_digest
from kiln.oci.endpoints import Endpoint, RegistryConfig
from kiln.oci.manifest import Manifest
from kiln.oci.mediatypes import IMAGE_MANIFEST_TYPES, INDEX_TYPES, MANIFEST_ACCEPT

_RETRY_STATUS = {429, 500, 502, 503, 504}
_TIMEOUT = (30, 300)  # connect, read


@dataclass
class TransferStats:
    requests: int = 0
    bytes_down: int = 0
    bytes_up: int = 0
    blobs_fetched: list[str] = field(default_factory=list)
    blobs_uploaded: list[str] = field(default_factory=list)
    mounted: list[str] = field(default_factory=list)


Body = bytes | Path | Callable[[], object] | None


class RegistryClient:
    def __init__(self, endpoint: Endpoint, session: requests.Session | None = None,
                 auth: RegistryAuth | None = None, stats: TransferStats | None = None, retries: int = 3):
        self.endpoint = endpoint
        self.session = session or requests.Session()
        self.verify = not endpoint.insecure
        self.auth = auth or RegistryAuth(endpoint.host, self.session, verify=self.verify)
        self.stats = stats or TransferStats()
        self.retries = retries

    @classmethod
    def for_registry(cls, registry: str, config: RegistryConfig | None = None, **kw) -> RegistryClient:
        return cls((config or RegistryConfig()).endpoint(registry), **kw)

    @property
    def name(self) -> str:
        host = self.endpoint.host
        return host if host == self.endpoint.registry else f"{self.endpoint.registry} (via {host})"

    # -- manifests ---------------------------------------------------------------------------

    def resolve(self, repo: str, ref: str) -> str:
        """The digest ``ref`` names now. HEAD only: Docker Hub rate-limits manifest GETs."""
        resp = self._request("HEAD", self._url(repo, "manifests", ref), {pull_scope(repo)},
                             headers={"Accept": MANIFEST_ACCEPT}, ok=(200,), what=f"{repo}:{ref}")
        digest = resp.headers.get("Docker-Content-Digest")
        if digest:
            return check_digest(digest, f"{self.name}/{repo}:{ref}")
        return self.get_manifest(repo, ref).digest

    def get_manifest(self, repo: str, ref: str) -> Manifest:
        what = f"{repo}@{ref}" if ref.startswith("sha256:") else f"{repo}:{ref}"
        resp = self._request("GET", self._url(repo, "manifests", ref), {pull_scope(repo)},
                             headers={"Accept": MANIFEST_ACCEPT}, ok=(200,), what=what)
        data = resp.content
        self.stats.bytes_down += len(data)
        digest = sha256_digest(data)
        expected = ref if ref.startswith("sha256:") else resp.headers.get("Docker-Content-Digest")
        if expected and expected != digest:
            raise KilnError(f"{self.name}/{what}: manifest digest mismatch (expected {expected}, got {digest})")
        media_type = resp.headers.get("Content-Type", "").split(";")[0].strip()
        if media_type not in INDEX_TYPES | IMAGE_MANIFEST_TYPES:
            # Some servers answer application/json; the body's own field is the next best source.
            media_type = str(Manifest(data, "", digest).json.get("mediaType", media_type))
        if media_type not in INDEX_TYPES | IMAGE_MANIFEST_TYPES:
            raise KilnError(f"{self.name}/{what}: unsupported manifest media type {media_type!r}")
        return Manifest(data, media_type, digest)

    def put_manifest(self, repo: str, ref: str, data: bytes, media_type: str) -> str:
        digest = sha256_digest(data)
        resp = self._request("PUT", self._url(repo, "manifests", ref), {push_scope(repo)},
                             headers={"Content-Type": media_type}, body=data, ok=(201,),
                             what=f"{repo}:{ref} (manifest PUT)")
        self.stats.bytes_up += len(data)
        returned = resp.headers.get("Docker-Content-Digest")
        if returned and returned != digest:
            raise KilnError(f"{self.name}/{repo}:{ref}: registry stored digest {returned}, sent {digest}")
        return digest

    # -- blobs -------------------------------------------------------------------------------

    def blob_exists(self, repo: str, digest: str) -> bool:
        resp = self._request("HEAD", self._url(repo, "blobs", digest), {pull_scope(repo)},
                             ok=(200, 404), what=f"{repo}@{digest}")
        return resp.status_code == 200

    @contextmanager
    def blob_stream(self, repo: str, digest: str) -> Iterator:
        """The blob's raw bytes as a readable; unverified, callers must hash what they read."""
        check_digest(digest, f"{self.name}/{repo} blob")
        resp = self._request("GET", self._url(repo, "blobs", digest), {pull_scope(repo)},
                             ok=(200,), stream=True, what=f"{repo}@{digest}")
        self.stats.blobs_fetched.append(digest)
        counter = _CountingRaw(resp, self.stats)
        try:
            yield counter
        finally:
            resp.close()

    @contextmanager
    def open_blob(self, repo: str, digest: str, size: int | None = None) -> Iterator[VerifyingReader]:
        """A reader verified (drained, size and sha256 checked) when the block exits normally."""
        with self.blob_stream(repo, digest) as raw:
            reader = VerifyingReader(raw, digest, f"{self.name}/{repo} blob {digest}", size)
            yield reader
            reader.finish()

    def get_blob(self, repo: str, digest: str, size: int | None = None) -> bytes:
        chunks = []
        with self.open_blob(repo, digest, size) as reader:
            while chunk := reader.read(1 << 20):
                chunks.append(chunk)
        return b"".join(chunks)

    def mount_blob(self, repo: str, digest: str, from_repo: str) -> bool:
        """Cross-repo mount; True when linked (201). A 202 opened an upload instead: closed again."""
        url = self._url(repo, "blobs", "uploads/") + f"?mount={quote(digest)}&from={quote(from_repo)}"
        resp = self._request("POST", url, {push_scope(repo), pull_scope(from_repo)}, ok=(201, 202),
                             what=f"{repo} mount {digest} from {from_repo}")
        if resp.status_code == 201:
            self.stats.mounted.append(digest)
            return True
        location = resp.headers.get("Location")
        if location:  # best effort: an abandoned upload would otherwise linger until the registry's GC
            try:
                self._request("DELETE", self._absolute(location), {push_scope(repo)}, ok=(204, 404),
                              what=f"{repo} cancel upload")
            except KilnError:
                pass
        return False

    def upload_blob(self, repo: str, digest: str, data: bytes | Path, chunk_size: int | None = None) -> None:
        """Upload ``data`` (bytes or a file) as ``digest``: one PUT, or PATCH chunks then PUT."""
        check_digest(digest, f"{self.name}/{repo} upload")
        size = len(data) if isinstance(data, bytes) else data.stat().st_size
        what = f"{repo} upload {digest}"
        scopes = {push_scope(repo)}
        resp = self._request("POST", self._url(repo, "blobs", "uploads/"), scopes, ok=(202,), what=what)
        location = self._location(resp, what)
        octet = {"Content-Type": "application/octet-stream"}
        if chunk_size and size > chunk_size:
            for start in range(0, size, chunk_size):
                end = min(start + chunk_size, size) - 1
                chunk = _slice(data, start, end + 1)
                resp = self._request("PATCH", location, scopes, body=chunk, ok=(202,), what=what,
                                     headers={**octet, "Content-Range": f"{start}-{end}"})
                # distribution appends out-of-order chunks instead of refusing them: check ourselves.
                if resp.headers.get("Range") != f"0-{end}":
                    raise KilnError(f"{self.name}/{what}: registry holds {resp.headers.get('Range')!r} after sending bytes 0-{end}")
                location = self._location(resp, what)  # a new Location after every chunk
                self.stats.bytes_up += len(chunk)
            body: Body = b""
        else:
            body = data
        sep = "&" if "?" in location else "?"
        resp = self._request("PUT", f"{location}{sep}digest={quote(digest)}", scopes, body=body,
                             headers=octet, ok=(201,), what=what)
        if not (chunk_size and size > chunk_size):
            self.stats.bytes_up += size
        returned = resp.headers.get("Docker-Content-Digest")
        if returned and returned != digest:
            raise KilnError(f"{self.name}/{what}: registry computed {returned}")
        self.stats.blobs_uploaded.append(digest)

    # -- plumbing ----------------------------------------------------------------------------

    def _url(self, repo: str, kind: str, ref: str) -> str:
        return f"{self._base()}/v2/{repo}/{kind}/{ref}"

    def _absolute(self, location: str) -> str:
        return urljoin(self._base() + "/", location)

    def _location(self, resp: requests.Response, what: str) -> str:
        location = resp.headers.get("Location")
        if not location:
            raise KilnError(f"{self.name}/{what}: upload answer has no Location header")
        return self._absolute(location)

    def _base(self) -> str:
        return f"{self.endpoint.scheme}://{self.endpoint.host}"

    def _request(self, method: str, url: str, scopes, *, headers: dict | None = None, body: Body = None,
                 ok: tuple[int, ...], what: str, stream: bool = False) -> requests.Response:
        attempt = 0
        while True:
            auth_headers = self.auth.headers(scopes)
            resp = self._send(method, url, {**(headers or {}), **auth_headers}, body, stream)
            if resp.status_code != 401 or attempt >= 3:
                break
            resp.close()
            scopes = self.auth.retry_scopes(resp, scopes, bool(auth_headers), attempt)
            attempt += 1
        if resp.status_code not in ok:
            message = _describe_failure(self.name, what, resp)
            resp.close()
            raise KilnError(message)
        return resp

    def _send(self, method: str, url: str, headers: dict, body: Body, stream: bool) -> requests.Response:
        replayable = not callable(body)
        for attempt in range(self.retries + 1):
            last = attempt == self.retries or not replayable
            handle = None
            try:
                data: object = body
                if isinstance(body, Path):
                    handle = data = body.open("rb")
                    headers = {**headers, "Content-Length": str(body.stat().st_size)}
                elif callable(body):
                    data = body()
                self.stats.requests += 1
                resp = self.session.request(method, url, headers=headers, data=data, stream=stream,
                                            verify=self.verify, timeout=_TIMEOUT, allow_redirects=True)
            except requests.RequestException as err:
                if last:
                    raise KilnError(f"{self.name}: unreachable ({err.__class__.__name__}) for {method} {_path(url)}") from None
                time.sleep(_backoff(attempt))
                continue
            finally:
                if handle:
                    handle.close()
            if resp.status_code in _RETRY_STATUS and not last:
                delay = _retry_after(resp)
                delay = _backoff(attempt) if delay is None else delay
                resp.close()
                time.sleep(delay)
                continue
            return resp
        raise AssertionError("unreachable")


class _CountingRaw:
    """``resp.raw`` as compressed bytes on the wire (no transfer decoding), counted into stats."""

    def __init__(self, resp: requests.Response, stats: TransferStats):
        self._raw = resp.raw
        self._stats = stats

    def read(self, n: int = -1) -> bytes:
        data = self._raw.read(None if n is None or n < 0 else n, decode_content=False)
        self._stats.bytes_down += len(data)
        return data


def _slice(data: bytes | Path, start: int, end: int) -> bytes:
    if isinstance(data, bytes):
        return data[start:end]
    with data.open("rb") as handle:
        handle.seek(start)
        return handle.read(end - start)


def _backoff(attempt: int) -> float:
    return min(0.5 * 2**attempt, 8.0)


def _retry_after(resp: requests.Response) -> float | None:
    value = resp.headers.get("Retry-After", "")
    return min(float(value), 30.0) if value.isdigit() else None


def _path(url: str) -> str:
    """The URL without its query: upload locations carry opaque state worth not printing."""
    return url.split("?", 1)[0]


def _describe_failure(registry: str, what: str, resp: requests.Response) -> str:
    codes = []
    try:
        for error in resp.json().get("errors", []):
            codes.append(f"{error.get('code')}: {error.get('message')}")
    except (ValueError, AttributeError):
        pass
    detail = "; ".join(codes)
    status = resp.status_code
    if status == 404 and "MANIFEST_UNKNOWN" in detail or (status == 404 and "/manifests/" in resp.url):
        return f"{registry}/{what}: not found (no such tag, digest or repository)"
    if status == 403:
        return f"{registry}/{what}: forbidden (HTTP 403){': ' + detail if detail else ''}"
    return f"{registry}/{what}: HTTP {status}{': ' + detail if detail else ''}"
