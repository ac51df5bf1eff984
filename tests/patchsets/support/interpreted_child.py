"""Run a test module's ``child_main`` in a fresh Python under Triton's interpreter.

``TRITON_INTERPRET=1`` must be set before any kernel is decorated, so the kernels run in a child
process the test starts: ``child_main()`` of ``module`` reads the files the parent wrote to
``where`` and prints its results as JSON on its last stdout line. There, ``load_module`` imports
one vLLM module file on its own, with stand-ins for what it imports from vLLM.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def run_child(module: str, where: Path, timeout: float):
    """``module``'s ``child_main()`` run on ``where`` with ``TRITON_INTERPRET=1``: its JSON result."""
    proc = subprocess.run(
        [sys.executable, "-c", f"from {module} import child_main; child_main()", str(where)],
        cwd=REPO, env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def load_module(path: Path, name: str):
    """Import ``path`` as module ``name`` with stand-ins for its ``from vllm... import`` lines: the
    real ``triton``/``tl`` for ``vllm.triton_utils``, ``logging.getLogger`` for ``init_logger``,
    and for every other name an empty class (the caller never reaches it)."""
    import importlib.util
    import logging
    import types

    import triton
    import triton.language as tl

    for node in ast.parse(path.read_text()).body:
        if not (isinstance(node, ast.ImportFrom) and (node.module or "").startswith("vllm")):
            continue
        module = types.ModuleType(node.module)
        for alias in node.names:
            setattr(module, alias.name, type(alias.name, (), {}))  # never called on this path
        if node.module == "vllm.triton_utils":
            module.triton, module.tl = triton, tl
        if node.module == "vllm.logger":
            module.init_logger = logging.getLogger
        sys.modules[node.module] = module
    spec = importlib.util.spec_from_file_location(name, path)
    loaded = importlib.util.module_from_spec(spec)
    sys.modules[name] = loaded
    spec.loader.exec_module(loaded)
    return loaded
