"""The Genesis ledger (patchsets/genesis.toml -> docs/GENESIS.md) covers every switch Genesis's
presets turn on, names real kiln patches, refuses malformed rows, and is current.

The presets' switch lists are vendored in tests/patch/genesis/ (names and values only, with the
Genesis commit they were read at): refreshing them to a newer Genesis commit makes every new
switch fail here until it has a row.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from kiln import paths
from kiln.commands.patches import GENESIS_LEDGER, genesis_doc
from kiln.errors import KilnError
from kiln.patch.genesis_doc import (
    SETTING_VERDICTS,
    STATUSES,
    check_ledger,
    load_ledger,
    render_genesis_doc,
)
from kiln.paths import RepoFiles
from tests.support.cli import one_line_error, run

FIXTURES = Path(__file__).parent / "genesis"
LEDGER = paths.PATCHSETS / GENESIS_LEDGER
DOC = paths.REPO / "docs" / "GENESIS.md"


def presets() -> dict[str, dict]:
    """Vendored preset file (its path in Genesis) -> its fixture (commit, patches)."""
    found = {}
    for fixture in sorted(FIXTURES.glob("*.toml")):
        data = tomllib.loads(fixture.read_text())
        if "patches" in data:
            found[data["path"]] = data
    return found


def registry_defaults() -> dict:
    """The vendored default-on list of Genesis's registry (commit, default_on: id -> switch)."""
    return tomllib.loads((FIXTURES / "registry-default-on.toml").read_text())


def defaults() -> set[str]:
    return set(registry_defaults()["default_on"].values())


def enabled_by_preset(ledger) -> dict[str, set[str]]:
    """Preset key of the ledger -> the switches on under it: those its vendored list sets to "1",
    and those the registry applies by default that it does not set to anything else."""
    by_path = presets()
    on = {}
    for key, path in ledger.presets.items():
        patches = by_path[path]["patches"]
        on[key] = {s for s, v in patches.items() if v == "1"} | {s for s in defaults() if patches.get(s, "1") == "1"}
    return on


def test_fixtures_and_ledger_were_read_at_the_same_genesis_commit():
    ledger = load_ledger(LEDGER)
    fixtures = presets()
    assert set(fixtures) == set(ledger.presets.values())
    for data in [*fixtures.values(), registry_defaults()]:
        assert (data["repository"], data["commit"]) == (ledger.repository, ledger.commit)


def test_a_row_is_marked_default_on_exactly_when_the_registry_applies_it_by_default():
    rows = {row.switch: row for row in load_ledger(LEDGER).rows}
    assert sorted(s for s, row in rows.items() if row.default_on) == sorted(defaults())


def test_every_switch_a_preset_turns_on_has_exactly_its_row():
    ledger = load_ledger(LEDGER)
    enabled = enabled_by_preset(ledger)
    everything = set().union(*enabled.values())
    rows = {row.switch: row for row in ledger.rows}
    assert sorted(everything - set(rows)) == [], "switches with no row in patchsets/genesis.toml"
    judged = {switch for switch, row in rows.items() if row.judged}
    assert sorted(set(rows) - everything - judged) == [], "rows for switches no preset turns on (and not judged)"
    assert sorted(judged & everything) == [], "judged rows for switches a preset turns on (give their presets)"
    for switch, row in rows.items():
        assert set(row.presets) == {key for key, on in enabled.items() if switch in on}, switch
    # the count (71 and 76 switched on by the presets) plus the registry's defaults (45: 44
    # under the 35B-A3B preset, which switches GENESIS_LEGACY_P7 off; 10 of them the presets set too)
    assert {k: len(v) for k, v in enabled.items()} == {"27B": 71 + 45 - 10, "35B-A3B": 76 + 44 - 10}


def test_rows_have_valid_statuses_and_ported_rows_name_catalogue_patches(catalogue):
    ledger = load_ledger(LEDGER)
    check_ledger(ledger, catalogue)
    for row in ledger.rows:
        assert row.status in STATUSES
        if row.status == "ported":
            assert row.kiln or row.baked or row.aot, row.switch
            assert all(pid in catalogue.patches for pid in row.kiln), row.switch
            assert all((LEDGER.parent.parent / rel).is_file() for rel in row.baked), row.switch
            for image in sorted((LEDGER.parent.parent / "images").glob("*.toml")):  # both shipped GPU images
                model = tomllib.loads(image.read_text())["model"]
                if "kernels" not in model:  # the CPU image compiles no kernels (ci/serve_check)
                    continue
                launchers = model["kernels"].get("launchers", [])
                assert set(row.aot) <= set(launchers), (row.switch, image.name)
        if row.status == "upstream":
            assert row.release and row.evidence, row.switch


def test_the_genesis_document_is_current():
    assert DOC.read_text() == genesis_doc(RepoFiles()), \
        "docs/GENESIS.md is stale: .venv/bin/python build.py patches --genesis-doc"


def test_every_row_is_in_the_document():
    text = DOC.read_text()
    for row in load_ledger(LEDGER).rows:
        assert f"`{row.switch}`" in text


ROW = """
[genesis]
repository = "Sandermage/genesis-vllm-patches"
commit = "dfffdad749e0b90c2388903c018c2a3a84099da2"
vllm = "0.33.0"

[genesis.presets]
"27B" = "a.yaml"

[switch.GENESIS_ENABLE_P58_ASYNC_PLACEHOLDER_FIX]
id = "P58"
presets = ["27B"]
what = "placeholders"
{row}
"""


@pytest.mark.parametrize(("row", "message"), [
    ('status = "ported"\nkiln = ["P58"]\ncolour = "red"',
     "switch.GENESIS_ENABLE_P58_ASYNC_PLACEHOLDER_FIX.colour: unknown key for a ported row"),
    ('status = "fixed"', "switch.GENESIS_ENABLE_P58_ASYNC_PLACEHOLDER_FIX.status: 'fixed' is not one of ported"),
    ('status = "upstream"\nevidence = "x.py:1"', "switch.GENESIS_ENABLE_P58_ASYNC_PLACEHOLDER_FIX.release: missing"),
    ('status = "upstream"\nrelease = "soon"\nevidence = "x.py:1"', "'soon' is not a release like 0.24.0"),
    ('status = "not-applicable"\nreason = "dislike"', "reason: 'dislike' is not one of hardware, model"),
    ('status = "ported"\nkiln = []', "switch.GENESIS_ENABLE_P58_ASYNC_PLACEHOLDER_FIX.kiln: must be a non-empty list"),
    ('status = "planned"\npresets = ["27B"]', "not valid TOML"),
    ('status = "planned"\ndefault_on = false', "default_on: must be true (leave it out"),
    ('status = "planned"\ndefault_on = "yes"', "default_on: must be true (leave it out"),
])
def test_a_malformed_row_is_one_line_naming_the_file_and_row(tmp_path, row, message):
    path = tmp_path / "genesis.toml"
    path.write_text(ROW.format(row=row))
    with pytest.raises(KilnError) as err:
        load_ledger(path)
    assert message in str(err.value) and str(path) in str(err.value)
    assert "\n" not in str(err.value)


def test_a_ported_row_naming_no_patch_of_the_catalogue_is_refused(tmp_path, catalogue):
    path = tmp_path / "genesis.toml"
    path.write_text(ROW.format(row='status = "ported"\nkiln = ["P98"]'))
    with pytest.raises(KilnError, match=r"switch.GENESIS_ENABLE_P58_ASYNC_PLACEHOLDER_FIX.kiln: 'P98' is not a patch"):
        check_ledger(load_ledger(path), catalogue)


def test_a_ported_row_may_name_a_baked_file_which_must_exist(tmp_path, catalogue):
    """A fix that is a file (PN127's chat template) is ported by baking it, not by a patch."""
    path = tmp_path / "patchsets" / "genesis.toml"
    path.parent.mkdir()
    path.write_text(ROW.format(row='status = "ported"\nbaked = ["images/files/t.jinja"]'))
    with pytest.raises(KilnError, match=r"baked: 'images/files/t.jinja' is not a file of the repository"):
        check_ledger(load_ledger(path), catalogue)
    (tmp_path / "images" / "files").mkdir(parents=True)
    (tmp_path / "images" / "files" / "t.jinja").write_text("{{ messages }}")
    check_ledger(load_ledger(path), catalogue)
    path.write_text(ROW.format(row='status = "planned"\nbaked = ["images/files/t.jinja"]'))
    with pytest.raises(KilnError, match="baked: unknown key for a planned row"):
        load_ledger(path)


def test_a_ported_row_may_name_an_ahead_of_time_launcher_which_must_exist(tmp_path, catalogue):
    """A JIT warm-up (PN130) is ported by compiling its kernels into the image, not by a patch."""
    path = tmp_path / "genesis.toml"
    path.write_text(ROW.format(row='status = "ported"\naot = ["turboquant_decode"]'))
    ledger = load_ledger(path)
    check_ledger(ledger, catalogue)
    assert "compiled ahead of time: launcher `turboquant_decode`" in render_genesis_doc(ledger, catalogue, {})
    path.write_text(ROW.format(row='status = "ported"\naot = ["slot_mapping"]'))
    with pytest.raises(KilnError, match=r"aot: 'slot_mapping' is not a launcher of kiln.triton.kernels"):
        check_ledger(load_ledger(path), catalogue)
    path.write_text(ROW.format(row='status = "planned"\naot = ["turboquant_decode"]'))
    with pytest.raises(KilnError, match="aot: unknown key for a planned row"):
        load_ledger(path)


def test_a_judged_row_is_for_a_fix_no_preset_switches_on(tmp_path, catalogue):
    """A fix kiln was asked to judge though no preset turns it on (PN520) has `presets = []` and
    says why in `judged`; a row without `judged` still needs its presets."""
    path = tmp_path / "genesis.toml"
    judged = 'status = "declined"\nevidence = "x.py:1"\njudged = "issue 34"'
    path.write_text(ROW.format(row=judged).replace('presets = ["27B"]', "presets = []"))
    ledger = load_ledger(path)
    assert ledger.rows[0].presets == () and ledger.rows[0].judged == "issue 34"
    doc = render_genesis_doc(ledger, catalogue, {})
    assert "| `GENESIS_ENABLE_P58_ASYNC_PLACEHOLDER_FIX` | P58 | none |" in doc
    assert "Judged: issue 34" in doc and "0 switches in all" in doc and "1 more row judges a fix" in doc
    path.write_text(ROW.format(row=judged))
    with pytest.raises(KilnError, match=r"presets: must be \[\] for a judged row"):
        load_ledger(path)
    path.write_text(ROW.format(row='status = "planned"').replace('presets = ["27B"]', "presets = []"))
    with pytest.raises(KilnError, match=r"presets: must be a non-empty list of strings \(or \[\] with `judged`"):
        load_ledger(path)


def test_an_unknown_head_key_is_refused(tmp_path):
    path = tmp_path / "genesis.toml"
    path.write_text(ROW.format(row='status = "planned"').replace('vllm = "0.33.0"', 'vllm = "0.33.0"\nbranch = "main"'))
    with pytest.raises(KilnError, match=r"genesis.toml: genesis.branch: unknown key"):
        load_ledger(path)


def test_the_command_writes_the_document_and_a_bad_ledger_is_exit_2(tmp_path, capsys):
    out = tmp_path / "GENESIS.md"
    code, _, err = run(capsys, "patches", "--genesis-doc", out)
    assert code == 0, err
    assert out.read_text() == DOC.read_text()
    patchsets = tmp_path / "patchsets"
    patchsets.mkdir()
    (patchsets / GENESIS_LEDGER).write_text(ROW.format(row='status = "maybe"'))
    code, _, err = run(capsys, "--patchsets", patchsets, "patches", "--genesis-doc", tmp_path / "other.md")
    assert code == 2
    assert "status: 'maybe' is not one of" in one_line_error(err)
    assert not (tmp_path / "other.md").exists()


def test_a_default_on_row_is_marked_in_the_document(tmp_path, catalogue):
    path = tmp_path / "genesis.toml"
    path.write_text(ROW.format(row='status = "planned"\ndefault_on = true'))
    ledger = load_ledger(path)
    assert ledger.rows[0].default_on
    text = render_genesis_doc(ledger, catalogue, {})
    assert "| `GENESIS_ENABLE_P58_ASYNC_PLACEHOLDER_FIX` | P58 | 27B (*default*) |" in text
    assert "together with the 1 fixes its patch registry marks on by default" in text


def settings_by_preset(ledger) -> dict[str, set[str]]:
    """Preset key -> the entries of its vendored list that switch no patch: a value other than
    "0"/"1", or a "0" that is no GENESIS_ENABLE_/GENESIS_LEGACY_ switch."""
    by_path = presets()
    return {key: {s for s, v in by_path[path]["patches"].items()
                  if v not in ("0", "1") or (v == "0" and not s.startswith(("GENESIS_ENABLE_", "GENESIS_LEGACY_")))}
            for key, path in ledger.presets.items()}


def test_every_preset_setting_that_is_no_patch_is_judged():
    ledger = load_ledger(LEDGER)
    found = settings_by_preset(ledger)
    judged = {item.name: item for item in ledger.settings}
    expected = set().union(*found.values()) | {"override_generation_config"}  # the sampling defaults
    assert sorted(expected - set(judged)) == [], "preset settings with no [setting.NAME] in patchsets/genesis.toml"
    assert sorted(set(judged) - expected) == [], "[setting.NAME] for settings no preset has"
    for name, item in judged.items():
        if name != "override_generation_config":
            assert set(item.presets) == {k for k, names in found.items() if name in names}, name
        assert item.verdict in SETTING_VERDICTS
    assert "VLLM_TQ_DECODE_NUM_WARPS" in judged and "GENESIS_P67_NUM_KV_SPLITS" in judged


@pytest.mark.parametrize(("setting", "message"), [
    ('presets = ["27B"]\nvalue = "4"\nwhat = "w"\nverdict = "great"\nnote = "n"', "verdict: 'great' is not one of fix"),
    ('presets = ["27B"]\nvalue = "4"\nwhat = "w"\nverdict = "knob"', "setting.VLLM_X.note: missing"),
    ('presets = ["70B"]\nvalue = "4"\nwhat = "w"\nverdict = "knob"\nnote = "n"', "setting.VLLM_X.presets: must be"),
    ('presets = ["27B"]\nvalue = 4\nwhat = "w"\nverdict = "knob"\nnote = "n"', "setting.VLLM_X.value: must be a non-empty"),
    ('presets = ["27B"]\nvalue = "4"\nwhat = "w"\nverdict = "knob"\nnote = "n"\nkiln = ["P5"]', "setting.VLLM_X.kiln: unknown key"),
])
def test_a_malformed_setting_is_one_line_naming_it(tmp_path, setting, message):
    path = tmp_path / "genesis.toml"
    path.write_text(ROW.format(row='status = "planned"') + "\n[setting.VLLM_X]\n" + setting + "\n")
    with pytest.raises(KilnError) as err:
        load_ledger(path)
    assert message in str(err.value) and str(path) in str(err.value) and "\n" not in str(err.value)


def test_settings_are_rendered_in_their_own_table(tmp_path, catalogue):
    path = tmp_path / "genesis.toml"
    path.write_text(ROW.format(row='status = "planned"') + '\n[setting.VLLM_X]\npresets = ["27B"]\nvalue = "4"\n'
                    'what = "warps"\nverdict = "knob"\nnote = "P18B_TEXT\'s row"\n')
    text = render_genesis_doc(load_ledger(path), catalogue, {})
    assert "## Preset settings that are not patches" in text
    assert "| `VLLM_X` | 27B | 4 | warps | knob | P18B_TEXT's row |" in text
