"""P103 on a GPU: vLLM's GDN chunked prefill, stock against P103's 64-chunk windows, compiled by Triton.

Run by ``ci/gpu_check.py --run-bundle`` (``ci/gpu_bundle.py``) in a fresh process when the bundle's
selection carries P103; the CPU proof is ``tests/patchsets/attention_gdn/test_p103.py`` (bit-equal
outputs and the chunk states bounded by the window, under Triton's interpreter). The bundle holds
the pin's ``third_party/flash_linear_attention/ops`` twice (``fla_stock/``, ``fla_src/``: without
and with the image's patches). Both copies are imported here as packages of their own, with
stand-ins for the four vLLM modules the ``chunk`` closure imports, and each case runs
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
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import statistics
import sys
import types
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OPS = "third_party/flash_linear_attention/ops"
ROUNDS = 3
# Qwen3.6-27B's Gated DeltaNet layers: 16 key heads, 48 value heads, head dims 128 (model card;
# tests/patchsets/support/kvspecs.py's conv and SSM state shapes)
KEY_HEADS, VALUE_HEADS, DIM = 16, 48, 128
TOKENS = (4096, 16384, 65536, 131072)


def compare(bundle: Path, work: Path) -> dict:
    """Run the child on the GPU (its files in ``work``); its report (``ok``, ``summary``, ``cases``)."""
    spec_path = work / "p103.json"
    spec_path.write_text(json.dumps({"stock": str(bundle / "fla_stock"), "patched": str(bundle / "fla_src"),
                                     "tokens": list(TOKENS)}))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_CACHE_DIR"}
    env["TRITON_CACHE_DIR"] = str(work / "p103-triton")
    sys.path.insert(0, str(REPO))
    from kiln import lifeline

    proc = lifeline.run([sys.executable, __file__, str(spec_path)], env=env)  # dies with us, SIGKILL too
    if proc.returncode != 0:
        return {"ok": False, "summary": f"the comparison failed: {proc.stderr.strip()[-2000:]}"}
    cases = json.loads(proc.stdout.strip().splitlines()[-1])
    ok = all("error" not in c and c["o_max_abs_diff"] == 0 and c["state_max_abs_diff"] == 0 for c in cases)
    summary = "; ".join(
        f"{c['tokens']} tokens: {c.get('error') or ''}"
        + ("" if "error" in c else f"diff {c['o_max_abs_diff']:.1e}/{c['state_max_abs_diff']:.1e}, peak "
           f"{c['stock_peak_mib']:.0f} -> {c['patched_peak_mib']:.0f} MiB, {c['stock_ms']:.1f} -> "
           f"{c['patched_ms']:.1f} ms (a step's first layer: {c['stock_first_layer_ms']:.1f} -> "
           f"{c['patched_first_layer_ms']:.1f} ms)") for c in cases)
    return {"ok": ok, "summary": summary, "cases": cases}


# -- the child (on the GPU) ------------------------------------------------------------------------


class _Platform:
    def is_cuda_alike(self) -> bool:
        return True

    def is_cuda(self) -> bool:
        return True

    def __getattr__(self, name):
        if name.startswith("is_"):
            return lambda *a, **k: False
        raise AttributeError(name)


def _h2d(data, device=None, dtype=None, out=None):
    import torch

    return torch.as_tensor(data, dtype=dtype).to(device)


def _stand_ins() -> None:
    import triton
    import triton.language as tl
    import triton.language.extra.libdevice as tldevice

    class FirstConfig(types.ModuleType):
        def __getattr__(self, name):
            return getattr(triton, name)

    first = FirstConfig("triton")
    first.autotune = lambda configs, *a, **k: triton.autotune(configs[:1], *a, **k)
    modules = {
        "vllm": {}, "vllm.utils": {},
        "vllm.triton_utils": {"triton": first, "tl": tl, "tldevice": tldevice},
        "vllm.platforms": {"current_platform": _Platform()},
        "vllm.utils.gpu_sync_debug": {"gpu_sync_allowed": contextlib.nullcontext},
        "vllm.utils.torch_utils": {"async_tensor_h2d": _h2d},
    }
    for name, attrs in modules.items():
        module = types.ModuleType(name)
        module.__path__ = []
        module.__dict__.update(attrs)
        sys.modules[name] = module


def _load(root: str, package: str):
    where = Path(root).parent
    if str(where) not in sys.path:
        sys.path.insert(0, str(where))
    assert Path(root).name == package
    return importlib.import_module(f"{package}.chunk")


def _inputs(tokens: int, torch):
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    q = torch.randn(1, tokens, KEY_HEADS, DIM, device="cuda", generator=gen).half()
    k = torch.nn.functional.normalize(torch.randn(1, tokens, KEY_HEADS, DIM, device="cuda", generator=gen),
                                      dim=-1).half()
    v = torch.randn(1, tokens, VALUE_HEADS, DIM, device="cuda", generator=gen).half()
    g = torch.nn.functional.logsigmoid(torch.randn(1, tokens, VALUE_HEADS, device="cuda", generator=gen) + 2)
    beta = torch.rand(1, tokens, VALUE_HEADS, device="cuda", generator=gen)
    lens = [tokens - tokens // 4, tokens // 4]  # two sequences, one ending mid-chunk
    cu = torch.tensor([0, lens[0], tokens], dtype=torch.int32, device="cuda")
    h0 = torch.randn(2, VALUE_HEADS, DIM, DIM, device="cuda", generator=gen) * 0.1
    return q, k, v, g, beta, h0, cu


def _case(tokens: int, sides: dict, torch) -> dict:
    from triton.testing import do_bench

    inputs = _inputs(tokens, torch)
    # as vLLM's GDN metadata passes them: the step's chunk indices and offsets, made once per step
    index = sys.modules[sides["stock"].__name__.rsplit(".", 1)[0] + ".index"]
    step = (inputs[-1], index.prepare_chunk_indices(inputs[-1], 64), index.prepare_chunk_offsets(inputs[-1], 64))

    def run(chunk, new_step=False, inputs=inputs):
        q, k, v, g, beta, h0, _ = inputs
        cu, chunk_indices, chunk_offsets = (t.clone() for t in step) if new_step else step
        return chunk.chunk_gated_delta_rule(q, k, v, g, beta, scale=DIM ** -0.5, initial_state=h0.clone(),
                                            output_final_state=True, cu_seqlens=cu, chunk_indices=chunk_indices,
                                            chunk_offsets=chunk_offsets, use_qk_l2norm_in_kernel=True)

    out, peak = {}, {}
    for name, chunk in sides.items():
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        o, final = run(chunk, new_step=True)
        torch.cuda.synchronize()
        peak[name] = (torch.cuda.max_memory_allocated() - base) / 2**20
        out[name] = (o.float(), final.float())
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
    return {"tokens": tokens, "sequences": 2, "key_heads": KEY_HEADS, "value_heads": VALUE_HEADS, "dim": DIM,
            "o_max_abs_diff": float((out["stock"][0] - out["patched"][0]).abs().max()),
            "state_max_abs_diff": float((out["stock"][1] - out["patched"][1]).abs().max()),
            "o_finite": bool(torch.isfinite(out["stock"][0]).all()),
            "stock_peak_mib": peak["stock"], "patched_peak_mib": peak["patched"],
            "stock_ms": statistics.median(times["stock"]), "patched_ms": statistics.median(times["patched"]),
            "stock_first_layer_ms": statistics.median(times["stock_first"]),
            "patched_first_layer_ms": statistics.median(times["patched_first"]),
            "rounds_ms": times}


def child_main(spec_path: str) -> int:
    import torch

    spec = json.loads(Path(spec_path).read_text())
    _stand_ins()
    sides = {"stock": _load(spec["stock"], "fla_stock"), "patched": _load(spec["patched"], "fla_src")}
    results = []
    for tokens in spec["tokens"]:
        try:
            results.append(_case(tokens, sides, torch))
        except Exception as err:  # a size that cannot run is reported, named
            results.append({"tokens": tokens, "error": f"{type(err).__name__}: {str(err)[:400]}"})
        torch.cuda.empty_cache()
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1]))
