"""A blob download that continues where a broken connection left it (``Range``).

Public API:
    ResumableBlob(client, repo, digest, read_max)   .read(n), .close(), .received, .resumes

Used by ``RegistryClient.blob_stream``; the caller verifies the digest of the whole stream.
"""

from __future__ import annotations

import re

import requests

from kiln.oci.auth import pull_scope
from kiln.oci.failures import connection_problem
from kiln.oci.retry import BROKEN_CONNECTION, TransferError


class ResumableBlob:
    """A blob's bytes as one readable (compressed, as on the wire), across broken connections.

    When a read fails mid-body (a reset, a body cut short of its Content-Length, a timeout),
    the rest is requested with ``Range: bytes=<received>-``; a registry that answers 200
    instead is read from the start and the bytes already handed out are skipped. At most
    ``policy.retries`` resumes per blob; the caller still verifies the digest of the whole.
    """

    def __init__(self, client, repo: str, digest: str, read_max: int):
        self._client, self._repo, self._digest = client, repo, digest
        self._read_max = read_max
        self.received = 0  # bytes handed to the reader
        self.resumes = 0
        self._total: int | None = None
        self._offset = 0  # blob offset of the current response's next byte
        self._resp = self._open()

    def _open(self) -> requests.Response:
        client = self._client
        headers = {"Range": f"bytes={self.received}-"} if self.received else None
        resp = client._request("GET", client._url(self._repo, "blobs", self._digest), {pull_scope(self._repo)},
                               headers=headers, ok=(200, 206), stream=True, what=f"{self._repo}@{self._digest}")
        if resp.status_code == 206:
            start, total = _content_range(resp.headers.get("Content-Range", ""))
            if start != self.received:
                resp.close()
                raise TransferError(f"{client.name}/{self._repo}@{self._digest}: asked for bytes from "
                                    f"{self.received}, the registry sent from {start}")
            self._offset, self._total = start, total if total is not None else self._total
        else:
            self._offset = 0
            length = resp.headers.get("Content-Length", "")
            self._total = int(length) if length.isdigit() else self._total
        return resp

    def read(self, n: int = -1) -> bytes:
        size = self._read_max if n is None or n < 0 else min(n, self._read_max)
        while True:
            try:
                data = self._resp.raw.read(size, decode_content=False)
            except BROKEN_CONNECTION as err:
                self._resume(connection_problem(self._client.endpoint.host, err, self._client.budget.limits))
                continue
            if not data:
                if self._total is not None and self._offset < self._total:
                    self._resume(f"body ended at byte {self._offset} of {self._total}")
                    continue
                return b""
            start, self._offset = self._offset, self._offset + len(data)
            if start < self.received:  # a 200 answer to a resume: skip what was handed out
                data = data[self.received - start:]
                if not data:
                    continue
            self.received += len(data)
            self._client.stats.bytes_down += len(data)
            return data

    def _resume(self, why: str) -> None:
        self._resp.close()
        client = self._client
        if self.resumes >= client.policy.retries:
            raise TransferError(f"{client.name}/{self._repo}@{self._digest}: download broken ({why}) after "
                                f"{self.received} bytes and {self.resumes} resumes; giving up")
        client.budget.sleep(client.policy.delay(self.resumes))
        self.resumes += 1
        client.stats.resumes += 1
        self._resp = self._open()

    def close(self) -> None:
        self._resp.close()


def _content_range(value: str) -> tuple[int | None, int | None]:
    """``bytes 10-99/100`` -> (10, 100); the total may be ``*``."""
    match = re.fullmatch(r"\s*bytes\s+(\d+)-\d+/(\d+|\*)\s*", value)
    if not match:
        return None, None
    return int(match.group(1)), None if match.group(2) == "*" else int(match.group(2))
