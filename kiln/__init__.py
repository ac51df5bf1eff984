"""kiln: build-time patched vLLM images."""

__version__ = "0.1.0"
