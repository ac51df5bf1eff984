"""What several test packages share: the real registry and its fixtures, the fault proxy,
build subprocesses, reliability checks, and test-only image definitions (``images/``).

Test-only definitions exist for unit-level checks on a small vLLM-shaped base; end-to-end,
reproducibility and benchmark runs use the shipped ``images/*.toml``.
"""

from pathlib import Path

TEST_IMAGES = Path(__file__).parent / "images"
