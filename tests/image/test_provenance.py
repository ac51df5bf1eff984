"""``org.opencontainers.image.source``: a URL anyone can follow, never a clone's local path."""

from __future__ import annotations

import pytest

from kiln.image.provenance import public_url


@pytest.mark.parametrize(("origin", "label"), [
    ("https://github.com/acme/kiln.git", "https://github.com/acme/kiln.git"),
    ("https://x-access-token:ghp_secret@github.com/acme/kiln", "https://github.com/acme/kiln"),
    ("git@github.com:acme/kiln.git", "https://github.com/acme/kiln"),
    ("ssh://git@gitlab.example.com/acme/kiln.git", "ssh://gitlab.example.com/acme/kiln.git"),
    ("  https://github.com/acme/kiln \n", "https://github.com/acme/kiln"),
    # what a clone of a clone has as origin: nothing another machine can reach
    ("/work/main", None),
    ("../kiln", None),
    ("file:///work/main", None),
    ("C:/src/kiln", None),
    ("https://github.com", None),
    ("ftp://example.com/acme/kiln", None),
])
def test_public_url(origin, label):
    assert public_url(origin) == label


def test_secrets_never_survive():
    for origin in ("https://user:hunter2@example.com/a/b", "https://tok@example.com/a/b", "u:p@example.com:a/b"):
        assert "hunter2" not in (public_url(origin) or "") and "tok@" not in (public_url(origin) or "")
