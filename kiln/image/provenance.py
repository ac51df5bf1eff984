"""Where the kiln that built an image came from: its git commit and its public repository URL.

Public API:
    kiln_version() -> str        the installed package's version (its metadata), "unknown" if not installed
    kiln_revision(repo=paths.REPO) -> (commit | None, dirty: bool)
    kiln_source_url(repo=paths.REPO) -> str | None     for ``org.opencontainers.image.source``

Both are best effort (no git binary, no repository: None) and never read a clock, so they do
not break reproducibility: two clones of the same commit give the same answers.
"""

from __future__ import annotations

from pathlib import Path

from kiln import paths


def kiln_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kiln")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"


def kiln_revision(repo: Path = paths.REPO) -> tuple[str | None, bool]:
    """The git commit kiln runs from and whether the work tree is dirty; (None, False) without git."""
    try:
        import git

        handle = git.Repo(repo, search_parent_directories=False)
        return handle.head.commit.hexsha, handle.is_dirty(untracked_files=False)
    except Exception:  # no git binary, not a repository, no commit yet: provenance is best effort
        return None, False


def kiln_source_url(repo: Path = paths.REPO) -> str | None:
    """``origin``'s URL for ``org.opencontainers.image.source``, or None.

    Only a network URL is a source anyone else can follow: a local path or ``file://`` origin (a
    clone of a clone) gives None. Credentials are stripped; ``git@host:owner/repo`` becomes
    ``https://host/owner/repo``.
    """
    try:
        import git

        url = git.Repo(repo, search_parent_directories=False).remotes.origin.url
    except Exception:
        return None
    return public_url(url)


def public_url(url: str) -> str | None:
    url = url.strip()
    if "://" in url:
        scheme, rest = url.split("://", 1)
        if scheme.lower() not in ("https", "http", "ssh", "git") or not rest or rest.startswith("/"):
            return None
        host, _, path = rest.partition("/")
        host = host.rsplit("@", 1)[-1]  # user:token@host
        return f"{scheme}://{host}/{path}" if host and path else None
    user_host, sep, path = url.partition(":")
    if sep and "@" in user_host and "/" not in user_host and path and not path.startswith("/"):
        return f"https://{user_host.rsplit('@', 1)[1]}/{path.removesuffix('.git')}"
    return None
