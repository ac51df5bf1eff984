"""Run TurboQuant verify batches through patched vLLM code under Triton's interpreter, in a
fresh process: ``python -m tests.patchsets.support.tq_numerics SPEC.json`` prints one JSON result.

A subprocess because ``TRITON_INTERPRET=1`` only takes hold if it is set before ``triton`` is
first imported (``triton.language``'s own ``@jit`` helpers such as ``tl.min`` are decorated at
import), and in a pytest process something else may have imported triton already (torch's
meta-device ops do, through Inductor).

SPEC: ``{"cases": [{"id", "root", "backend", "preset", "group", "transposed"}]}``; ``root``
holds a tree's ``vllm/`` op files and ``turboquant/centroids.py``, ``backend`` the patched
``turboquant_attn.py`` text. Per case: the real store kernel fills a cache, the patched
``forward`` runs with the real launchers of that tree (counted), and the output is compared
with ``tq_interpret.torch_reference``. Result: ``{id: {"launched": {...}, "paths": [...],
"max_abs_err": float, "max_abs_ref": float}}``.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton

import json  # noqa: E402
import sys  # noqa: E402
from collections import Counter  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from tests.patchsets.support import tq_interpret as tq  # noqa: E402

LAUNCHERS = {
    "triton_turboquant_decode_attention": "triton_turboquant_decode",
    "triton_turboquant_spec_verify_attention": "triton_turboquant_spec_verify",
    "spec_verify_kernel_supports": "triton_turboquant_spec_verify",
}


def run_case(case: dict, counts: Counter) -> dict:
    root = Path(case["root"])
    files = {
        rel.relative_to(root / "vllm").as_posix(): rel.read_text()
        for rel in (root / "vllm").rglob("*.py")
    }
    with pytest.MonkeyPatch.context() as mp:
        ops = tq.load_ops(files, root / "loaded", mp)
        namespace = {}
        for name, module in LAUNCHERS.items():
            if hasattr(ops, module):
                real = getattr(getattr(ops, module), name)

                def counted(*args, _real=real, _name=name, **kwargs):
                    counts[_name] += 1
                    return _real(*args, **kwargs)

                namespace[name] = counted
        layout = tq.TQLayout(case["preset"], 64)
        table = tq.get_centroids(files[tq.CENTROIDS])(64, layout.centroid_bits).float()
        batch = tq.Batch(ops, layout, table, group=case["group"], transposed=case["transposed"])
        impl = tq.make_impl(tq.impl_class(case["backend"], namespace), layout, batch.num_heads,
                            batch.num_kv_heads, splits=2)
        out = batch.forward(impl)
        rows, expected = batch.reference()
        return {
            "launched": dict(counts),
            "paths": impl.paths,
            "max_abs_err": float((out[rows].double() - expected).abs().max()),
            "max_abs_ref": float(expected.abs().max()),
        }


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    results = {}
    for case in spec["cases"]:
        results[case["id"]] = run_case(case, Counter())
    print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1])
