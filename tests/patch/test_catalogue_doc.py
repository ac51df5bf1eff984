"""docs/PATCHES.md is generated from the catalogue and the records, and may not go stale."""

from __future__ import annotations

from kiln import paths
from kiln.commands.patches import DOC, patches_doc
from kiln.patch.catalogue_doc import NOTES_MARKER, doc_notes
from kiln.paths import RepoFiles
from tests.support.cli import run


def test_the_patches_document_is_current():
    text = DOC.read_text()
    assert text == patches_doc(RepoFiles(), doc_notes(text)), (
        f"{DOC} is stale: run `.venv/bin/python build.py patches --doc` and commit it")


def test_every_patch_and_every_recorded_change_is_in_the_document(catalogue):
    text = DOC.read_text()
    for pid in catalogue.patches:
        assert f"\n### {pid}\n" in text, pid
    # every patch module explains its verdicts across releases, and the document carries it
    assert text.count("**Verdicts across releases**") == len(catalogue.patches)


def test_doc_command_keeps_the_hand_written_notes(capsys, tmp_path):
    doc = tmp_path / "PATCHES.md"
    doc.write_text(f"# old\n\n{NOTES_MARKER}\n\n## Notes\n\nkept as written\n")
    code, _, err = run(capsys, "patches", "--doc", doc)
    assert code == 0, err
    text = doc.read_text()
    assert text.endswith(f"{NOTES_MARKER}\n\n## Notes\n\nkept as written\n")
    assert "# old" not in text and "\n### P65\n" in text
    assert text == patches_doc(RepoFiles(), doc_notes(text))
    assert paths.REPO / "docs" / "PATCHES.md" == DOC


def test_the_authoring_guide_lists_every_shape_helper():
    import inspect

    from kiln.patch import shapes

    guide = (paths.REPO / "docs" / "AUTHORING_PATCHES.md").read_text()
    helpers = [name for name, value in vars(shapes).items()
               if inspect.isfunction(value) and value.__module__ == shapes.__name__ and not name.startswith("_")]
    missing = [name for name in helpers if f"`{name}(" not in guide]
    assert not missing, f"docs/AUTHORING_PATCHES.md does not list {missing}"
