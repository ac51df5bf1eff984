"""One line for each way talking to a registry fails, with a hint that works when followed.

Public API:
    connection_problem(host, err, limits=None) -> str    unreachable / DNS / reset / timed out / broken
                                            (a timeout names its limit and how to raise it)
    tls_failure(endpoint, err) -> str       plain HTTP spoken where TLS was expected, or an untrusted certificate
    describe_failure(registry, what, resp) -> str   an HTTP error status, with the registry's error codes
"""

from __future__ import annotations

import re

import requests

from kiln.oci.endpoints import Endpoint
from kiln.oci.limits import Limits, seconds_text

_CERT_PROBLEM = re.compile(r"certificate verify failed: ([^(]*?)\s*\(|hostname mismatch|self.signed certificate")
# What OpenSSL says when the other side answers a TLS handshake in plain HTTP.
_PLAIN_HTTP = re.compile(r"wrong version number|record layer failure|packet length too long|unknown protocol|"
                         r"http request", re.IGNORECASE)
_DNS = re.compile(r"NameResolutionError|Failed to resolve|Name or service not known|nodename nor servname|"
                  r"Temporary failure in name resolution|No address associated with hostname|getaddrinfo failed")


def connection_problem(host: str, err: Exception, limits: Limits | None = None) -> str:
    text = str(err)
    limits = limits or Limits()
    if _DNS.search(text):
        return f"cannot resolve host {host.rsplit(':', 1)[0] if not host.startswith('[') else host} (DNS lookup failed)"
    if isinstance(err, requests.exceptions.ConnectTimeout) or "connect timeout" in text.lower():
        return (f"unreachable (no connection within the connect timeout of {seconds_text(limits.connect_timeout)}; "
                f"{limits.raise_hint('connect_timeout')})")
    if "NewConnectionError" in text or "refused" in text:
        return f"unreachable ({err.__class__.__name__})"
    lowered = text.lower()
    # the peer closed the connection: seen as a reset, or (mid-send) as a broken pipe or abort
    if any(sign in lowered for sign in ("reset", "broken pipe", "connection aborted", "remote end closed")):
        return "connection reset"
    if isinstance(err, requests.exceptions.ReadTimeout) or "Read timed out" in text:
        return (f"no answer within the read timeout of {seconds_text(limits.read_timeout)} "
                f"({limits.raise_hint('read_timeout')})")
    return f"connection broken ({err.__class__.__name__})"


def tls_failure(endpoint: Endpoint, err: Exception) -> str:
    """One line, with the option that fixes it; the exception text holds URLs and is left out."""
    host = endpoint.host
    text = str(err)
    if _PLAIN_HTTP.search(text):
        return (f"{host}: the registry answers in plain HTTP, not TLS; mark it insecure: "
                f"--insecure-registry {host} (or write the mirror as http://{host})")
    match = _CERT_PROBLEM.search(text)
    reason = (match.group(1) or match.group(0)).strip() if match else "TLS handshake failed"
    return (f"{host}: TLS certificate not trusted ({reason}); add its CA to the system trust store "
            f"(or REQUESTS_CA_BUNDLE), or skip verification: --insecure-registry https://{host}")


def describe_failure(registry: str, what: str, resp: requests.Response) -> str:
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
