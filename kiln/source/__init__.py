"""Pristine vLLM source per pin: from the release wheel on PyPI, or (later) from the image."""

from kiln.source.tree import SourceProvider, SourceTree

__all__ = ["SourceProvider", "SourceTree"]
