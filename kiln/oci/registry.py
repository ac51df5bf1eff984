"""An HTTP client for one registry (OCI distribution API v2), pull and push primitives.

Public API:
    TransferStats()   .requests .bytes_down .bytes_up .blobs_fetched .blobs_uploaded .mounted
                      .retries .resumes .upload_restarts
    registry_session() -> requests.Session       no ~/.netrc: credentials come from ``credentials`` only
    RegistryClient(endpoint, session=None, auth=None, stats=None, retries=None, budget=None)
        retries: None -> ``RetryPolicy.from_env()`` (``kiln.oci.retry``), an int overrides its count
        budget: the ``kiln.oci.limits.Budget`` whose timeouts and deadline bound every request
                (None: a budget of its own from the environment)
        RegistryClient.for_registry(registry, config=None, **kw) -> RegistryClient   (budget:
                ``config.limits`` unless one is passed)
        .resolve(repo, ref) -> str                      digest by HEAD (GET when no header)
        .get_manifest(repo, ref) -> Manifest            verified bytes, media type from Content-Type
        .find_manifest(repo, ref) -> Manifest | None    the same, None for a 404
        .referrers(repo, digest) -> Manifest | None     the referrers API's index; None without the API
        .list_tags(repo, page_size, max_pages, max_tags, max_body) -> list[str]   every page, bounded
        .blob_exists(repo, digest) -> bool
        .blob_stream(repo, digest) -> ctx[readable]     raw bytes, NOT verified (for the blob cache);
                                                        resumed with ``Range`` when the connection breaks
        .open_blob(repo, digest, size=None) -> ctx[VerifyingReader]  verified on leaving the block
        .mount_blob(repo, digest, from_repo) -> bool    False when the registry refused (202)
        .upload_blob(repo, digest, data, chunk_size=None)   bytes or Path; monolithic or PATCH chunks;
                                                        a broken session is abandoned and restarted
        .put_manifest(repo, ref, data, media_type) -> str   byte-exact, returns the digest

Every request carries the scopes it needs; ``RegistryAuth`` turns 401 challenges into tokens
(a 401 on a token that worked before -- it expired -- fetches a new one, once).
Retries are bounded by a ``RetryPolicy`` (exponential backoff, ``Retry-After`` honoured up to a
cap) on connection errors, 429 and 5xx:
- requests without an upload session (HEAD, GET, mount POST, manifest PUT) are replayed;
- a blob download that breaks mid-body continues from the last byte received (``Range``; the
  registry ignoring it costs a re-read of the start, never a wrong byte), so the blob cache's
  digest check covers one continuous stream;
- a blob upload that breaks (reset, 5xx, a registry holding the wrong range) is never patched
  up in place: its session is abandoned, the blob HEAD-checked (the final PUT may have landed),
  and a fresh session uploads it from byte 0.
TLS failures are not retried. Errors name the registry, repository and digest or tag, never
credentials or upload-session state.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote, urljoin, urlsplit

import requests

from kiln.errors import KilnError
from kiln.oci.auth import RegistryAuth, pull_scope, push_scope
from kiln.oci.digest import VerifyingReader, check_digest, sha256_digest
from kiln.oci.endpoints import Endpoint, RegistryConfig
from kiln.oci.failures import connection_problem, describe_failure, tls_failure
from kiln.oci.limits import Budget
from kiln.oci.manifest import Manifest
from kiln.oci.mediatypes import IMAGE_MANIFEST_TYPES, INDEX_TYPES, MANIFEST_ACCEPT, OCI_INDEX
from kiln.oci.resumable import ResumableBlob
from kiln.oci.retry import BROKEN_CONNECTION, RETRY_STATUS, RetryPolicy, TransferError, retry_after

# One read of a blob body asks for at most this much: bytes of a read that a reset interrupts
# are lost, so a resume starts at most this far back.
_READ_MAX = 256 << 10


@dataclass
class TransferStats:
    requests: int = 0
    bytes_down: int = 0
    bytes_up: int = 0
    blobs_fetched: list[str] = field(default_factory=list)
    blobs_uploaded: list[str] = field(default_factory=list)
    mounted: list[str] = field(default_factory=list)
    retries: int = 0  # requests sent again after a transient failure
    resumes: int = 0  # blob downloads continued after a broken connection
    upload_restarts: int = 0  # blob uploads started over in a fresh session


class _NoNetrc(requests.auth.AuthBase):
    def __call__(self, request):
        return request


class _RegistrySession(requests.Session):
    """A ``requests.Session`` that never reads ``~/.netrc``.

    requests fills in netrc credentials for any request without ``auth=`` (kiln sets the
    Authorization header itself) and again on every redirect; kiln's credentials come only
    from ``kiln.oci.credentials``. Proxy and CA-bundle environment variables still apply.
    """

    def __init__(self):
        super().__init__()
        self.auth = _NoNetrc()  # a session auth stops the netrc lookup on each request

    def rebuild_auth(self, prepared_request, response):  # on redirects: strip, never add
        headers = prepared_request.headers
        if "Authorization" in headers and self.should_strip_auth(response.request.url, prepared_request.url):
            del headers["Authorization"]


def registry_session() -> requests.Session:
    return _RegistrySession()


Body = bytes | Path | Callable[[], object] | None


class RegistryClient:
    def __init__(self, endpoint: Endpoint, session: requests.Session | None = None,
                 auth: RegistryAuth | None = None, stats: TransferStats | None = None,
                 retries: int | None = None, budget: Budget | None = None):
        self.endpoint = endpoint
        self.budget = budget or Budget()
        self.session = session or registry_session()
        self.verify = not endpoint.insecure
        self.auth = auth or RegistryAuth(endpoint.host, self.session, verify=self.verify)
        self.stats = stats or TransferStats()
        policy = RetryPolicy.from_env()
        self.policy = policy if retries is None else RetryPolicy(retries, policy.backoff, policy.backoff_max,
                                                                 policy.retry_after_max)

    @classmethod
    def for_registry(cls, registry: str, config: RegistryConfig | None = None, push: bool = False,
                     **kw) -> RegistryClient:
        """A client for ``registry``: through its mirror for pulls, to the registry itself for a push."""
        config = config or RegistryConfig()
        kw.setdefault("budget", Budget(config.limits))
        return cls(config.endpoint(registry, push=push), **kw)

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

    def find_manifest(self, repo: str, ref: str) -> Manifest | None:
        """``get_manifest``, or None when the registry has no such manifest (404)."""
        resp = self._request("HEAD", self._url(repo, "manifests", ref), {pull_scope(repo)},
                             headers={"Accept": MANIFEST_ACCEPT}, ok=(200, 404), what=f"{repo}:{ref}")
        return self.get_manifest(repo, ref) if resp.status_code == 200 else None

    def referrers(self, repo: str, digest: str) -> Manifest | None:
        """The referrers API's index for ``digest``; None where the registry has no such API."""
        what = f"{repo} referrers of {digest}"
        resp = self._request("GET", self._url(repo, "referrers", check_digest(digest, what)), {pull_scope(repo)},
                             headers={"Accept": OCI_INDEX}, ok=(200, 400, 404, 405), what=what)
        media_type = resp.headers.get("Content-Type", "").split(";")[0].strip()
        if resp.status_code != 200 or media_type != OCI_INDEX:
            return None
        self.stats.bytes_down += len(resp.content)
        return Manifest(resp.content, OCI_INDEX, sha256_digest(resp.content))

    def list_tags(self, repo: str, page_size: int = 1000, max_pages: int = 100, max_tags: int = 50_000,
                  max_body: int = 4 << 20) -> list[str]:
        """``GET /v2/<repo>/tags/list`` page by page: the registry's ``Link: <..>; rel="next"``, else
        ``?n=&last=`` while a page comes back full. Bounded: a registry cannot make this loop or fill memory."""
        what, seen = f"{repo} tag list", {}  # a dict: tags in the order first listed
        url = f"{self._base()}/v2/{repo}/tags/list?n={page_size}"
        for _ in range(max_pages):
            resp = self._request("GET", url, {pull_scope(repo)}, ok=(200,), what=what, stream=True)
            try:
                body = bytearray()
                for chunk in resp.iter_content(64 << 10):
                    body += chunk
                    if len(body) > max_body:
                        raise KilnError(f"{self.name}/{what}: a page larger than {max_body} bytes")
                link = resp.links.get("next", {}).get("url")
            finally:
                resp.close()
            self.stats.bytes_down += len(body)
            try:
                page = json.loads(body).get("tags") or []
            except (ValueError, AttributeError):
                raise KilnError(f"{self.name}/{what}: not a JSON tag list") from None
            if not isinstance(page, list) or not all(isinstance(tag, str) for tag in page):
                raise KilnError(f"{self.name}/{what}: \"tags\" is not a list of strings")
            fresh = [tag for tag in dict.fromkeys(page) if tag not in seen]  # a registry ignoring `last` repeats
            if len(seen) + len(fresh) > max_tags:
                raise KilnError(f"{self.name}/{what}: more than {max_tags} tags")
            seen.update(dict.fromkeys(fresh))
            if link and fresh:
                url = self._absolute(link)
                if urlsplit(url).netloc != self.endpoint.host:  # never send credentials elsewhere
                    raise KilnError(f"{self.name}/{what}: next page on another host ({urlsplit(url).netloc})")
            elif len(page) >= page_size and fresh:
                url = f"{self._base()}/v2/{repo}/tags/list?n={page_size}&last={quote(page[-1])}"
            else:
                return list(seen)
        raise KilnError(f"{self.name}/{what}: more than {max_pages} pages")

    def put_manifest(self, repo: str, ref: str, data: bytes, media_type: str) -> str:
        digest = sha256_digest(data)
        resp = self._request("PUT", self._url(repo, "manifests", ref), {push_scope(repo)},
                             headers={"Content-Type": media_type}, body=data, ok=(201,),
                             what=f"{repo}{'@' if ref.startswith('sha256:') else ':'}{ref} (manifest PUT)")
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
        stream = ResumableBlob(self, repo, digest, _READ_MAX)
        self.stats.blobs_fetched.append(digest)
        try:
            yield stream
        finally:
            stream.close()

    @contextmanager
    def open_blob(self, repo: str, digest: str, size: int | None = None) -> Iterator[VerifyingReader]:
        """A reader verified (drained, size and sha256 checked) when the block exits normally."""
        with self.blob_stream(repo, digest) as raw:
            reader = VerifyingReader(raw, digest, f"{self.name}/{repo} blob {digest}", size)
            yield reader
            reader.finish()

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
        """Upload ``data`` (bytes or a file) as ``digest``: one PUT, or PATCH chunks then PUT.

        A session that breaks is not continued: the registry's view of a half-sent PATCH or PUT
        is unknown. Unless the blob turns out to be there, a fresh session sends it from byte 0.
        """
        check_digest(digest, f"{self.name}/{repo} upload")
        what = f"{repo} upload {digest}"
        for attempt in range(self.policy.retries + 1):
            try:
                self._upload_session(repo, digest, data, chunk_size, what)
                break
            except TransferError as err:
                if attempt == self.policy.retries:
                    raise TransferError(f"{err} (gave up after {attempt + 1} upload sessions)") from None
                self.budget.sleep(self.policy.delay(attempt, err.retry_after))
                self.stats.upload_restarts += 1
                if self.blob_exists(repo, digest):  # the last PUT landed; only its answer was lost
                    break
        self.stats.blobs_uploaded.append(digest)

    def _upload_session(self, repo: str, digest: str, data: bytes | Path, chunk_size: int | None, what: str) -> None:
        size = len(data) if isinstance(data, bytes) else data.stat().st_size
        scopes = {push_scope(repo)}
        resp = self._request("POST", self._url(repo, "blobs", "uploads/"), scopes, ok=(202,), what=what)
        location = self._location(resp, what)
        octet = {"Content-Type": "application/octet-stream"}
        chunked = bool(chunk_size and size > chunk_size)
        if chunked:
            for start in range(0, size, chunk_size):
                end = min(start + chunk_size, size) - 1
                chunk = _slice(data, start, end + 1)
                resp = self._request("PATCH", location, scopes, body=chunk, ok=(202,), what=what, replay=False,
                                     headers={**octet, "Content-Range": f"{start}-{end}"})
                # distribution appends out-of-order chunks instead of refusing them: check ourselves.
                if resp.headers.get("Range") != f"0-{end}":
                    raise TransferError(f"{self.name}/{what}: registry holds {resp.headers.get('Range')!r} after sending bytes 0-{end}")
                location = self._location(resp, what)  # a new Location after every chunk
                self.stats.bytes_up += len(chunk)
            body: Body = b""
        else:
            body = data
        sep = "&" if "?" in location else "?"
        resp = self._request("PUT", f"{location}{sep}digest={quote(digest)}", scopes, body=body,
                             headers=octet, ok=(201,), what=what, replay=False)
        if not chunked:
            self.stats.bytes_up += size
        returned = resp.headers.get("Docker-Content-Digest")
        if returned and returned != digest:
            raise KilnError(f"{self.name}/{what}: registry computed {returned}")

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
                 ok: tuple[int, ...], what: str, stream: bool = False, replay: bool = True) -> requests.Response:
        """Send with authorisation; ``replay=False`` for requests inside an upload session.

        A transient failure left after the retries (or at once, without ``replay``) raises
        ``TransferError``; any other unexpected status a ``KilnError``.
        """
        attempt = 0
        while True:
            auth_headers = self.auth.headers(scopes)
            resp = self._send(method, url, {**(headers or {}), **auth_headers}, body, stream, replay)
            if resp.status_code != 401 or attempt >= 3:
                break
            resp.close()
            scopes = self.auth.retry_scopes(resp, scopes, bool(auth_headers), attempt)
            attempt += 1
        if resp.status_code not in ok:
            message = describe_failure(self.name, what, resp)
            wait = retry_after(resp)
            resp.close()
            if resp.status_code in RETRY_STATUS:
                raise TransferError(message, wait)
            raise KilnError(message)
        return resp

    def _send(self, method: str, url: str, headers: dict, body: Body, stream: bool,
              replay: bool = True) -> requests.Response:
        retries = self.policy.retries if replay and not callable(body) else 0
        for attempt in range(retries + 1):
            last = attempt == retries
            handle = None
            self.budget.check_deadline(f"{self.name}: {method} {_path(url)}")
            try:
                data: object = body
                if isinstance(body, Path):
                    handle = data = body.open("rb")
                    headers = {**headers, "Content-Length": str(body.stat().st_size)}
                elif callable(body):
                    data = body()
                self.stats.requests += 1
                resp = self.session.request(method, url, headers=headers, data=data, stream=stream,
                                            verify=self.verify, timeout=self.budget.timeouts(), allow_redirects=True)
            except requests.exceptions.SSLError as err:
                raise KilnError(tls_failure(self.endpoint, err)) from None
            except BROKEN_CONNECTION as err:
                if last:
                    raise TransferError(f"{self.name}: {connection_problem(self.endpoint.host, err, self.budget.limits)} "
                                        f"for {method} {_path(url)}"
                                        + (f" (after {attempt + 1} attempts)" if attempt else "")) from None
                self.budget.sleep(self.policy.delay(attempt))
                self.stats.retries += 1
                continue
            finally:
                if handle:
                    handle.close()
            if resp.status_code in RETRY_STATUS and not last:
                delay = self.policy.delay(attempt, retry_after(resp))
                resp.close()
                self.budget.sleep(delay)
                self.stats.retries += 1
                continue
            return resp
        raise AssertionError("unreachable")


def _slice(data: bytes | Path, start: int, end: int) -> bytes:
    if isinstance(data, bytes):
        return data[start:end]
    with data.open("rb") as handle:
        handle.seek(start)
        return handle.read(end - start)


def _path(url: str) -> str:
    """The URL without its query: upload locations carry opaque state worth not printing."""
    return url.split("?", 1)[0]
