"""Where kiln's data lives: the repository's files, overridable on the command line.

Public API:
    REPO, PINS, PATCHSETS, RECORD, IMAGES, DOCKERFILE    the defaults (this checkout)
    RepoFiles(pins, patchsets, record, images)           one set of them, as a command uses it
"""

from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PINS = REPO / "pins.toml"
PATCHSETS = REPO / "patchsets"
RECORD = PATCHSETS / "verdicts.toml"
IMAGES = REPO / "images"
DOCKERFILE = REPO / "Dockerfile"  # copied into every build context (build.py context)


@dataclass(frozen=True)
class RepoFiles:
    """The pins file, the patch catalogue, the verdict record and the image definitions."""

    pins: Path = PINS
    patchsets: Path = PATCHSETS
    record: Path = RECORD
    images: Path = IMAGES
