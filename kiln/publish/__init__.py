"""Where a built image goes: every output is a publisher over the one ``BuiltImage``.

Public API:
    Publisher          ``kind``, ``check()`` before any work, ``stage(image) -> Staged``,
                       ``where(image) -> str`` once committed
    publish(image, publishers) -> dict[kind, where]
    check_outputs(publishers)          every destination checked, and checked distinct
    check_output_path(path, option, directory) -> Path

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

import os
from pathlib import Path

from kiln.errors import KilnError
from kiln.staging import Staged, commit_all, discard_all, remove_dead_stages, stage_file


class Publisher:
    """One output of a build. Subclasses set ``kind`` and implement ``stage`` and ``where``."""

    kind: str = ""
    option: str = ""  # the command-line option naming the destination, for errors
    path: Path | None = None  # a local destination, checked before any work
    directory: bool = False  # the destination is a directory (else a file)
    last: bool = False  # committed after every local output (the registry push)

    def check(self) -> None:
        """Refuse a destination that cannot be written, before any pull or patch."""
        if self.path is not None:
            self.path = check_output_path(self.path, self.option, self.directory)

    def stage(self, image) -> Staged:
        raise NotImplementedError

    def where(self, image) -> str:
        raise NotImplementedError


def check_output_path(path: Path, option: str, directory: bool) -> Path:
    """``path`` resolved, after checking it can be written and renamed into place.

    The nearest existing ancestor must be a directory kiln can create and rename entries in
    (tested with a throw-away file there, removed at once); an existing ``path`` must be a
    directory for a directory output and not one for a file output. Dead staging leftovers of
    killed runs beside ``path`` are removed.
    """
    resolved = path.expanduser().resolve()
    ancestor = resolved.parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise KilnError(f"{option} {path}: {ancestor} is not a directory")
    if resolved.exists():
        if directory and not resolved.is_dir():
            raise KilnError(f"{option} {path}: exists and is not a directory")
        if not directory and resolved.is_dir():
            raise KilnError(f"{option} {path}: is a directory; a file path is expected")
    try:
        probe = stage_file(ancestor / resolved.name)
        try:
            os.rename(probe, probe.with_name(probe.name + "x"))
            probe = probe.with_name(probe.name + "x")
        finally:
            probe.unlink(missing_ok=True)
    except OSError as err:
        raise KilnError(f"{option} {path}: cannot write in {ancestor} ({err.strerror})") from None
    if resolved.parent.is_dir():
        remove_dead_stages(resolved.parent)
    return resolved


def check_outputs(publishers: list[Publisher]) -> None:
    """Check each destination, then that no two outputs of one build write the same place."""
    for publisher in publishers:
        publisher.check()
    local = [p for p in publishers if p.path is not None]
    for i, first in enumerate(local):
        for second in local[i + 1:]:
            a, b = first.path, second.path
            if a == b or a in b.parents or b in a.parents:
                raise KilnError(f"{first.option} {a} and {second.option} {b}: two outputs of one build "
                                "cannot write the same place")


def publish(image, publishers: list[Publisher]) -> dict[str, str]:
    """Stage every output, then commit them all (the push last), or none."""
    ordered = [p for p in publishers if not p.last] + [p for p in publishers if p.last]
    stages: list[Staged] = []
    try:
        for publisher in ordered:
            stages.append(publisher.stage(image))
    except BaseException:
        discard_all(stages)
        raise
    commit_all(stages)
    return {publisher.kind: publisher.where(image) for publisher in ordered}
