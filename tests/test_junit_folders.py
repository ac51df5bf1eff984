"""ci/junit_folders.py: pytest's time by folder, the table docs/CI.md carries."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "ci" / "junit_folders.py"


def test_each_tests_time_goes_to_its_folder_slowest_first(tmp_path):
    junit = tmp_path / "junit.xml"
    junit.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.image.test_a" name="x" time="10.5"/>'
        '<testcase classname="tests.image.test_b.TestThing" name="y" time="4.5"/>'
        '<testcase classname="tests.test_top" name="z" time="20"/>'
        '<testcase classname="tests.patch.sub.test_c" name="w" time="1"/>'
        "</testsuite></testsuites>")
    done = subprocess.run([sys.executable, str(SCRIPT), str(junit)], capture_output=True, text=True, check=True)
    lines = done.stdout.splitlines()
    assert [line.split()[-1] for line in lines] == ["tests", "tests/image", "tests/patch/sub", "total"]
    assert lines[1].split()[:3] == ["15", "s", "2"] and lines[-1].split()[0] == "36"
    table = subprocess.run([sys.executable, str(SCRIPT), "--markdown", str(junit)], capture_output=True,
                           text=True, check=True).stdout
    assert "| `tests/image` | 2 | 15 | 42% |" in table and "| all | 4 | 36 | |" in table


def test_a_report_that_is_not_xml_is_one_line(tmp_path):
    bad = tmp_path / "junit.xml"
    bad.write_text("not xml")
    done = subprocess.run([sys.executable, str(SCRIPT), str(bad)], capture_output=True, text=True)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1 and str(bad) in done.stderr
