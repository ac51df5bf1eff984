"""ci/upstream_tests.py: which of vLLM's tests it selects, and what it calls a regression.

The selection and the comparison run here on small trees written by the test; the run itself
(the CPU environment, vLLM's sdist, pytest on both sides) is ``ci/upstream_tests.py`` on the
CPU pin (docs/UPSTREAM_TESTS.md).
"""

import importlib.util
from pathlib import Path

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
