"""ci/upstream_tests.py: which of vLLM's tests it selects, and what it calls a regression.

The selection and the comparison run here on small trees written by the test; the run itself
(the CPU environment, vLLM's sdist, pytest on both sides) is ``ci/upstream_tests.py`` on the
CPU pin (docs/UPSTREAM_TESTS.md).
"""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("upstream_tests", ROOT / "ci" / "upstream_tests.py")
upstream = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(upstream)


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_selects_tests_that_import_a_patched_module_directly_or_through_a_helper(tmp_path):
    root = _write(tmp_path, {
        "tests/parser/test_direct.py": "from vllm.parser import qwen3\n",
        "tests/parser/test_member.py": "from vllm.parser.qwen3 import (\n    qwen3_config,\n)\nimport os\n",
        "tests/core/utils.py": "from vllm.v1.core.sched.scheduler import Scheduler\n",
        "tests/core/test_via_helper.py": "from .utils import create_scheduler\n",
        "tests/core/test_absolute_helper.py": "from tests.core.utils import create_scheduler\n",
        "tests/core/test_unrelated.py": "from vllm.v1.request import Request\nimport vllm.v1.core.sched.output\n",
        "tests/core/helper_test.py": "from vllm.parser import qwen3\n",  # not a test file
    })
    chosen = upstream.select_tests(root, {"parser/qwen3.py": "", "v1/core/sched/scheduler.py": ""})
    assert chosen == {
        "tests/core/test_absolute_helper.py": ["vllm.v1.core.sched.scheduler"],
        "tests/core/test_via_helper.py": ["vllm.v1.core.sched.scheduler"],
        "tests/parser/test_direct.py": ["vllm.parser.qwen3"],
        "tests/parser/test_member.py": ["vllm.parser.qwen3"],
    }


def test_a_test_passing_on_pristine_and_failing_patched_is_a_regression():
    passed, failed = {"outcome": "passed", "message": ""}, {"outcome": "failed", "message": "OSError: hub"}
    skipped = {"outcome": "skipped", "message": "needs CUDA"}
    pristine = {"a": passed, "b": failed, "c": passed, "d": skipped, "e": failed}
    patched = {"a": failed, "b": failed, "c": passed, "d": skipped, "e": passed}
    verdict = upstream.compare(pristine, patched)
    assert verdict["regressions"] == ["a"]
    assert verdict["not_runnable"] == [{"test": "b", "why": "OSError: hub"}]  # listed, not skipped
    assert verdict["skipped"] == [{"test": "d", "why": "needs CUDA"}]
    assert verdict["passing_only_when_patched"] == ["e"]
    # a test missing on the patched side (collection broke there) is a regression too
    assert upstream.compare({"x": passed}, {})["regressions"] == ["x"]
    # not run patched (--pristine-from): not runnable or skipped as pristine says, never a regression
    unrun = {"outcome": upstream.UNRUN, "message": "not run patched"}
    verdict = upstream.compare({"b": failed, "d": skipped, "x": passed}, {"b": unrun, "d": unrun, "x": unrun})
    assert verdict["not_runnable"] == [{"test": "b", "why": "OSError: hub"}]
    assert verdict["skipped"] == [{"test": "d", "why": "needs CUDA"}]
    assert verdict["regressions"] == ["x"]  # one that passed pristine is run patched, or it is a regression


def test_a_test_that_kills_its_interpreter_costs_its_folder_a_rerun_not_the_side(tmp_path):
    """Real pytest processes (this environment's): a folder whose process aborts runs again without
    the file its traceback names; that file is one failed entry, its neighbours keep their outcomes."""
    import sys

    root = _write(tmp_path / "sdist", {
        "tests/kernels/test_fine.py": "def test_one():\n    pass\n",
        "tests/kernels/test_abort.py": "import os\n\ndef test_boom():\n    os.abort()\n",
        "tests/v1/core/test_sched.py": "def test_a():\n    pass\n\ndef test_b():\n    raise OSError('no hub')\n",
    })
    overlay = tmp_path / "pristine"
    overlay.mkdir()
    files = ["tests/kernels/test_fine.py", "tests/kernels/test_abort.py", "tests/v1/core/test_sched.py"]
    assert upstream.groups(files) == {"tests/kernels": files[:2], "tests/v1/core": files[2:]}
    venv = Path(sys.executable).parent.parent
    results = upstream.run_side(venv, root, files, overlay, tmp_path, timeout=300)
    assert {name: r["outcome"] for name, r in results.items()} == {
        "tests.kernels.test_fine::test_one": "passed",
        "tests/kernels/test_abort.py::<process died>": "failed",
        "tests.v1.core.test_sched::test_a": "passed",
        "tests.v1.core.test_sched::test_b": "failed",
    }
    assert "Fatal Python error: Aborted" in results["tests/kernels/test_abort.py::<process died>"]["message"]
    # the first process named test_abort.py in its traceback: the folder ran again without it
    # (3 processes, not one per file), and the one that died wrote no report
    assert sorted(p.name for p in tmp_path.glob("*.xml")) == ["pristine-2.xml", "pristine-3.xml"]
    assert "no hub" in results["tests.v1.core.test_sched::test_b"]["message"]


def test_the_committed_record_holds_every_outcome_and_the_command_that_remakes_it():
    passed, failed = {"outcome": "passed", "message": ""}, {"outcome": "failed", "message": "OSError: hub"}
    raw = {"vllm": "0.32.0", "sdist": {"file": "vllm-0.32.0.tar.gz", "sha256": "0" * 64}, "only": [],
           "patched_files": {}, "selected": {"tests/a.py": ["vllm.a"]}, "seconds": {}, "kiln_lines_reached": None,
           "results": {"pristine": {"t1": passed, "t2": failed, "t3": passed},
                       "patched": {"t1": passed, "t2": failed, "t3": {"outcome": "failed", "message": "KeyError: x"}}}}
    record = upstream.compact(raw)
    assert record["outcomes"] == {"t1": ["passed", "passed"], "t2": ["failed", "failed"], "t3": ["passed", "failed"]}
    assert record["regressions"] == ["t3"] and record["regression_messages"] == {"t3": "KeyError: x"}
    assert record["not_runnable"] == [{"test": "t2", "why": "OSError: hub"}]
    assert record["pin"] == "cpu-v0.32.0"  # pins.toml's CPU pin on that release
    assert record["command"] == ".venv/bin/python ci/upstream_tests.py --vllm 0.32.0 --record ci/upstream/cpu-v0.32.0.json"
    assert "results" not in record


def test_a_killed_run_resumes_from_the_folders_it_finished(tmp_path):
    """Each finished folder's outcomes are kept by what decides them; ``resume`` takes them (a
    changed test shows it was not run again), another side's key runs the folder afresh."""
    import json
    import sys

    root = _write(tmp_path / "sdist", {
        "tests/kernels/test_k.py": "def test_k():\n    pass\n",
        "tests/v1/core/test_c.py": "def test_c():\n    pass\n",
    })
    overlay, kept = tmp_path / "pristine", tmp_path / "kept"
    overlay.mkdir()
    kept.mkdir()
    files = ["tests/kernels/test_k.py", "tests/v1/core/test_c.py"]
    venv = Path(sys.executable).parent.parent
    first = upstream.run_side(venv, root, files, overlay, tmp_path, timeout=300, kept=kept, side_key="a")
    assert {r["outcome"] for r in first.values()} == {"passed"} and len(list(kept.iterdir())) == 2
    (root / "tests/kernels/test_k.py").write_text("def test_k():\n    raise OSError('ran again')\n")
    resumed: list[str] = []
    again = upstream.run_side(venv, root, files, overlay, tmp_path, timeout=300, kept=kept, side_key="a",
                              resume=True, resumed=resumed)
    assert again == first and resumed == ["tests/kernels", "tests/v1/core"]
    # without resume, or under another key (another sdist, environment or source), it runs
    fresh = upstream.run_side(venv, root, files, overlay, tmp_path, timeout=300, kept=kept, side_key="b", resume=True)
    assert fresh["tests.kernels.test_k::test_k"]["outcome"] == "failed"
    rerun = upstream.run_side(venv, root, files, overlay, tmp_path, timeout=300, kept=kept, side_key="a")
    assert "ran again" in rerun["tests.kernels.test_k::test_k"]["message"]
    # an entry that does not say it was kept for these inputs (damaged, hand-copied) is run again
    for store in kept.iterdir():
        store.write_text(store.read_text().replace('"key": "a"', '"key": "b"'))
    resumed = []
    redone = upstream.run_side(venv, root, files, overlay, tmp_path, timeout=300, kept=kept, side_key="a",
                               resume=True, resumed=resumed)
    assert resumed == [] and "ran again" in redone["tests.kernels.test_k::test_k"]["message"]
    for store in kept.iterdir():
        store.write_bytes(store.read_bytes()[:40])
    assert upstream.read_kept(store, "a", ["tests/kernels/test_k.py"]) is None
    store.write_text(json.dumps({"key": "a", "files": ["tests/kernels/test_k.py"], "results": {"t": {}}}))
    assert upstream.read_kept(store, "a", ["tests/kernels/test_k.py"]) is None
    store.write_text(json.dumps({"key": "a", "files": ["tests/kernels/test_k.py"],
                                 "results": {"t": {"outcome": "passed"}}}))
    assert upstream.read_kept(store, "a", ["tests/kernels/test_k.py"]) == {"t": {"outcome": "passed"}}


def test_the_folders_kept_in_the_repository_were_made_by_todays_runner_and_show_no_regression():
    """ci/upstream/kept: the folders finished so far toward the CPU pin's record (a whole run
    takes longer than one machine's session; ``--kept ci/upstream/kept --resume`` goes on from
    them anywhere). Each entry is filed under the key of what it says it was run on, was made
    with today's pytest plugin, and no folder passes on pristine and fails patched."""
    import hashlib
    import json

    runner = hashlib.sha256(upstream.PLUGIN.read_bytes()).hexdigest()
    sides: dict[str, dict[str, dict]] = {}
    for store in sorted((ROOT / "ci" / "upstream" / "kept").glob("*.json")):
        entry = json.loads(store.read_text())
        assert store == upstream.kept_path(store.parent, entry["key"], entry["files"], entry.get("only")), store
        key = json.loads(entry["key"])
        assert key["runner"] == runner, f"{store.name}: kept by another version of {upstream.PLUGIN.name}"
        assert upstream.groups(entry["files"]) == {entry["folder"]: entry["files"]}, store.name
        # a folder's two sides: the same files, sdist, environment and runner; the source differs
        run = json.dumps([entry["files"], {k: v for k, v in key.items() if k not in ("side", "source")}], sort_keys=True)
        assert key["side"] not in sides.setdefault(run, {}), f"{store.name}: a second {key['side']} run of {entry['folder']}"
        sides[run][key["side"]] = entry["results"]
    for run, outcomes in sides.items():
        assert set(outcomes) <= {"pristine", "patched"}, run
        if len(outcomes) == 2:  # a folder one side has not finished yet is compared once it has
            assert upstream.compare(outcomes["pristine"], outcomes["patched"])["regressions"] == [], run


def test_a_killed_runs_working_tree_is_removed_by_the_next_run_a_live_ones_is_not(tmp_path):
    import os
    import subprocess

    gone = subprocess.Popen(["true"])
    gone.wait()
    dead, live, other = tmp_path / f"run-{gone.pid}-abc", tmp_path / f"run-{os.getpid()}-def", tmp_path / "sdist-sha256-x"
    for tree in (dead, live, other):
        (tree / "tests").mkdir(parents=True)
    assert upstream.remove_left_behind(tmp_path) == [dead]
    assert not dead.exists() and live.is_dir() and other.is_dir()


_CONFTEST = """
import gc

import pytest

FROZEN_DURING_CLEANUP = []


def cleanup_dist_env_and_memory():  # as vLLM's: unfreeze the heap, collect all of it
    gc.unfreeze()
    FROZEN_DURING_CLEANUP.append(gc.get_freeze_count())
    gc.collect()


@pytest.fixture(autouse=True)
def cleanup_fixture():
    yield
    cleanup_dist_env_and_memory()


@pytest.fixture
def frozen_during_cleanup():
    return FROZEN_DURING_CLEANUP
"""

_GC_TESTS = """
import gc
import weakref


class Node:
    pass


REF = []


def test_1_leaves_a_cycle_behind():
    node = Node()
    node.itself = node
    REF.append(weakref.ref(node))


def test_2_the_cleanup_collected_it_and_the_heap_is_frozen():
    assert REF[0]() is None
    assert gc.get_freeze_count() > 0


def test_3_the_cleanup_left_the_heap_frozen(frozen_during_cleanup):
    assert frozen_during_cleanup and all(count > 0 for count in frozen_during_cleanup)


def test_4_unfreeze_outside_the_cleanup_is_the_real_one():
    gc.unfreeze()
    assert gc.get_freeze_count() == 0


def test_5_the_next_cleanup_froze_it_again():
    assert gc.get_freeze_count() > 0
"""


def test_vllms_per_test_cleanup_collects_what_the_test_left_without_walking_the_frozen_heap(tmp_path):
    """kiln's plugin (both sides load it): vLLM's cleanup still collects a test's garbage, the
    heap from before stays frozen through it, ``gc.unfreeze`` elsewhere is untouched. Without the
    plugin the same tests fail where the cleanup walked the whole heap."""
    import subprocess
    import sys

    root = _write(tmp_path / "sdist", {"tests/conftest.py": _CONFTEST, "tests/kernels/test_gc.py": _GC_TESTS})
    overlay = tmp_path / "pristine"
    overlay.mkdir()
    venv = Path(sys.executable).parent.parent
    results = upstream.run_side(venv, root, ["tests/kernels/test_gc.py"], overlay, tmp_path, timeout=300)
    assert {name.split("::")[1]: r["outcome"] for name, r in results.items()} == {
        "test_1_leaves_a_cycle_behind": "passed",
        "test_2_the_cleanup_collected_it_and_the_heap_is_frozen": "passed",
        "test_3_the_cleanup_left_the_heap_frozen": "passed",
        "test_4_unfreeze_outside_the_cleanup_is_the_real_one": "passed",
        "test_5_the_next_cleanup_froze_it_again": "passed",
    }
    plain = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/kernels/test_gc.py"],
                           cwd=root, capture_output=True, text=True, timeout=300)
    assert "3 failed, 2 passed" in plain.stdout, plain.stdout[-2000:]


def test_the_long_folders_are_split_by_their_subfolders_and_moe_by_file_so_a_stopped_run_keeps_more():
    files = ["tests/kernels/moe/test_moe.py", "tests/kernels/moe/test_b.py", "tests/kernels/core/test_c.py",
             "tests/kernels/test_onednn.py", "tests/v1/core/test_s.py", "tests/v1/test_top.py",
             "tests/parser/engine/test_p.py", "tests/parser/test_q.py", "tests/test_config.py"]
    assert upstream.groups(files) == {
        files[0]: [files[0]], files[1]: [files[1]], "tests/kernels/core": [files[2]], "tests/kernels": [files[3]],
        "tests/v1/core": [files[4]], "tests/v1": [files[5]], "tests/parser": files[6:8], "tests": [files[8]]}


def test_a_re_record_runs_patched_only_the_tests_that_passed_on_pristine(tmp_path):
    """Real pytest processes: ``only`` runs the named tests (the rest deselected, a folder with none
    of them runs no process); a kept run of the whole folder serves it, a kept run of some tests is
    filed under their names."""
    import json
    import sys

    root = _write(tmp_path / "sdist", {
        "tests/kernels/test_k.py": "class TestK:\n    def test_a(self):\n        pass\n\n"
                                   "    def test_b(self):\n        raise OSError('never run')\n",
        "tests/kernels/test_p.py": "import pytest\n\n@pytest.mark.parametrize('n', [1, 2])\ndef test_p(n):\n    assert n == 1\n",
        "tests/v1/core/test_c.py": "def test_c():\n    raise OSError('never run')\n",
    })
    overlay, kept = tmp_path / "patched", tmp_path / "kept"
    overlay.mkdir()
    kept.mkdir()
    files = ["tests/kernels/test_k.py", "tests/kernels/test_p.py", "tests/v1/core/test_c.py"]
    venv = Path(sys.executable).parent.parent
    only = {"tests.kernels.test_k.TestK::test_a", "tests.kernels.test_p::test_p[2]"}
    results = upstream.run_side(venv, root, files, overlay, tmp_path, timeout=300, kept=kept, side_key="k", only=only)
    assert {name: r["outcome"] for name, r in results.items()} == {
        "tests.kernels.test_k.TestK::test_a": "passed", "tests.kernels.test_p::test_p[2]": "failed"}
    assert sorted(p.name for p in tmp_path.glob("*.xml")) == ["patched-1.xml"]  # tests/v1/core ran nothing
    (store,) = kept.iterdir()
    entry = json.loads(store.read_text())
    assert entry["only"] == sorted(only) and store == upstream.kept_path(kept, "k", files[:2], sorted(only))
    # resumed: the run of those tests is taken; a run of the whole folder is taken before it
    resumed: list[str] = []
    assert upstream.run_side(venv, root, files, overlay, tmp_path, timeout=300, kept=kept, side_key="k",
                             only=only, resume=True, resumed=resumed) == results and resumed == ["tests/kernels"]
    whole = upstream.run_side(venv, root, files[:2], overlay, tmp_path, timeout=300, kept=kept, side_key="k")
    assert len(whole) == 4
    assert upstream.run_side(venv, root, files, overlay, tmp_path, timeout=300, kept=kept, side_key="k",
                             only=only, resume=True) == whole
    assert upstream.test_file("tests/v1/core/test_c.py::<process died>", files) == files[2]
    assert upstream.test_file("tests.v1.core.test_c", files) == files[2]  # skipped or failed whole, at collection
    assert upstream.test_file("tests.kernels.test_kk::test_a", files) is None


def _earlier_record(tmp_path, **change):
    import json

    record = {"vllm": "0.32.0", "sdist": {"sha256": "s" * 64}, "environment": "venv-e", "runner": {"sha256": "r"},
              "only": [], "selected": {"tests/a/test_a.py": [], "tests/b/test_b.py": []},
              "outcomes": {"tests.a.test_a::test_1": ["passed", "passed"], "tests.a.test_a::test_2": ["failed", "failed"],
                           "tests.b.test_b::test_3": ["skipped", "skipped"]},
              "not_runnable": [{"test": "tests.a.test_a::test_2", "why": "OSError: hub"}],
              "skipped": [{"test": "tests.b.test_b::test_3", "why": "needs CUDA"}]} | change
    path = tmp_path / "earlier.json"
    path.write_text(json.dumps(record))
    return path


def test_pristine_outcomes_come_only_from_a_record_of_the_same_sdist_environment_and_runner(tmp_path):
    from packaging.version import Version

    from kiln.errors import KilnError

    args = (Version("0.32.0"), "s" * 64, "venv-e", "r")
    selected = ["tests/a/test_a.py"]
    outcomes = upstream.pristine_outcomes(_earlier_record(tmp_path), *args, selected)
    assert outcomes == {"tests.a.test_a::test_1": {"outcome": "passed", "message": ""},
                        "tests.a.test_a::test_2": {"outcome": "failed", "message": "OSError: hub"}}
    for change, field in (({"environment": "venv-other"}, "environment"), ({"runner": {"sha256": "x"}}, "runner"),
                          ({"sdist": {"sha256": "t" * 64}}, "sdist"), ({"vllm": "0.33.0"}, "vllm"),
                          ({"only": ["tests/a"]}, "only")):
        with pytest.raises(KilnError, match=f"its {field} is"):
            upstream.pristine_outcomes(_earlier_record(tmp_path, **change), *args, selected)
    with pytest.raises(KilnError, match="did not run tests/c/test_c.py"):
        upstream.pristine_outcomes(_earlier_record(tmp_path), *args, [*selected, "tests/c/test_c.py"])
    (tmp_path / "earlier.json").write_text("{")
    with pytest.raises(KilnError, match="not a record"):
        upstream.pristine_outcomes(tmp_path / "earlier.json", *args, selected)


def test_the_only_plugin_names_tests_as_the_junit_report_does():
    import importlib.util

    spec = importlib.util.spec_from_file_location("kiln_only_tests", upstream.ONLY_PLUGIN)
    plugin = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plugin)
    assert plugin.junit_name("tests/a/test_b.py::TestC::test_d[x.py-1]") == "tests.a.test_b.TestC::test_d[x.py-1]"
    assert plugin.junit_name("tests/a/test_b.py::test_d") == "tests.a.test_b::test_d"


def test_a_re_record_runs_again_only_the_files_that_import_a_module_whose_patched_text_changed(tmp_path):
    import json

    path = tmp_path / "earlier.json"
    path.write_text(json.dumps({
        "patched_files": {"a/x.py": {"sha256": "1"}, "b/y.py": {"sha256": "2"}, "c/gone.py": {"sha256": "3"}},
        "outcomes": {"tests.t.test_x::t1": ["passed", "passed"], "tests.t.test_y::t2": ["passed", "failed"],
                     "tests.t.test_y::t3": ["failed", "unrun"], "tests.t.test_z::t4": ["passed", "passed"]},
        "regression_messages": {"tests.t.test_y::t2": "KeyError: y"}}))
    selected = {"tests/t/test_x.py": ["vllm.a.x"], "tests/t/test_y.py": ["vllm.b.y"],
                "tests/t/test_z.py": ["vllm.c.gone", "vllm.b.y"]}
    now = {"a/x.py": {"sha256": "changed"}, "b/y.py": {"sha256": "2"}, "d/new.py": {"sha256": "4"}}
    run, carried, changed = upstream.rerun_plan(path, now, selected)
    # x's text changed, gone.py is no longer patched, new.py is newly patched
    assert changed == ["vllm.a.x", "vllm.c.gone", "vllm.d.new"]
    assert run == ["tests/t/test_x.py", "tests/t/test_z.py"]
    assert carried == {"tests.t.test_y::t2": {"outcome": "failed", "message": "KeyError: y"},
                       "tests.t.test_y::t3": {"outcome": "unrun", "message": ""}}


def test_a_pristine_from_that_is_no_record_is_refused_before_any_work(tmp_path, capsys):
    for path, said in ((tmp_path / "missing.json", "No such file"), (tmp_path / "list.json", "no outcomes")):
        if path.name == "list.json":
            path.write_text("[]")
        with pytest.raises(SystemExit) as stop:
            upstream.main(["--pristine-from", str(path)])
        assert stop.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert f"--pristine-from {path}: not a record" in err and said in err
