"""The config labels (and manifest annotations) every kiln image carries, by key.

The daemonless build sets them (``kiln.image.prepare``), the Dockerfile context passes them as
build args (``kiln.publish.context``), ``build.py values`` checks them on a pushed image.
"""

BASE_NAME = "org.opencontainers.image.base.name"
BASE_DIGEST = "org.opencontainers.image.base.digest"
VERSION = "org.opencontainers.image.version"  # the image's tag
REVISION = "org.opencontainers.image.revision"  # kiln's git commit
SOURCE = "org.opencontainers.image.source"  # kiln's repository URL (never a local path)
REF_NAME = "org.opencontainers.image.ref.name"  # an OCI layout index entry's name

IMAGE = "io.kiln.image"  # the image definition's name
PIN = "io.kiln.pin"
SM = "io.kiln.sm"
PATCHES = "io.kiln.patches"  # the patches applied, comma-separated
VLLM = "io.kiln.vllm"  # the vLLM version patched

ALL = (BASE_NAME, BASE_DIGEST, VERSION, REVISION, SOURCE, IMAGE, PIN, SM, PATCHES, VLLM)
