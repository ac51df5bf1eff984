"""P103 on a GPU: vLLM's GDN chunked prefill, stock against P103's 64-chunk windows, compiled by Triton.

Run by ``ci/gpu_check.py --run-bundle`` (``ci/gpu_bundle.py``) in a fresh process when the bundle's
selection carries P103; the CPU proof is ``tests/patchsets/attention_gdn/test_p103.py`` (bit-equal
outputs and the chunk states bounded by the window, under Triton's interpreter). The bundle holds
the pin's ``third_party/flash_linear_attention/ops`` twice (``fla_stock/``, ``fla_src/``: without
and with the image's patches). Both copies are imported here as packages of their own, with
stand-ins for the four vLLM modules the ``chunk`` closure imports (``ci/fla_ops.py``), and each case runs
``chunk_gated_delta_rule`` (what vLLM's GDN layer calls for a prefill) on the same inputs:

- outputs and final states compared (``o_max_abs_diff``, ``state_max_abs_diff``; 0 expected: the
  windows run the same kernels on the same chunks);
- peak CUDA memory above the inputs (``torch.cuda.max_memory_allocated``): the chunk states ``h``
  of a whole step against one window's;
- time (``triton.testing.do_bench`` medians, the sides interleaved over ``ROUNDS`` rounds), with
  the step's ``chunk_indices``/``chunk_offsets`` passed as vLLM's GDN metadata does: the same
  metadata objects on every call (a step's later GDN layers: P103's window plan is cached per
  step) and new ones on every call (``*_first_layer_ms``: a step's first layer, the plan made).

Each ``@triton.autotune`` takes its first config on both sides (vLLM's
``VLLM_TRITON_FORCE_FIRST_CONFIG`` does the same), so both sides run identical kernels.

The child also runs on CPU under Triton's interpreter (spec ``"device": "cpu"`` with
``TRITON_INTERPRET=1``, tiny heads, dims and windows: the comparison's own test,
``tests/test_gpu_bundle.py``); only the outputs and states are compared there (no memory, no time).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OPS = "third_party/flash_linear_attention/ops"
ROUNDS = 3
# Qwen3.6-27B's Gated DeltaNet layers: 16 key heads, 48 value heads, head dims 128 (model card;
# tests/patchsets/support/kvspecs.py's conv and SSM state shapes)
KEY_HEADS, VALUE_HEADS, DIM = 16, 48, 128
TOKENS = (4096, 16384, 65536, 131072)


def write_packages(ops: Path, changed: dict[str, str], out: Path) -> None:
    """``out/fla_stock`` and ``out/fla_src``: the ops folder ``ops`` (a tree's
    ``vllm/third_party/flash_linear_attention/ops``) as it is and with ``changed`` (rel path ->
    text) applied; each ``__init__.py`` empty (the package's own imports far more)."""
    for name, files in (("fla_stock", {}), ("fla_src", changed)):
        (out / name).mkdir()
        for path in sorted(ops.glob("*.py")):
            text = "" if path.name == "__init__.py" else files.get(f"{OPS}/{path.name}", path.read_text())
            (out / name / path.name).write_text(text)


def compare(bundle: Path, work: Path) -> dict:
    """Run the child on the GPU (its files in ``work``); its report (``ok``, ``summary``, ``cases``)."""
    spec_path = work / "p103.json"
    spec_path.write_text(json.dumps({"stock": str(bundle / "fla_stock"), "patched": str(bundle / "fla_src"),
                                     "tokens": list(TOKENS)}))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_CACHE_DIR"}
    env["TRITON_CACHE_DIR"] = str(work / "p103-triton")
    from kiln import lifeline

    proc = lifeline.run([sys.executable, __file__, str(spec_path)], env=env)  # dies with us, SIGKILL too
    if proc.returncode != 0:
        return {"ok": False, "summary": f"the comparison failed: {proc.stderr.strip()[-2000:]}"}
    return report(json.loads(proc.stdout.strip().splitlines()[-1]))


def report(cases: list[dict]) -> dict:
    """The verdict on the child's cases: ok only when every case ran and both sides agree exactly."""
    ok = all("error" not in c and c["o_max_abs_diff"] == 0 and c["state_max_abs_diff"] == 0 for c in cases)

    def line(c: dict) -> str:
        if "error" in c:
            return f"{c['tokens']} tokens: {c['error']}"
        text = f"{c['tokens']} tokens: diff {c['o_max_abs_diff']:.1e}/{c['state_max_abs_diff']:.1e}"
        if "stock_ms" in c:
            text += (f", peak {c['stock_peak_mib']:.0f} -> {c['patched_peak_mib']:.0f} MiB, {c['stock_ms']:.1f} -> "
                     f"{c['patched_ms']:.1f} ms (a step's first layer: {c['stock_first_layer_ms']:.1f} -> "
                     f"{c['patched_first_layer_ms']:.1f} ms)")
        return text

    return {"ok": ok, "summary": "; ".join(line(c) for c in cases), "cases": cases}


# -- the child (on the GPU) ------------------------------------------------------------------------


def _inputs(tokens: int, torch, shape: dict, device: str):
    key_heads, value_heads, dim = shape["key_heads"], shape["value_heads"], shape["dim"]
    gen = torch.Generator(device=device).manual_seed(tokens)
    q = torch.randn(1, tokens, key_heads, dim, device=device, generator=gen).half()
    k = torch.nn.functional.normalize(torch.randn(1, tokens, key_heads, dim, device=device, generator=gen),
                                      dim=-1).half()
    v = torch.randn(1, tokens, value_heads, dim, device=device, generator=gen).half()
    g = torch.nn.functional.logsigmoid(torch.randn(1, tokens, value_heads, device=device, generator=gen) + 2)
    beta = torch.rand(1, tokens, value_heads, device=device, generator=gen)
    lens = [tokens - tokens // 4, tokens // 4]  # two sequences, one ending mid-chunk
    cu = torch.tensor([0, lens[0], tokens], dtype=torch.int32, device=device)
    h0 = torch.randn(2, value_heads, dim, dim, device=device, generator=gen) * 0.1
    return q, k, v, g, beta, h0, cu


def _case(tokens: int, sides: dict, torch, shape: dict, device: str) -> dict:
    inputs = _inputs(tokens, torch, shape, device)
    # as vLLM's GDN metadata passes them: the step's chunk indices and offsets, made once per step
    index = sys.modules[sides["stock"].__name__.rsplit(".", 1)[0] + ".index"]
    step = (inputs[-1], index.prepare_chunk_indices(inputs[-1], 64), index.prepare_chunk_offsets(inputs[-1], 64))
    cuda = device == "cuda"

    def run(chunk, new_step=False, inputs=inputs):
        q, k, v, g, beta, h0, _ = inputs
        cu, chunk_indices, chunk_offsets = (t.clone() for t in step) if new_step else step
        return chunk.chunk_gated_delta_rule(q, k, v, g, beta, scale=shape["dim"] ** -0.5, initial_state=h0.clone(),
                                            output_final_state=True, cu_seqlens=cu, chunk_indices=chunk_indices,
                                            chunk_offsets=chunk_offsets, use_qk_l2norm_in_kernel=True)

    out, peak = {}, {}
    for name, chunk in sides.items():
        if cuda:
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        o, final = run(chunk, new_step=True)
        if cuda:
            torch.cuda.synchronize()
            peak[name] = (torch.cuda.max_memory_allocated() - base) / 2**20
        out[name] = (o.float(), final.float())
    result = {"tokens": tokens, "sequences": 2, **shape,
              "o_max_abs_diff": float((out["stock"][0] - out["patched"][0]).abs().max()),
              "state_max_abs_diff": float((out["stock"][1] - out["patched"][1]).abs().max()),
              "o_finite": bool(torch.isfinite(out["stock"][0]).all())}
    if cuda:
        result.update(_timings(run, sides), stock_peak_mib=peak["stock"], patched_peak_mib=peak["patched"])
    return result


def _timings(run, sides: dict) -> dict:
    from triton.testing import do_bench

    # the same step's metadata on every call: a step's later GDN layers (P103's window plan cached);
    # new metadata objects on every call ("first"): a step's first GDN layer (the plan made)
    variants = {name: (name, False) for name in ("stock", "patched")}
    variants |= {f"{name}_first": (name, True) for name in ("stock", "patched")}
    times = {name: [] for name in variants}
    for r in range(ROUNDS):
        for name in (list(variants) if r % 2 == 0 else list(reversed(variants))):
            side, new_step = variants[name]
            times[name].append(do_bench(lambda chunk=sides[side], n=new_step: run(chunk, n), warmup=3, rep=30,
                                        return_mode="median"))
    return {"stock_ms": statistics.median(times["stock"]), "patched_ms": statistics.median(times["patched"]),
            "stock_first_layer_ms": statistics.median(times["stock_first"]),
            "patched_first_layer_ms": statistics.median(times["patched_first"]), "rounds_ms": times}


def child_main(spec_path: str) -> int:
    import fla_ops  # ci/fla_ops.py, beside this file
    import torch

    spec = json.loads(Path(spec_path).read_text())
    device = spec.get("device", "cuda")  # "cpu" only under TRITON_INTERPRET=1: the comparison's own test
    shape = {"key_heads": spec.get("key_heads", KEY_HEADS), "value_heads": spec.get("value_heads", VALUE_HEADS),
             "dim": spec.get("dim", DIM)}
    sides = {}
    for side, package in (("stock", "fla_stock"), ("patched", "fla_src")):
        assert Path(spec[side]).name == package, spec[side]
        sides[side] = fla_ops.load_chunk(Path(spec[side]).parent, package, cuda=device == "cuda")
    if "window_chunks" in spec:  # tiny windows for tiny steps (the CPU test); else P103's own
        sides["patched"].KILN_P103_WINDOW_CHUNKS = spec["window_chunks"]
    results = []
    for tokens in spec["tokens"]:
        try:
            results.append(_case(tokens, sides, torch, shape, device))
        except Exception as err:  # a size that cannot run is reported, named
            results.append({"tokens": tokens, "error": f"{type(err).__name__}: {str(err)[:400]}"})
        if device == "cuda":
            torch.cuda.empty_cache()
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1]))
