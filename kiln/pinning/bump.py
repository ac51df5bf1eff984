"""The preflight of ``build.py pin bump --to REF``: what moving the pins to a new vLLM changes.

The maintainers' loop: a release (``0.33.0``) or an image (``docker.io/vllm/vllm-openai:v0.33.0``)
appears. Every patch of the catalogue is evaluated on the current pin's pristine source and on
the candidate's (isolated mode, as ``verify`` does) and the report says what the bump changes:
newly ``UPSTREAM`` (retire the patch), ``DRIFTED`` / ``TARGET_GONE`` (re-anchor it), and the
*retire impact*: patches whose ``requires`` stops applying, and ``perf_critical`` patches that
stop applying. Every image definition is also run as it would be built on the candidate. The
preflight fails (exit 1) on any retire impact, on an image built on every pin that would break,
and on an image that names the pin the bump would drop (unless ``--update-images``: the candidate
then takes that pin's place in the image's ``pins``, and the image is judged on it). A candidate
older than the current pin is a downgrade: ``Preflight.downgrade``, a warning.

``--upstream-tests`` adds vLLM's own tests on the candidate's CPU build (``kiln.pinning.upstream``).

``--write`` then rotates the pins and records the candidate's verdicts (``kiln.pinning.rotate``).

Public API:
    Candidate                      the pin a bump adds, with the pristine tree it was judged on
    resolve_candidate(ref, current, pins, pins_path, config, name=None, cuda=None, reporter=SILENT)
        -> Candidate
    default_pin_name(reference, version) -> str   ``dev424`` for a nightly, else the tag
    run_preflight(catalogue, images, current, rollback, old_tree, candidate, memo=None, update_images=False)
        -> Preflight
    Preflight                      .rows, .retire, .reanchor, .requires_impact, .perf_lost, .downgrade,
                                   .updated_images,
                                   .images, .failures, .blockers, .upstream, .add_upstream(check),
                                   .to_json()
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from packaging.version import InvalidVersion, Version

from kiln.definitions import ImageDefinition
from kiln.errors import KilnError
from kiln.oci.endpoints import RegistryConfig
from kiln.oci.reference import ImageReference, parse_reference
from kiln.patch.catalog import Catalogue
from kiln.patch.engine import Session, run_isolated, run_selection
from kiln.patch.memo import VerdictMemo
from kiln.patch.outcome import BuildTarget, Outcome, Verdict
from kiln.pinning.lock import resolve_pin
from kiln.pinning.upstream import UpstreamCheck
from kiln.pins import Pin, check_cuda, check_pin_name
from kiln.report import SILENT, Reporter
from kiln.source.image import ImageSource
from kiln.source.tree import SourceTree
from kiln.source.wheel import WheelSource
from kiln.verify import provider_for_pin

RELEASE_IMAGE = "docker.io/vllm/vllm-openai:v{version}"  # where vLLM publishes a release's image


# -- the candidate ------------------------------------------------------------------------------


@dataclass
class Candidate:
    ref: str  # what --to said
    name: str  # the new pin's name, e.g. "v0.33.0"
    image: str  # the new pin's image reference
    vllm: Version  # from the wheel's version, or the image's dist-info
    cuda: str
    digest: str  # "" when the image could not be resolved (release REF only)
    digest_note: str  # how the digest was obtained, or why it was not
    tree: SourceTree
    from_image: bool  # True: --to named an image, and sources are read from images

    def pin(self) -> Pin:
        return Pin(self.name, "current", self.image, self.vllm, self.cuda, self.digest)

    def to_json(self) -> dict:
        return {"ref": self.ref, "name": self.name, "image": self.image, "vllm": str(self.vllm),
                "cuda": self.cuda, "digest": self.digest or None, "digest_note": self.digest_note,
                "source": self.tree.origin}


def release_version(ref: str) -> Version | None:
    """``0.33.0`` / ``v0.33.0`` is a release; anything with a registry path is an image."""
    if any(c in ref for c in "/:@"):
        return None
    try:
        return Version(ref)
    except InvalidVersion:
        return None


def default_pin_name(reference: ImageReference, version: Version) -> str:
    """The new pin's name when ``--name`` is not given; it ends every tag built on the pin.

    A nightly (``vllm/vllm-openai:nightly-3f5a1e173…`` carrying ``0.23.1rc1.dev424+g3f5a1e173``)
    is named by its dev number, ``dev424``, so tags read ``cu130-sm120-dev424``; another image
    by its tag; an untagged one by its version.
    """
    if version.dev is not None:
        return f"dev{version.dev}"
    if reference.tag and reference.tag != "latest":
        return reference.tag
    return f"v{version}".replace("+", "-")


def _check_name(name: str, current: Pin, pins: dict[str, Pin], path: Path) -> str:
    check_pin_name(name, "--name")
    if name in pins:
        what = "the current pin" if name == current.name else "a pin"
        raise KilnError(f"pin {name!r} is already {what} in {path}; bump to another release/image or pass --name")
    return name


def resolve_candidate(ref: str, current: Pin, pins: dict[str, Pin], pins_path: Path, config: RegistryConfig,
                      name: str | None = None, cuda: str | None = None, reporter: Reporter = SILENT) -> Candidate:
    """Fetch the candidate's pristine source and decide the new pin's fields."""
    if cuda is not None:
        check_cuda(cuda, "--cuda")
    cuda = cuda or current.cuda
    version = release_version(ref)
    if version is not None:
        name = _check_name(name or f"v{version}", current, pins, pins_path)
        try:
            tree = WheelSource(version, reporter=reporter).fetch()
        except KilnError as err:
            raise KilnError(f"--to {ref}: {err}") from None
        image = RELEASE_IMAGE.format(version=version)
        try:
            digest = resolve_pin(Pin(name, "current", image, version, cuda, ""), config)
            note = f"resolved {image}"
        except KilnError as err:
            digest, note = "", f"not locked ({err}); run `build.py pin lock {name}` once it is reachable"
        return Candidate(ref, name, image, version, cuda, digest, note, tree, from_image=False)

    reference = parse_reference(ref)
    if name is not None:
        _check_name(name, current, pins, pins_path)
    try:
        found = ImageSource(reference, registry_config=config, reporter=reporter).pull()
    except KilnError as err:
        raise KilnError(f"--to {ref}: {err}") from None
    version = found.tree.vllm_version
    name = _check_name(name or default_pin_name(reference, version), current, pins, pins_path)
    return Candidate(ref, name, str(reference), version, cuda, found.digest, f"resolved {reference}",
                     found.tree, from_image=True)


def old_pin_tree(current: Pin, candidate: Candidate, config: RegistryConfig,
                 reporter: Reporter = SILENT) -> SourceTree:
    """The current pin's pristine source, read the way the candidate's was (wheel or image)."""
    try:
        if not candidate.from_image:  # as verify reads it: its wheel, or its image for a nightly
            return provider_for_pin(current, config, reporter).fetch()
        reference: ImageReference = parse_reference(current.image)
        if current.digest:
            reference = reference.pinned(current.digest)
        return ImageSource(reference, expected_version=current.vllm, registry_config=config,
                           reporter=reporter).fetch()
    except KilnError as err:
        raise KilnError(f"pin {current.name}: {err}") from None


# -- the preflight ------------------------------------------------------------------------------


@dataclass
class PatchRow:
    patch: str
    family: str
    perf_critical: bool
    old: Outcome
    new: Outcome
    action: str  # keep | new | retire | retired | re-anchor | blocked | gated | -

    def to_json(self) -> dict:
        return {"patch": self.patch, "family": self.family, "perf_critical": self.perf_critical,
                "old": str(self.old.verdict), "old_detail": self.old.detail,
                "new": str(self.new.verdict), "new_detail": self.new.detail, "action": self.action}


@dataclass
class ImageImpact:
    image: str
    path: str
    pins: list[str]  # [] = built on every pin, so on the candidate too
    broken: list[Outcome]  # selected patches `build` would refuse on the candidate
    retired: list[Outcome]  # selected patches the build would leave out (UPSTREAM, GATED, OUT_OF_RANGE)
    names_dropped_pin: str  # the dropped rollback pin when the image lists it, else ""
    replaced_by: str = ""  # --update-images: the candidate that takes the dropped pin's place in its list

    @property
    def builds_on_candidate(self) -> bool:
        return not self.pins

    def to_json(self) -> dict:
        return {"image": self.image, "path": self.path, "pins": self.pins,
                "builds_on_candidate": self.builds_on_candidate,
                "broken": [o.to_json() for o in self.broken], "retired": [o.to_json() for o in self.retired],
                "names_dropped_pin": self.names_dropped_pin or None, "replaced_by": self.replaced_by or None}


@dataclass
class Preflight:
    current: Pin
    rollback: Pin | None  # dropped by --write
    candidate: Candidate
    old_origin: str
    rows: list[PatchRow]
    requires_impact: list[dict]  # {"patch", "requires", "verdict"}
    perf_lost: list[PatchRow]
    images: list[ImageImpact]
    failures: list[str] = field(default_factory=list)  # the preflight fails; --force writes anyway
    blockers: list[str] = field(default_factory=list)  # --write refuses even with --force
    upstream: UpstreamCheck | None = None  # vLLM's tests on the candidate's CPU build (add_upstream)

    def add_upstream(self, check: UpstreamCheck) -> None:
        """vLLM's own tests on the candidate: a regression (or a run asked for that failed) fails."""
        self.upstream = check
        if check.failure:
            self.failures.append(check.failure)

    @property
    def ok(self) -> bool:
        return not self.failures and not self.blockers

    @property
    def downgrade(self) -> bool:
        """The candidate's vLLM is older than the current pin's: the bump goes back."""
        return self.candidate.vllm < self.current.vllm

    @property
    def updated_images(self) -> list[ImageImpact]:
        """The images whose ``pins`` list gets the candidate in the dropped pin's place (--update-images)."""
        return [i for i in self.images if i.replaced_by]

    @property
    def retire(self) -> list[str]:
        return [r.patch for r in self.rows if r.action == "retire"]

    @property
    def reanchor(self) -> list[str]:
        return [r.patch for r in self.rows if r.action == "re-anchor"]

    @property
    def new_outcomes(self) -> dict[str, Outcome]:
        return {r.patch: r.new for r in self.rows}

    def to_json(self) -> dict:
        return {
            "from": {"pin": self.current.name, "image": self.current.image, "vllm": str(self.current.vllm),
                     "digest": self.current.digest or None, "source": self.old_origin},
            "to": self.candidate.to_json(),
            "drops": self.rollback.name if self.rollback else None,
            "downgrade": self.downgrade,
            "patches": [r.to_json() for r in self.rows],
            "retire": self.retire,
            "reanchor": self.reanchor,
            "requires_impact": self.requires_impact,
            "perf_critical_lost": [{"patch": r.patch, "verdict": str(r.new.verdict)} for r in self.perf_lost],
            "images": [i.to_json() for i in self.images],
            "upstream_tests": self.upstream.to_json() if self.upstream else None,
            "failures": self.failures,
            "blockers": self.blockers,
            "ok": self.ok,
        }


def _action(old: Outcome, new: Outcome, requires_broken: bool) -> str:
    if new.verdict.ok:
        return "keep" if old.verdict.ok else "new"
    if new.verdict is Verdict.UPSTREAM:
        return "retired" if old.verdict is Verdict.UPSTREAM else "retire"
    if new.verdict in (Verdict.DRIFTED, Verdict.TARGET_GONE):
        return "re-anchor"
    if new.verdict is Verdict.GATED:
        return "blocked" if requires_broken else "gated"
    if new.verdict is Verdict.OUT_OF_RANGE:
        return "out of range"
    return "-"


def run_preflight(catalogue: Catalogue, images: list[ImageDefinition], current: Pin, rollback: Pin | None,
                  old_tree: SourceTree, candidate: Candidate, memo: VerdictMemo | None = None,
                  update_images: bool = False) -> Preflight:
    """``update_images``: an image that lists the dropped pin gets the candidate in its place
    (judged as built on it) instead of blocking ``--write``."""
    ids = list(catalogue.patches)
    old = run_isolated(catalogue, Session(old_tree), BuildTarget(current.vllm), ids, memo)
    session = Session(candidate.tree)
    new = run_isolated(catalogue, session, BuildTarget(candidate.vllm), ids, memo)

    requires_impact: list[dict] = []
    rows: list[PatchRow] = []
    for pid in ids:
        patch = catalogue.get(pid)
        lost_deps = [dep for dep in patch.requires if old[dep].verdict.ok and not new[dep].verdict.ok]
        if lost_deps and old[pid].verdict.ok:
            for dep in lost_deps:
                requires_impact.append({"patch": pid, "requires": dep, "verdict": str(new[dep].verdict)})
        rows.append(PatchRow(pid, patch.family, patch.perf_critical, old[pid], new[pid],
                             _action(old[pid], new[pid], bool(lost_deps))))
    perf_lost = [r for r in rows if r.perf_critical and r.old.verdict.ok and not r.new.verdict.ok]

    impacts: list[ImageImpact] = []
    for image in images:
        result = run_selection(catalogue, session, image.target(candidate.pin()), list(image.patches))
        selected = [result.outcomes[pid] for pid in image.patches]
        dropped = rollback.name if rollback and rollback.name in image.pins else ""
        impacts.append(ImageImpact(image.name, str(image.path), list(image.pins),
                                   [o for o in selected if o.verdict.blocks_build],
                                   [o for o in selected if o.verdict in (Verdict.UPSTREAM, Verdict.GATED, Verdict.OUT_OF_RANGE)],
                                   dropped, candidate.name if dropped and update_images else ""))

    pre = Preflight(current, rollback, candidate, old_tree.origin, rows, requires_impact, perf_lost, impacts)
    for r in perf_lost:
        pre.failures.append(f"{r.patch} is perf_critical and stops applying ({r.new.verdict})")
    for item in requires_impact:
        pre.failures.append(f"{item['patch']} requires {item['requires']}, which is {item['verdict']} on "
                            f"{candidate.name}: {item['patch']} no longer applies")
    for impact in impacts:
        if impact.builds_on_candidate and impact.broken:
            pre.failures.append(f"image {impact.image} builds on every pin and would fail on {candidate.name}: "
                                + ", ".join(f"{o.patch_id} {o.verdict}" for o in impact.broken))
        if impact.replaced_by and impact.broken:
            pre.failures.append(f"image {impact.image} would list {candidate.name} in place of "
                                f"{impact.names_dropped_pin} (--update-images) and fail on it: "
                                + ", ".join(f"{o.patch_id} {o.verdict}" for o in impact.broken))
        elif impact.names_dropped_pin and not impact.replaced_by:
            pre.blockers.append(f"{impact.path}: pins lists {impact.names_dropped_pin!r}, which this bump drops "
                                f"(edit the image first, or pass --update-images to list {candidate.name} "
                                "in its place)")
    return pre
