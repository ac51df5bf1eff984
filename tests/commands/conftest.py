"""Fixtures of the command tests: the recording Docker Hub of the refusals before any work."""

from tests.support.refusals import hub  # noqa: F401  (a fixture)
