"""Compile or check one SM's Triton kernels through Triton's own JIT path, without a GPU.

Run as a script in the toolchain's Python (``python worker.py JOB.json``); prints one JSON
report on stdout. It imports nothing from kiln: the toolchain may be another interpreter.

What it does, in order:
1. puts the toolchain's ``site`` directory first on ``sys.path`` (the Triton the image carries)
   and, when the job names ``standin_torch``, registers that file as ``torch``: tensors with
   shapes, strides and dtypes but no data, all the binder and the launchers read (a build
   needs no torch; ``ci/gpu_check.py`` runs the builders on real CUDA tensors instead);
2. installs a stand-in Triton driver whose target is ``GPUTarget("cuda", sm, 32)`` — what the
   real ``CudaDriver`` reports on that GPU — with a no-op launcher, so a launch compiles the
   kernel for real (ptxas and all) and then does nothing;
3. builds stand-in ``vllm`` packages: ``vllm.triton_utils`` (the real Triton; vLLM's own module
   swaps ``@triton.jit`` for a placeholder when no driver is active and would silently compile
   nothing), ``vllm.platforms`` (a non-CUDA platform, so nothing asks torch for a GPU), and one
   package object per directory level whose ``__path__`` lists the patched overlay first and the
   pristine tree second — kernel modules are then loaded from the patched files as they will be
   in the image (same text, same line numbers: Triton's cache key holds the first decorator's
   line), and package ``__init__`` files are not run;
4. forces the fp8 flavour the real GPU would pick (``FP8_E4B15`` = 1 below sm_89);
5. calls vLLM's launcher functions with CPU tensors of the runtime shapes (``BUILDERS``), so the
   argument specialisation (dtypes, divisibility by 16, constexprs) is computed by Triton's
   binder exactly as in a real launch;
6. makes every process it starts (``ptxas``) die with it, as it dies with the build
   (``worker_process.children_die_with_me``);
   counts compiles and cache hits with ``triton.knobs.compilation.listener``;
7. when the job names the image's libtriton.so (``key_libtriton``: the image runs another
   Python's wheel of the same Triton, see ``imagekey.py``), keys every entry as that Triton
   does: ``triton_key()`` holds the sha256 of libtriton.so once, and it is replaced there; and
   when it names the image's ptxas text (``key_ptxas``: an image of another machine), the
   backend's ``hash()`` gets that text for the one our ptxas prints.

A failing launch (e.g. fp8e4b15 from bf16 on sm_86) is reported, not raised: the caller
decides what a failure means.

Job (JSON): {"mode": "compile"|"check", "sm": int, "toolchain_site": str|null, "standin_torch": str|null,
             "roots": [overlay, pristine], "preset": {...}, "launches": [{"kernel", "module",
             "function", "builder", "params"}], "key_libtriton": {"own": hex, "image": hex}|null,
             "key_ptxas": {"<our ptxas --version>": "<the image's>"}|null}
The cache directory and Triton's environment come from the process environment.
What ``ci/gpu_check.py`` and ``ci/gpu_pn119.py`` use on a real GPU (imported by path): ``install_vllm``,
``force_fp8_flavour``, ``use_device``, ``BUILDERS``, ``TQ_CONFIG``.
Report (written to the job's "report" path): {"triton": version, "launches": [{"kernel", "params", "compiled": [...], "hits": [...],
         "error": str|null}], "modules": {module: file}}
"""

from __future__ import annotations

import json
import math
import os
import sys
import traceback
import types


def _beside(name: str) -> types.ModuleType:
    """A module of this folder, by its path: the worker runs under the toolchain's Python (or a
    GPU machine's), where kiln is no package it could import."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"kiln_worker_{name}", os.path.join(os.path.dirname(
        os.path.abspath(__file__)), f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_process = _beside("worker_process")
NO_SPACE, children_die_with_me, exit_on_no_space = (_process.NO_SPACE, _process.children_die_with_me,
                                                    _process.exit_on_no_space)
_keys = _beside("worker_keys")  # keying entries for the image's Triton (its part of the entry key: aot.py)


def _setup_path(job: dict) -> None:
    site = job.get("toolchain_site")
    if site:
        sys.path.insert(0, site)
    standin = job.get("standin_torch")
    if standin:  # before Triton or vLLM import torch: tensors without data (standin_torch.py)
        import importlib.util

        spec = importlib.util.spec_from_file_location("torch", standin)
        module = importlib.util.module_from_spec(spec)
        sys.modules["torch"] = module
        spec.loader.exec_module(module)


def _install_driver(sm: int):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.driver import DriverBase

    class _Utils:
        def get_device_properties(self, device):
            # generous limits: a kernel Triton compiled is never refused here
            return {"max_shared_mem": 1 << 30, "multiprocessor_count": 1, "max_num_regs": 65536,
                    "warpSize": 32, "sm_clock_rate": 1, "mem_clock_rate": 1, "mem_bus_width": 1}

        def load_binary(self, name, kernel, shared, device):
            return None, None, 0, 0, 1 << 20

    class _NoLaunch:
        def __init__(self, src, metadata):
            pass

        def __call__(self, *args, **kwargs):
            return None

    class StandInDriver(DriverBase):
        """The target a real CUDA GPU of this SM reports; launches do nothing."""

        def __init__(self):
            self.target = GPUTarget("cuda", sm, 32)
            self.utils = _Utils()
            self.launcher_cls = _NoLaunch

        @classmethod
        def is_active(cls):
            return True

        def map_python_to_cpp_type(self, ty):
            raise NotImplementedError

        def get_current_target(self):
            return self.target

        def get_active_torch_device(self):
            import torch
            return torch.device("cpu")

        def get_benchmarker(self):
            raise NotImplementedError

        def get_current_device(self):
            return 0

        def set_current_device(self, device):
            pass

        def get_current_stream(self, device=None):
            return 0

        def get_device_interface(self):
            raise NotImplementedError

    from triton.runtime.driver import driver

    driver.set_active(StandInDriver())
    return triton


class _Platform:
    """vLLM's ``current_platform`` as a non-CUDA platform: every ``is_*()`` answers False."""

    device_type = "cpu"

    def __getattr__(self, name):
        if name.startswith("is_"):
            return lambda *a, **k: False
        raise AttributeError(name)


def install_vllm(roots: list[str], modules: list[str]) -> None:
    import triton
    import triton.language as tl

    def package(name: str) -> types.ModuleType:
        if name in sys.modules:
            return sys.modules[name]
        module = types.ModuleType(name)
        rel = name.split(".")
        module.__path__ = [p for p in (os.path.join(root, *rel) for root in roots) if os.path.isdir(p)]
        module.__package__ = name
        sys.modules[name] = module
        if "." in name:
            parent, _, child = name.rpartition(".")
            setattr(package(parent), child, module)
        return module

    package("vllm")
    triton_utils = types.ModuleType("vllm.triton_utils")
    triton_utils.HAS_TRITON = True
    triton_utils.triton, triton_utils.tl = triton, tl
    triton_utils.LOG2E, triton_utils.LOGE2 = 1.4426950408889634, 0.6931471805599453
    try:
        import triton.language.extra.libdevice as tldevice
        triton_utils.tldevice = tldevice
    except ImportError:
        pass
    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = _Platform()
    sys.modules["vllm.triton_utils"] = triton_utils
    sys.modules["vllm.platforms"] = platforms
    for name in modules:
        package(name.rpartition(".")[0])


def force_fp8_flavour(sm: int) -> None:
    """Seed vLLM's per-device memo of ``_use_fp8_e4b15`` with what the GPU would answer."""
    decode = sys.modules.get("vllm.v1.attention.ops.triton_turboquant_decode")
    memo = getattr(decode, "_FP8_E4B15", None)
    if isinstance(memo, dict):
        memo[0] = 1 if sm < 89 else 0


# -- launches: vLLM's launchers with CPU tensors of the runtime shapes --------------------------


TQ_CONFIG = "vllm.model_executor.layers.quantization.turboquant.config"


def _tq_config(preset: dict, kv_preset: str):
    import importlib

    config = importlib.import_module(TQ_CONFIG)
    return config.TurboQuantConfig.from_cache_dtype(kv_preset, preset["head_dim"])


_DEVICE = "cpu"  # where the builders allocate: "cuda" when ci/gpu_check.py runs them on a GPU (use_device)


def use_device(device: str) -> None:
    """Allocate the builders' tensors on ``device`` ("cpu", or "cuda" on a real GPU)."""
    global _DEVICE
    _DEVICE = device


def _dtype(name: str):
    import torch

    return {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[name]


def _kv_cache(preset: dict, cfg, block_size: int, num_blocks: int = 2):
    import torch

    # (kernel blocks, kernel block size, Hk, slot_size_aligned), contiguous: 0.20.1's view of the
    # layer's buffer, and the strides 0.33.0's LBNHC view gets after the backend's transpose(1, 2)
    # (kiln/triton/runtime_layout.py; tests/triton/test_runtime_layout.py derives both)
    return torch.zeros(num_blocks, block_size, preset["num_kv_heads"], cfg.slot_size_aligned,
                       dtype=torch.uint8, device=_DEVICE)


def _centroids(cfg):
    import torch

    return torch.linspace(-1.0, 1.0, cfg.n_centroids, dtype=torch.float32, device=_DEVICE)


def _rotation(d: int):
    import torch

    return torch.eye(d, dtype=torch.float32, device=_DEVICE)


def build_store(fn, preset: dict, params: dict) -> None:
    """``TurboQuantAttentionImpl._store_kv``: keys/values (N, Hk, D), int64 slot mapping."""
    import torch

    cfg = _tq_config(preset, params["kv_preset"])
    d, hk, n = preset["head_dim"], preset["num_kv_heads"], params["tokens"]
    dtype = _dtype(preset["dtype"])
    key = torch.zeros(n, hk, d, dtype=dtype, device=_DEVICE)
    value = torch.zeros(n, hk, d, dtype=dtype, device=_DEVICE)
    slots = torch.full((n,), -1, dtype=torch.int64, device=_DEVICE)  # vLLM's slot_mapping buffer is int64
    c = _centroids(cfg).sort().values
    fn(key, value, _kv_cache(preset, cfg, params["kernel_block_size"]), slots, _rotation(d), (c[:-1] + c[1:]) / 2,
       mse_bits=cfg.key_mse_bits, key_packed_size=cfg.key_packed_size,
       value_quant_bits=cfg.effective_value_quant_bits, key_fp8=cfg.key_fp8)


def build_decode(fn, preset: dict, params: dict) -> None:
    """``_decode_attention`` (per-layer buffers) or the continuation fast path (expanded table).

    ``kernel_block_size`` and ``table_width`` (the block table's row stride) are the runtime's
    (kiln/triton/runtime_layout.py); ``seq_lens_offset`` starts seq_lens that many int32 into
    its buffer, as the continuation's slice of a cached arange does."""
    import torch

    cfg = _tq_config(preset, params["kv_preset"])
    d, hq, block_size = preset["head_dim"], preset["num_heads"], params["kernel_block_size"]
    dtype = _dtype(preset["dtype"])
    batch = params["batch"]
    blocks_per_req = params["table_width"]
    query = torch.zeros(batch, hq, d, dtype=dtype, device=_DEVICE)
    offset = params.get("seq_lens_offset", 0)
    seq_lens = torch.ones(offset + batch, dtype=torch.int32, device=_DEVICE)[offset:]
    splits = preset["max_num_kv_splits"]
    common = dict(Pi=_rotation(d), centroids=_centroids(cfg), scale=1.0 / math.sqrt(d),
                  mse_bits=cfg.key_mse_bits, key_packed_size=cfg.key_packed_size,
                  value_quant_bits=cfg.effective_value_quant_bits, key_fp8=cfg.key_fp8,
                  norm_correction=cfg.norm_correction, PiT=_rotation(d))
    kv_cache = _kv_cache(preset, cfg, block_size)
    if params.get("continuation"):
        # turboquant_attn.py continuation chunk: block_table[i:i+1].expand(q_len, -1), stride 0
        table = torch.zeros(preset["max_num_seqs"], blocks_per_req, dtype=torch.int32, device=_DEVICE)
        fn(query=query, kv_cache=kv_cache, block_table=table[0:1].expand(batch, -1),
           seq_lens=seq_lens, **common)
        return
    table = torch.zeros(max(batch, preset["max_num_seqs"]), blocks_per_req, dtype=torch.int32, device=_DEVICE)[:batch]
    rows = max(batch, preset["max_num_seqs"])
    mid_o = torch.empty(rows, hq, splits, d + 1, dtype=torch.float32, device=_DEVICE)
    out = torch.empty(rows, hq, d, dtype=torch.float32, device=_DEVICE)
    lse = torch.empty(rows, hq, dtype=torch.float32, device=_DEVICE)
    fn(query=query, kv_cache=kv_cache, block_table=table, seq_lens=seq_lens, mid_o_buf=mid_o,
       output_buf=out, lse_buf=lse, max_num_kv_splits=splits, **common)


# name -> how to call the launcher; kiln/triton/kernels.py names the same builders
BUILDERS = {"store": build_store, "decode": build_decode}


# -- main ---------------------------------------------------------------------------------------


def run(job: dict) -> dict:
    _setup_path(job)
    sm = job["sm"]
    triton = _install_driver(sm)
    _keys.key_for_image(job.get("key_libtriton"))
    _keys.ptxas_for_image(job.get("key_ptxas"))
    launches = job["launches"]
    install_vllm(job["roots"], [launch["module"] for launch in launches] + [TQ_CONFIG])
    import importlib

    events: list[tuple[str, bool]] = []

    def listener(*, src, metadata, metadata_group, times, cache_hit):
        events.append((metadata.get("name") if isinstance(metadata, dict) else getattr(src, "name", "?"),
                       bool(cache_hit), metadata.get("hash") if isinstance(metadata, dict) else None))

    triton.knobs.compilation.listener = listener
    report: dict = {"triton": triton.__version__, "launches": [], "modules": {}}
    for launch in launches:
        entry = {"kernel": launch["kernel"], "params": launch["params"], "compiled": [], "hits": [],
                 "error": None}
        report["launches"].append(entry)
        try:
            module = importlib.import_module(launch["module"])
            report["modules"][launch["module"]] = module.__file__
            fn = getattr(module, launch["function"])
            force_fp8_flavour(sm)
            for name, value in vars(module).items():
                # vLLM's placeholder decorator would make this a plain function: compile nothing
                if name.startswith("_tq_") and callable(value) and not isinstance(value, triton.runtime.JITFunction):
                    raise RuntimeError(f"{launch['module']}.{name} is not a Triton JITFunction")
            del events[:]
            BUILDERS[launch["builder"]](fn, job["preset"], launch["params"])
        except Exception as err:  # reported per launch; the caller names kernel and SM
            if isinstance(err, OSError) and err.errno in NO_SPACE:  # a full disk is no kernel's fault
                raise
            entry["error"] = _describe(err)
        for name, hit, digest in events:
            entry["hits" if hit else "compiled"].append({"name": name, "hash": digest})
        del events[:]
    return report


def _describe(err: BaseException) -> str:
    text = f"{type(err).__name__}: {err}".strip()
    cause, seen = err.__cause__ or err.__context__, 0
    while cause is not None and seen < 4:  # Triton's CompilationError hides the reason in its cause
        text += f"\ncaused by {type(cause).__name__}: {cause}"
        cause, seen = cause.__cause__ or cause.__context__, seen + 1
    lines = [line for line in text.splitlines() if line.strip()]
    if len(lines) > 40:
        lines = lines[:20] + ["..."] + lines[-20:]
    if not lines:
        lines = traceback.format_exception_only(type(err), err)
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    children_die_with_me()
    with open(argv[1]) as handle:
        job = json.load(handle)
    report = run(job)
    tmp = job["report"] + ".tmp"
    with open(tmp, "w") as handle:
        json.dump(report, handle)
    os.replace(tmp, job["report"])
    return 0


if __name__ == "__main__":
    exit_on_no_space(main, sys.argv)
