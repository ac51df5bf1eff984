"""Registry authorisation: ``Www-Authenticate`` challenges, Bearer tokens and Basic auth.

Public API:
    Challenge(scheme, params)  .realm .service .scopes .error
    parse_challenges(header) -> list[Challenge]
    normalise_scopes(scopes) -> frozenset[str]   merges actions per repository
    pull_scope(repo) / push_scope(repo) -> str
    RegistryAuth(host, session, verify=True, credentials=<looked up lazily>)
        .headers(scopes) -> dict        Authorization for this scope set ({} before any challenge)
        .retry_scopes(response, scopes, sent_auth, attempt) -> frozenset[str]
                                        learns from a 401; the scope set to retry with, or KilnError

The flow is Docker Hub's: a request goes out without credentials, the 401 names the scheme
(and for Bearer the realm, service and scope), a token is fetched for that scope set with the
registry credentials as Basic auth (or anonymously), and the request is retried. Tokens are
cached per normalised scope set; a 401 ``insufficient_scope`` whose challenge asks for more
(e.g. a cross-repo mount needing ``pull`` on the source) widens the set, so one token covers
every repository an operation touches.

Credentials, tokens and Authorization headers never appear in messages or logs (tokens are
registered with ``kiln.secrets`` as they come, so an echo of one is scrubbed too); credentials
go to a token service only over HTTPS when the registry itself is verified HTTPS.
"""

from __future__ import annotations

import base64
import re
import time
from dataclasses import dataclass

import requests

from kiln.errors import KilnError
from kiln.oci.credentials import Credentials, find_credentials
from kiln.secrets import register

_UNSET = object()
_PARAM = re.compile(r'\s*([A-Za-z][A-Za-z0-9_-]*)\s*=\s*("(?:[^"\\]|\\.)*"|[^\s,]*)\s*,?')
_SCHEME = re.compile(r"\s*,?\s*([A-Za-z][A-Za-z0-9_-]*)(?=\s|$)")


@dataclass(frozen=True)
class Challenge:
    scheme: str  # lower-case: "bearer", "basic"
    params: dict[str, str]

    @property
    def realm(self) -> str:
        return self.params.get("realm", "")

    @property
    def service(self) -> str | None:
        return self.params.get("service")

    @property
    def scopes(self) -> list[str]:
        return self.params.get("scope", "").split()

    @property
    def error(self) -> str | None:
        return self.params.get("error")


def parse_challenges(header: str) -> list[Challenge]:
    """Parse one ``Www-Authenticate`` value (it may hold several comma-separated challenges)."""
    challenges: list[Challenge] = []
    pos = 0
    while pos < len(header):
        scheme = _SCHEME.match(header, pos)
        if not scheme:
            break
        pos = scheme.end()
        params: dict[str, str] = {}
        while True:
            param = _PARAM.match(header, pos)
            if not param:
                break
            value = param.group(2)
            if value.startswith('"'):
                value = re.sub(r"\\(.)", r"\1", value[1:-1])
            params[param.group(1).lower()] = value
            pos = param.end()
        challenges.append(Challenge(scheme.group(1).lower(), params))
    return challenges


def pull_scope(repository: str) -> str:
    return f"repository:{repository}:pull"


def push_scope(repository: str) -> str:
    return f"repository:{repository}:pull,push"


def normalise_scopes(scopes) -> frozenset[str]:
    """``{"repository:a:pull", "repository:a:push,pull"}`` -> ``{"repository:a:pull,push"}``."""
    actions: dict[tuple[str, str], set[str]] = {}
    for scope in scopes:
        kind, _, rest = scope.partition(":")
        name, sep, acts = rest.rpartition(":")
        if not sep:  # "registry:catalog"-like scopes without actions are kept whole
            name, acts = rest, ""
        actions.setdefault((kind, name), set()).update(a for a in acts.split(",") if a)
    return frozenset(f"{kind}:{name}:{','.join(sorted(acts))}" for (kind, name), acts in actions.items())


class RegistryAuth:
    """Authorisation state for one registry host: its scheme, credentials and token cache."""

    def __init__(self, host: str, session: requests.Session, verify: bool = True,
                 credentials: Credentials | None | object = _UNSET):
        self.host = host
        self._session = session
        self._verify = verify
        self._credentials = credentials
        self._scheme: str | None = None
        self._bearer: Challenge | None = None
        self._tokens: dict[frozenset[str], tuple[str, float]] = {}
        self.token_requests = 0

    @property
    def credentials(self) -> Credentials | None:
        if self._credentials is _UNSET:
            self._credentials = find_credentials(self.host)
        return self._credentials  # type: ignore[return-value]

    def _who(self) -> str:
        return str(self.credentials) if self.credentials else "anonymous access"

    def headers(self, scopes) -> dict[str, str]:
        if self._scheme == "basic" and self.credentials:
            return {"Authorization": _basic(self.credentials)}
        if self._scheme == "bearer":
            return {"Authorization": f"Bearer {self._token(normalise_scopes(scopes))}"}
        return {}

    def retry_scopes(self, response: requests.Response, scopes, sent_auth: bool, attempt: int) -> frozenset[str]:
        scopes = normalise_scopes(scopes)
        challenges = parse_challenges(response.headers.get("Www-Authenticate", ""))
        bearer = next((c for c in challenges if c.scheme == "bearer"), None)
        basic = next((c for c in challenges if c.scheme == "basic"), None)
        if bearer:
            if not bearer.realm:
                raise KilnError(f"{self.host}: Bearer challenge without a realm; cannot authenticate")
            self._scheme, self._bearer = "bearer", bearer
            wanted = normalise_scopes([*scopes, *bearer.scopes])
            self._tokens.pop(scopes, None)
            if sent_auth and wanted == scopes and attempt > 0:
                raise KilnError(
                    f"{self.host}: access denied ({', '.join(sorted(scopes))}) for {self._who()}"
                    + ("" if self.credentials else "; log in or set KILN_REGISTRY_USER/KILN_REGISTRY_PASSWORD")
                )
            return wanted
        if basic:
            if sent_auth:
                raise KilnError(f"{self.host}: credentials rejected (HTTP 401) for {self._who()}")
            if not self.credentials:
                raise KilnError(
                    f"{self.host}: needs a login (Basic auth) and no credentials were found; "
                    "use `podman login`/`docker login` or set KILN_REGISTRY_USER/KILN_REGISTRY_PASSWORD"
                )
            self._scheme = "basic"
            return scopes
        raise KilnError(f"{self.host}: HTTP 401 without a Bearer or Basic challenge kiln understands")

    def _token(self, scopes: frozenset[str]) -> str:
        cached = self._tokens.get(scopes)
        if cached and cached[1] > time.monotonic():
            return cached[0]
        assert self._bearer is not None
        params: list[tuple[str, str]] = []
        if self._bearer.service:
            params.append(("service", self._bearer.service))
        params += [("scope", s) for s in sorted(scopes)]
        headers = {}
        if self.credentials:
            params.append(("account", self.credentials.username))
            headers["Authorization"] = _basic(self.credentials)
        realm = self._bearer.realm
        if self.credentials and self._verify and not realm.startswith("https://"):
            # The realm comes from the registry's answer: a TLS registry must not be able to
            # send a login in clear text elsewhere.
            raise KilnError(f"{self.host}: token service {realm} is not HTTPS; refusing to send "
                            f"credentials for {self._who()} there")
        try:
            self.token_requests += 1
            resp = self._session.get(realm, params=params, headers=headers, timeout=60,
                                     verify=self._verify if _same_host(realm, self.host) else True)
        except requests.RequestException as err:
            raise KilnError(f"{self.host}: token service {realm} unreachable ({err.__class__.__name__})") from None
        if resp.status_code in (401, 403):
            raise KilnError(f"{self.host}: token service {realm} refused {self._who()} (HTTP {resp.status_code})")
        if resp.status_code != 200:
            raise KilnError(f"{self.host}: token service {realm} answered HTTP {resp.status_code}")
        try:
            body = resp.json()
            token = body.get("token") or body.get("access_token")
            lifetime = float(body.get("expires_in") or 60)
        except (ValueError, AttributeError, TypeError):
            raise KilnError(f"{self.host}: token service {realm} did not answer token JSON") from None
        if not token or not isinstance(token, str):
            raise KilnError(f"{self.host}: token service {realm} answered without a token")
        register(token)  # a registry that echoes the Authorization header is scrubbed of it
        # Renew a little early so a long transfer does not start with a token about to lapse.
        self._tokens[scopes] = (token, time.monotonic() + max(lifetime - 10, 1))
        return token


def _basic(credentials: Credentials) -> str:
    raw = f"{credentials.username}:{credentials.password}".encode()
    return "Basic " + base64.b64encode(raw).decode()


def _same_host(url: str, host: str) -> bool:
    return url.split("://", 1)[-1].split("/", 1)[0] == host
