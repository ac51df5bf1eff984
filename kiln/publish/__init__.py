"""Where a built image goes: every output is a publisher over the one ``BuiltImage``.

Public API:
    Publisher          ``kind``, ``check(inputs)`` before any work, ``stage(image) -> Staged``,
                       ``where(image) -> str`` once committed
    publish(image, publishers, budget=None) -> dict[kind, where]
    check_outputs(publishers, inputs=(), budget=None)   every destination checked
                                           (``kiln.publish.destinations``: never an input, a special
                                           file, inside another layout), and checked distinct; a push
                                           destination is probed (reachable, takes a push)

The publishers (ko's multi-publisher, go-containerregistry's writers):
    registry.RegistryPublisher    push: blobs, then the manifest per tag
    layout.LayoutPublisher        an OCI image layout, added to (never replaced)
    archive.ArchivePublisher      a docker-archive tarball (``podman load``)
    context.ContextPublisher      a Dockerfile build context
    values.ValuesPublisher        the image's Helm values
    tree.stage_tree               ``apply``: the patched ``vllm/`` tree and its report

``publish`` stages every output (complete, not visible; a push uploads its blobs), then commits
them together with the push's manifest PUT last (``kiln.staging.commit_all``): when anything
fails, the local outputs already committed are rolled back, so a tag never names a build whose
other outputs failed, and no output is left half-written.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from kiln.oci.limits import Budget
from kiln.publish.destinations import Input, check_distinct, check_output_path
from kiln.staging import Staged, commit_all, discard_all


class Publisher:
    """One output of a build. Subclasses set ``kind`` and implement ``stage`` and ``where``."""

    kind: str = ""
    option: str = ""  # the command-line option naming the destination, for errors
    path: Path | None = None  # a local destination, checked before any work
    directory: bool = False  # the destination is a directory (else a file)
    last: bool = False  # committed after every local output (the registry push)
    budget: Budget | None = None  # the command's limits, set by ``publish``: a wait ends at its deadline

    def check(self, inputs: Sequence[Input] = ()) -> None:
        """Refuse a destination that cannot be written or touches an input, before any pull or patch."""
        if self.path is not None:
            self.path = check_output_path(self.path, self.option, self.directory, inputs)

    def stage(self, image) -> Staged:
        raise NotImplementedError

    def where(self, image) -> str:
        raise NotImplementedError


def check_outputs(publishers: list[Publisher], inputs: Sequence[Input] = (), budget: Budget | None = None) -> None:
    """Check each destination (against ``inputs`` too), then that no two share a place; a
    registry destination is asked whether it takes a push (within ``budget``'s limits)."""
    for publisher in publishers:
        publisher.budget = budget
    local = [p for p in publishers if not p.last]
    for publisher in local:
        publisher.check(inputs)
    check_distinct((p.option, p.path) for p in publishers if p.path is not None)
    for publisher in publishers:  # the push last: no request while a local destination is wrong
        if publisher.last:
            publisher.check(inputs)


def publish(image, publishers: list[Publisher], budget: Budget | None = None) -> dict[str, str]:
    """Stage every output, then commit them all (the push last), or none; nothing is committed
    once ``budget``'s deadline has passed."""
    ordered = [p for p in publishers if not p.last] + [p for p in publishers if p.last]
    stages: list[Staged] = []
    try:
        for publisher in ordered:
            publisher.budget = budget
            stages.append(publisher.stage(image))
        if budget is not None:
            budget.check_deadline("publish (every output staged, none committed)")
    except BaseException:
        discard_all(stages)
        raise
    commit_all(stages)
    return {publisher.kind: publisher.where(image) for publisher in ordered}
