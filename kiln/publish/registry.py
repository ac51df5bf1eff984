"""``build --push``: the image into a registry, blobs first, the manifest (the tag) last.

Public API:
    RegistryPublisher(destination, tags, config, reporter=SILENT)
    PushReport        what a push did (uploaded / mounted / present blobs, bytes)

``check`` (before any work) opens a blob upload in the destination repository and cancels it:
an unreachable registry or missing push rights fail the build before its pull.
Staging uploads (or mounts, or finds) every blob (kiln's layers read from a registry build
cache on the same host are mounted from the cache's repository), the attestations' too; committing PUTs the
image manifest by digest, its attestations (OCI 1.1 artifacts whose ``subject`` is it: through
the referrers API, or the ``sha256-<hex>`` referrers tag where the registry has none), then the
manifest once per tag,
byte-exact, and ``publish`` does that after every local output is committed: no tag can name
an incomplete image, or an image whose other outputs failed. The push goes to the registry the
destination names, never to a pull mirror standing in for it; the reported place names the
host actually contacted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kiln.attest.referrers import merged_index, referrers_tag
from kiln.errors import KilnError
from kiln.image.image import BuiltIndex, parts
from kiln.oci.endpoints import RegistryConfig
from kiln.oci.mediatypes import OCI_INDEX
from kiln.oci.pushcheck import check_push
from kiln.oci.reference import ImageReference
from kiln.oci.registry import RegistryClient, TransferStats
from kiln.pausepoint import pause_point
from kiln.publish import Publisher
from kiln.report import SILENT, Reporter
from kiln.staging import Staged

_CHUNKED_ABOVE = 512 << 20  # bigger blobs are pushed in PATCH chunks of this size


@dataclass
class PushReport:
    repository: str
    digest: str
    tags: list[str]
    uploaded: list[str] = field(default_factory=list)
    mounted: list[str] = field(default_factory=list)
    present: list[str] = field(default_factory=list)
    bytes_uploaded: int = 0


class RegistryPublisher(Publisher):
    kind = "push"
    option = "--push"
    last = True

    def __init__(self, destination: ImageReference, tags: list[str], config: RegistryConfig,
                 reporter: Reporter = SILENT):
        if not tags:
            raise KilnError(f"{destination.name}: nothing to push, no tag given")
        self.destination = destination
        self.tags = list(tags)
        self.config = config
        self.reporter = reporter
        self.client: RegistryClient | None = None
        self.report: PushReport | None = None

    def check(self, inputs=()) -> None:
        """The destination takes a push, checked before any pull or patch: a registry that does not
        answer, or credentials without push rights, fail here in one line, not after the build."""
        super().check(inputs)
        endpoint = self.config.endpoint(self.destination.registry, push=True)
        client = RegistryClient(endpoint, stats=TransferStats(), budget=self.budget)
        try:
            check_push(client, self.destination.repository)
        except KilnError as err:
            raise KilnError(f"--push to {self.destination.name}: cannot push there: {err}") from None

    def _client_for(self, image) -> tuple[RegistryClient, str | None]:
        """A client for the destination; when it is the host the base came from (through a
        mirror, say), it shares the base client's session, tokens and stats, and blobs are
        mounted from the base repository. Either way its errors name the destination registry."""
        prepared = image.prepared
        endpoint = self.config.endpoint(self.destination.registry, push=True)
        base_client = prepared.client
        if base_client.endpoint.host == endpoint.host and base_client.endpoint.scheme == endpoint.scheme:
            client = RegistryClient(endpoint, session=base_client.session, auth=base_client.auth,
                                    stats=base_client.stats, budget=base_client.budget)
            return client, prepared.base_ref.repository
        return RegistryClient(endpoint, stats=TransferStats(), budget=base_client.budget), None

    def stage(self, image) -> Staged:
        """Every blob of every platform's image (an index's, or the one) confirmed; the commit PUTs
        each platform's manifest by digest with its referrers, the index by digest, then the tags."""
        client, mount_from = self._client_for(image)
        self.client = client
        repository = self.destination.repository
        manifest = image.manifest
        report = PushReport(repository, manifest.digest, list(self.tags))
        for part in parts(image):
            self._push_blobs(part, client, mount_from, report)
        # Every blob is now confirmed (HEAD 200, mount 201 or upload 201): tags may name it.
        pause_point("push")
        self.report = report

        def put_manifests():
            pause_point("commit")  # the local outputs are committed by now (this one is last)
            for part in parts(image):  # each image by digest, its referrers, then the index and the tags
                if part.attestations or part is not image:
                    part_manifest = part.manifest
                    client.put_manifest(repository, part_manifest.digest, part_manifest.data, part_manifest.media_type)
                    if part.attestations:
                        self._attach(client, repository, part_manifest.digest, part.attestations)
            if isinstance(image, BuiltIndex):
                client.put_manifest(repository, manifest.digest, manifest.data, manifest.media_type)
            for tag in self.tags:
                client.put_manifest(repository, tag, manifest.data, manifest.media_type)
            report.bytes_uploaded += len(manifest.data) * len(self.tags)
            return lambda: None  # a tag cannot be taken back; it is committed last for that reason

        return Staged(None, None, on_commit=put_manifests)

    def _push_blobs(self, image, client: RegistryClient, mount_from: str | None, report: PushReport) -> None:
        """One platform's image's blobs and its attestations' into the destination repository."""
        repository, blobs = self.destination.repository, image.blobs
        descriptors = image.model.blobs()
        from_cache = self._cache_mount(image, client)
        # The task counts bytes sent: a blob mounted or already there moves none, so it leaves the
        # total instead of being counted as pushed (the plain line says how many of each).
        remaining = sum(d.size for d in descriptors)
        with self.reporter.task(f"push {repository}", total=remaining) as task:
            for descriptor in descriptors:
                digest = descriptor.digest
                if client.blob_exists(repository, digest):
                    report.present.append(digest)
                elif mount_from and not blobs.is_new(digest) and client.mount_blob(repository, digest, mount_from):
                    report.mounted.append(digest)
                elif digest in from_cache and client.mount_blob(repository, digest, from_cache[digest]):
                    report.mounted.append(digest)
                else:
                    path = blobs.path(descriptor)
                    chunk = _CHUNKED_ABOVE if descriptor.size > _CHUNKED_ABOVE else None
                    client.upload_blob(repository, digest, path, chunk_size=chunk)
                    report.uploaded.append(digest)
                    report.bytes_uploaded += descriptor.size
                    task.advance(descriptor.size)
                    continue
                remaining -= descriptor.size
                task.update(total=remaining)
            task.update(description=f"push {repository} ({_blobs(len(report.uploaded))} uploaded, "
                                    f"{len(report.mounted)} mounted, {len(report.present)} already there)")
        for artifact in image.attestations:  # the SBOM and provenance: small, uploaded unless present
            for descriptor in artifact.descriptors():
                if not client.blob_exists(repository, descriptor.digest):
                    client.upload_blob(repository, descriptor.digest, artifact.blobs[descriptor.digest])
                    report.uploaded.append(descriptor.digest)
                    report.bytes_uploaded += descriptor.size

    def _cache_mount(self, image, client: RegistryClient) -> dict[str, str]:
        """kiln's layers read from a registry build cache on this host: digest -> the cache repository
        to mount them from (``POST ?mount=&from=``) rather than upload them again."""
        built = {layer.digest for layer in image.layers}
        return {digest: where.repository for digest, where in image.prepared.cache_mounts.items()
                if digest in built and self.config.endpoint(where.registry, push=True).host == client.endpoint.host}

    @staticmethod
    def _attach(client: RegistryClient, repository: str, digest: str, artifacts: list) -> None:
        """PUT each artifact by digest; without a referrers API, add them to the ``sha256-<hex>`` index."""
        for artifact in artifacts:
            client.put_manifest(repository, artifact.manifest.digest, artifact.manifest.data,
                                artifact.manifest.media_type)
        if client.referrers(repository, digest) is None:
            tag = referrers_tag(digest)
            index = merged_index(client.find_manifest(repository, tag), artifacts)
            client.put_manifest(repository, tag, index, OCI_INDEX)

    def where(self, image) -> str:
        host = self.client.endpoint.host if self.client else self.destination.registry
        via = "" if host == self.destination.registry else f" (pushed to {host})"
        return f"{self.destination.name}:{self.tags[0]}@{image.manifest.digest}{via}"


def _blobs(count: int) -> str:
    return f"{count} blob{'' if count == 1 else 's'}"
