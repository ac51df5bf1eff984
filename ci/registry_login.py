"""CI's registry login: write the destination registry's credentials where kiln reads them.

    .venv/bin/python ci/registry_login.py REPOSITORY

The workflow's login step (``.github/workflows/kiln.yml``) runs this with the secrets in its
environment; nothing else sees them. It adds one ``auths`` entry for REPOSITORY's registry to
the Docker auth file (``$DOCKER_CONFIG/config.json``, else ``~/.docker/config.json``), the
file ``docker login`` writes and kiln reads (``kiln.oci.credentials``), so the credentials go
to that registry only, never to the base image's.

Which credentials:
- ``KILN_REGISTRY_USER`` and ``KILN_REGISTRY_PASSWORD`` (secrets) when set;
- else, for ghcr.io, the job's ``GITHUB_TOKEN`` as ``GITHUB_ACTOR`` (the job needs
  ``packages: write``): a fork pushes to ghcr.io/<owner>/... with no secret at all;
- else one line saying which secret to set, exit 1.
"""

from __future__ import annotations

import base64
import json
import os
import sys
from pathlib import Path

from kiln.errors import KilnError
from kiln.oci.reference import parse_reference
from kiln.staging import write_atomic

HUB_KEY = "https://index.docker.io/v1/"  # where the Docker CLI keeps Docker Hub's entry
SETTINGS = "Settings > Secrets and variables > Actions"


def credentials(registry: str, env: dict[str, str]) -> tuple[str, str]:
    user, password = env.get("KILN_REGISTRY_USER", ""), env.get("KILN_REGISTRY_PASSWORD", "")
    if user and password:
        return user, password
    if user or password:
        missing = "KILN_REGISTRY_PASSWORD" if user else "KILN_REGISTRY_USER"
        raise KilnError(f"secret {missing} is not set ({SETTINGS}), but its pair is: both are needed to push to {registry}")
    if registry == "ghcr.io" and env.get("GITHUB_TOKEN"):
        return env.get("GITHUB_ACTOR") or "github-actions", env["GITHUB_TOKEN"]
    raise KilnError(f"secrets KILN_REGISTRY_USER and KILN_REGISTRY_PASSWORD are not set ({SETTINGS}): they are "
                    f"needed to push to {registry} (ghcr.io needs none: the job's GITHUB_TOKEN is used)")


def auth_file(env: dict[str, str]) -> Path:
    config = env.get("DOCKER_CONFIG")
    return Path(config) / "config.json" if config else Path.home() / ".docker" / "config.json"


def login(repository: str, env: dict[str, str]) -> Path:
    """Add REPOSITORY's registry credentials to the auth file; return its path."""
    registry = parse_reference(repository).registry
    user, password = credentials(registry, env)
    path = auth_file(env)
    try:
        config = json.loads(path.read_text()) if path.is_file() else {}
    except json.JSONDecodeError as err:
        raise KilnError(f"{path}: not JSON ({err.msg}, line {err.lineno})") from None
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    config.setdefault("auths", {})[HUB_KEY if registry == "docker.io" else registry] = {"auth": token}
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    write_atomic(path, (json.dumps(config, indent=2) + "\n").encode())
    path.chmod(0o600)
    return path


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not argv[0]:
        sys.stderr.write("usage: ci/registry_login.py REPOSITORY\n")
        return 2
    try:
        path = login(argv[0], dict(os.environ))
    except KilnError as err:
        print(f"::error::{err}")  # a GitHub annotation; the one line of the failed step
        return 1
    print(f"logged in to {parse_reference(argv[0]).registry} for {argv[0]} ({path})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
