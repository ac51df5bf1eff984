"""Attestations of a built image: its SBOM, its signed SLSA provenance, both attached as OCI
referrers, and ``check``, which re-derives a pulled image from what they record (docs/TRUST.md)."""

from kiln.errors import KilnError


class Refused(KilnError):
    """An image ``check`` will not vouch for: its attestations or its bytes are not what they claim."""
