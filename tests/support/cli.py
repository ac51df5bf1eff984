"""Running kiln's command line in-process, and writing test patches into a private catalogue."""

from __future__ import annotations

from pathlib import Path

from kiln import paths
from kiln.commands import main

P65_FILE = next(paths.PATCHSETS.glob("attention_turboquant/p65_*.py"))


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ")
    return lines[0]


def write_patch(root: Path, family: str, filename: str, body: str) -> Path:
    (root / family).mkdir(exist_ok=True)
    path = root / family / filename
    path.write_text(body)
    return path


GOOD_PATCH = """\
import libcst as cst
import libcst.matchers as m
from kiln.patch.model import Codemod, Gates, Patch
from kiln.patch.shapes import assign_to, cls, func, insert_after, marked, statements, with_marker


class Edit(Codemod):
    target = "v1/attention/backends/turboquant_attn.py"
    anchor = (cls("TurboQuantMetadataBuilder"), assign_to("_cudagraph_support"))
    patched = (cls("TurboQuantMetadataBuilder"), {patched})

    def rewrite(self, node):
        (stmt,) = statements({code!r})
        return insert_after(node, with_marker(stmt, "{pid}", "test"))


class {pid}(Patch):
    id = "{pid}"
    family = "{family}"
    title = "test patch"
    why = "exercise the error paths"
    edits = (Edit,)
    {extra}
"""


def good_patch(pid="P900", family="attention_turboquant", code="def helper(self):\n    return 1\n", extra="", patched=None):
    patched = patched or f'func("helper", leading_lines=marked("{pid}"))'
    return GOOD_PATCH.format(pid=pid, family=family, code=code, extra=extra, patched=patched)


# Two pins, the releases the tests read (image and malformed-input tests).
PINS = """\
[pins."v0.20.1"]
role = "current"
image = "docker.io/vllm/vllm-openai:v0.20.1"
vllm = "0.20.1"
cuda = "cu130"

[pins."v0.33.0"]
role = "rollback"
image = "docker.io/vllm/vllm-openai:v0.33.0"
vllm = "0.33.0"
cuda = "cu130"
"""
