"""Fixtures of the publish tests: those of the refusals before any work."""

from tests.support.refusals import hub, workspace  # noqa: F401  (fixtures)
