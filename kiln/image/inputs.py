"""What a build is asked for, loaded and checked once: definition, pin, SM, catalogue, destination.

Public API:
    BuildInputs(files, definition, pin, sm, catalogue, catalogue_hit=None, platform="linux/amd64")
                                  .tag, .target(), .with_loaded_catalogue()
    load_build_inputs(files, image, pin, sm, cached=None, platform=None) -> BuildInputs
                                  ``platform``: ``--platform``, one the image ships the SM on (None:
                                  the first of them, ``kiln/data/targets.toml``'s order)
    destination(definition, repository=None, purpose="push") -> ImageReference
    LOCAL_REGISTRY                "localhost": the name of local outputs with no repository set

``build``, ``context`` and ``values`` all start here, so they agree on which pins an image is
built for, which SMs it allows, its tag and where it is pushed. Everything here is checked
before any network or disk work.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kiln.definitions import ImageDefinition, check_sm, load_definition
from kiln.errors import KilnError
from kiln.oci.reference import ImageReference, parse_reference
from kiln.patch.catalog import Catalogue, load_catalogue
from kiln.patch.outcome import BuildTarget
from kiln.paths import RepoFiles
from kiln.pins import Pin, get_pin, load_pins
from kiln.targets import DEFAULT_PLATFORM, check_platform_for_sm

LOCAL_REGISTRY = "localhost"


@dataclass(frozen=True)
class BuildInputs:
    files: RepoFiles
    definition: ImageDefinition
    pin: Pin
    sm: int
    catalogue: Catalogue
    # where the catalogue's facts came from (``kiln.patch.facts``: a registry build cache entry),
    # or None: the catalogue was loaded from ``files.patchsets``
    catalogue_hit: str | None = None
    platform: str = DEFAULT_PLATFORM  # the base's index entry built on, e.g. "linux/arm64"

    def with_loaded_catalogue(self) -> BuildInputs:
        """These inputs with the catalogue loaded from ``files.patchsets`` (to patch with)."""
        if self.catalogue_hit is None:
            return self
        return replace(self, catalogue=load_catalogue(self.files.patchsets), catalogue_hit=None)

    @property
    def tag(self) -> str:
        return self.definition.tag(self.pin.cuda, self.sm, self.pin)

    def target(self) -> BuildTarget:
        return self.definition.target(self.pin, self.sm)


def load_build_inputs(files: RepoFiles, image: str, pin: str, sm: int | str,
                      cached: tuple[Catalogue, str | None] | None = None, platform: str | None = None) -> BuildInputs:
    """The definition, pin and catalogue named by ``--image``/``--pin``/``--sm``, checked to match.

    ``cached``: the catalogue's facts read from a registry build cache, and where from (instead
    of loading the catalogue: ``kiln.patch.facts``); or the catalogue already loaded, and None
    (``kiln.image.cachelookup.cached_catalogue`` of an unsigned entry)."""
    catalogue, catalogue_hit = cached or (load_catalogue(files.patchsets), None)
    pins = load_pins(files.pins)
    definition = load_definition(files.images, image, catalogue, pins)
    chosen = get_pin(pins, pin, files.pins)
    if chosen.name not in {p.name for p in definition.pins_of(pins)}:
        raise KilnError(f"{definition.path}: pin {chosen.name} is not one this image is built for")
    sm = check_sm(sm, "--sm")
    if sm not in definition.sms:
        raise KilnError(f"{definition.path}: sm {sm} is not one of the image's sms {list(definition.sms)}")
    shipped = definition.platforms_of(sm)
    platform = check_platform_for_sm(sm, platform, shipped, "--platform") if platform else shipped[0]
    inputs = BuildInputs(files, definition, chosen, sm, catalogue, catalogue_hit, platform)
    inputs.tag  # noqa: B018 - a tag that is not a valid OCI tag fails now, before any work
    return inputs


def destination(definition: ImageDefinition, repository: str | None = None, purpose: str = "push") -> ImageReference:
    """The repository a build's image is named by: ``--repository``, else the definition's.

    ``purpose`` says what needs it, for the error when neither is set: a push and Helm values
    need a real repository; local outputs (an OCI layout, a docker-archive) are named
    ``localhost/kiln/<image>`` when none is set, as podman names local images.
    """
    text = repository or definition.repository
    where = "--repository" if repository else f"{definition.path}: repository"
    if not text:
        if purpose == "local":
            return ImageReference(LOCAL_REGISTRY, f"kiln/{definition.name}")
        raise KilnError(f"{definition.path}: repository: not set; {purpose} needs one: pass --repository "
                        "REGISTRY/NAMESPACE/NAME or set `repository` in the image definition")
    try:
        ref = parse_reference(text)
    except KilnError as err:
        raise KilnError(f"{where}: {err}") from None
    if ref.digest or ref.tag != "latest" or text.endswith(":latest"):
        raise KilnError(f"{where}: {text!r} must be a repository, without a tag or digest")
    return ImageReference(ref.registry, ref.repository)
