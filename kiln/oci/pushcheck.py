"""May a push go to a repository? Asked before any work (``build --push``).

Public API:
    check_push(client, repo)    a blob upload opened in ``repo`` (202: the registry answers, the
                                credentials get the push scope) and cancelled at once (best effort);
                                nothing is written. A ``KilnError`` otherwise (unreachable, 401, 403, ...)

The distribution API has no "may I push" request; opening an upload session is the cheapest one
that needs exactly the push scope, and its answer is the one a push would get.
"""

from __future__ import annotations

from kiln.errors import KilnError
from kiln.oci.auth import push_scope
from kiln.oci.registry import RegistryClient


def check_push(client: RegistryClient, repo: str) -> None:
    resp = client._request("POST", client._url(repo, "blobs", "uploads/"), {push_scope(repo)}, ok=(202,),
                           what=f"{repo} push check (open a blob upload)")
    location = resp.headers.get("Location")
    resp.close()
    if location:  # an abandoned session would linger until the registry's GC
        try:
            client._request("DELETE", client._absolute(location), {push_scope(repo)}, ok=(204, 404, 405),
                            what=f"{repo} cancel upload")
        except KilnError:
            pass
