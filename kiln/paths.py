"""Default locations of the repository's data files (overridable on the command line)."""

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PINS = REPO / "pins.toml"
PATCHSETS = REPO / "patchsets"
RECORD = PATCHSETS / "verdicts.toml"
IMAGES = REPO / "images"
DOCKERFILE = REPO / "Dockerfile"  # copied into every build context (build.py context)
