"""ci/cpu_image_tests.py: vLLM's tests run by each image's own Python, a regression failing serve_check.

No chroot here: each "rootfs" is a folder holding a tiny ``vllm`` package under ``opt/venv``, and
a fake runner plays the chroot (the image's Python is this one, with that folder's package on its
path; absolute paths are the rootfs's). The sdist is a tiny tests tree. The real run, in the
images' chroots, is ``ci/serve_check`` (docs/SERVE_CHECK.md).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("image_tests", ROOT / "ci" / "cpu_image_tests.py")
image_tests = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(image_tests)

ENGINE = "vllm/parser/engine/streaming_parser_engine.py"
TESTS = {
    "pyproject.toml": "[tool.pytest.ini_options]\nmarkers = ['cpu_test']\n",
    "tests/__init__.py": "",
    "tests/parser/__init__.py": "",
    "tests/parser/engine/__init__.py": "",
    "tests/parser/engine/test_engine.py": (
        "from vllm.parser.engine import streaming_parser_engine as engine\n\n"
        "def test_truncated_opener_is_held():\n    assert engine.HOLDS_TRUNCATED_OPENER\n\n"
        "def test_unrelated():\n    assert engine.NAME == 'engine'\n\n"
        "def test_needs_the_hub():\n    raise OSError('no model hub')\n"),
    "tests/parser/test_unpatched.py": "from vllm import sampling_params\n\ndef test_other():\n    pass\n",
    # imports the patched module, but outside the prefix the serve check runs
    "tests/v1/test_elsewhere.py": "from vllm.parser.engine import streaming_parser_engine\n\ndef test_x():\n    pass\n",
}
MANIFEST = {"site_dir": "/opt/venv/lib/site", "files": {f"/opt/venv/lib/site/{ENGINE}": {"before": "", "after": ""}}}


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def _rootfs(path: Path, holds: bool) -> Path:
    site = "opt/venv/lib/site"
    return _write(path, {f"{site}/vllm/__init__.py": "", f"{site}/vllm/parser/__init__.py": "",
                         f"{site}/vllm/parser/engine/__init__.py": "",
                         f"{site}/{ENGINE}": f"NAME = 'engine'\nHOLDS_TRUNCATED_OPENER = {holds}\n"})


def fake_chroot(rootfs: Path, cwd: str, env: dict, argv: list, timeout: float) -> tuple[int, str]:
    """The chroot, played: the image's Python is this one with the rootfs's site on its path; the
    command's absolute paths are the rootfs's, and so are the paths it prints."""
    assert argv[0] == image_tests.PYTHON and set(env) >= {"VLLM_TARGET_DEVICE", "HF_HUB_OFFLINE"}

    def inside(arg: str) -> str:
        key, eq, value = arg.partition("=")
        if arg.startswith("/"):
            return f"{rootfs}{arg}"
        return f"{key}={rootfs}{value}" if eq and value.startswith("/") else arg

    done = subprocess.run([sys.executable, *map(inside, argv[1:])], cwd=inside(cwd), capture_output=True, text=True,
                          env=dict(env, PYTHONPATH=str(rootfs / "opt/venv/lib/site")), timeout=timeout)
    return done.returncode, (done.stdout + done.stderr).replace(str(rootfs), "")


@pytest.fixture
def sdist(tmp_path):
    return _write(tmp_path / "sdist", TESTS)


def test_the_selection_is_the_patched_files_tests_under_the_prefix(sdist):
    assert image_tests.patched_rels(MANIFEST) == {"parser/engine/streaming_parser_engine.py": ""}
    assert image_tests.selection(sdist, MANIFEST, ["tests/parser"]) == ["tests/parser/engine/test_engine.py"]
    with pytest.raises(image_tests.Failed, match="no test file of vLLM's under tests/kernels imports"):
        image_tests.selection(sdist, MANIFEST, ["tests/kernels"])


def test_both_images_pass_alike_and_the_evidence_counts_them(sdist, tmp_path):
    roots = {"pristine": _rootfs(tmp_path / "pristine", True), "patched": _rootfs(tmp_path / "patched", True)}
    files = image_tests.selection(sdist, MANIFEST, ["tests/parser"])
    evidence = image_tests.check(sdist, files, roots, fake_chroot, timeout=120)
    for side in ("pristine", "patched"):
        assert {k: evidence["sides"][side][k] for k in ("tests", "passed")} == {"tests": 3, "passed": 2}
        assert evidence["sides"][side]["vllm_from"] == "/opt/venv/lib/site/vllm/__init__.py"
        # the tests ran from their copy inside the rootfs
        assert (roots[side] / "tmp/vllm-tests/tests/parser/engine/test_engine.py").is_file()
        assert (roots[side] / "tmp/vllm-tests/junit.xml").is_file()
    assert evidence["regressions"] == [] and evidence["not_runnable"] == 1
    assert evidence["files"] == ["tests/parser/engine/test_engine.py"]


@pytest.mark.reliability
def test_a_test_passing_on_pristine_and_failing_patched_fails_the_step_in_one_line(sdist, tmp_path, monkeypatch, capsys):
    """A planted regression: the patched image's engine no longer holds a truncated opener."""
    roots = {"pristine": _rootfs(tmp_path / "pristine", True), "patched": _rootfs(tmp_path / "patched", False)}
    files = image_tests.selection(sdist, MANIFEST, ["tests/parser"])
    with pytest.raises(image_tests.Failed) as failed:
        image_tests.check(sdist, files, roots, fake_chroot, timeout=120)
    assert str(failed.value) == ("1 of vLLM's tests pass on pristine and fail patched: "
                                 "tests.parser.engine.test_engine::test_truncated_opener_is_held")
    # the script serve_check runs: exit 1, the one line serve_check turns into its "vllm tests" step
    monkeypatch.setattr(image_tests.upstream, "sdist_tests", lambda version, home: sdist)
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "manifest.json").write_text(json.dumps(MANIFEST))
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"vllm": "0.32.0", "only": ["tests/parser"], "timeout": 120,
                                "manifest": str(tmp_path / "manifest.json"),
                                "sides": {side: {"rootfs": str(root), "in_root": ["unused"]} for side, root in roots.items()}}))
    assert image_tests.main([str(spec)], run_in_root=fake_chroot) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines() == [
        "error: vllm tests: 1 of vLLM's tests pass on pristine and fail patched: "
        "tests.parser.engine.test_engine::test_truncated_opener_is_held"]


def test_a_side_past_the_bound_fails_the_step(sdist, tmp_path):
    _write(sdist, {"tests/parser/engine/test_engine.py": TESTS["tests/parser/engine/test_engine.py"]
                   + "\ndef test_slow():\n    import time\n    time.sleep(60)\n"})
    roots = {"pristine": _rootfs(tmp_path / "pristine", True), "patched": _rootfs(tmp_path / "patched", True)}
    # a test that sleeps 60 s: any bound below that is past, however loaded the machine
    with pytest.raises(image_tests.Failed, match=r"side did not finish within the 3 s bound \(1 test files\)"):
        image_tests.check(sdist, ["tests/parser/engine/test_engine.py"], roots, fake_chroot, timeout=3)


def test_an_image_whose_python_finds_vllm_outside_its_venv_is_refused(sdist, tmp_path):
    roots = {"pristine": _rootfs(tmp_path / "pristine", True), "patched": _rootfs(tmp_path / "patched", True)}
    with pytest.raises(image_tests.Failed, match=r"finds vllm at /opt/venv/lib/site/vllm/__init__.py, not in its venv /usr/"):
        image_tests.check(sdist, ["tests/parser/engine/test_engine.py"], roots, fake_chroot, timeout=60, venv="/usr/")
