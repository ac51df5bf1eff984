"""ci/gpu_serve_bundle.py and ci/gpu_serve_assemble.py on CPU (issue 37): the bundle is built here,
received part by part and assembled into a clean venv standing in for the GPU machine, and vLLM's
server entry point and every module kiln patches import there, pristine and overlaid.

The stand-in differs from the machine where this one cannot match it, and the test says so:
- Python: this machine has 3.11 only (no 3.12 interpreter is reachable: PyPI's standalone-Python
  installers fetch from GitHub), so the bundle is built with ``--python-version 3.11``, the same
  code path as the machine's 3.12 bundle with cp311 wheels; ``test_the_machine_bundle_resolves``
  resolves the 3.12 set (every carried wheel cp312, abi3 or pure) without installing it;
- torch: 2.11.0 CPU is not reachable (PyPI's 2.11.0 is the CUDA build, several GB with its
  ``nvidia-*`` wheels; the CPU builds are on download.pytorch.org), so the nearest CPU build
  reachable, ``/opt/wheels``' 2.13.0+cpu, stands in; vLLM's ``_C`` (built against 2.11.0) is not
  loaded on CPU, so the gap does not reach the imports checked;
- torchvision and torchaudio: not installed (no CPU build for 2.13.0 is reachable), and nothing
  checked here imports them.
Heavy downloads (the stand-in venv, the wheels) are cached in kiln's cache (``test-assets``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from kiln.source.tree import module_name
from tests.support.registry import _ASSETS, TOOLCHAIN_CACHE, TRITON_CP312_RECORD, fetch_vllm_wheel

pytestmark = pytest.mark.network

REPO = Path(__file__).resolve().parent.parent
BUNDLER = REPO / "ci" / "gpu_serve_bundle.py"
ASSEMBLER = REPO / "ci" / "gpu_serve_assemble.py"
PLAN = REPO / "ci" / "gpu_serve_plan.py"
MIB = 1 << 20
VLLM_SHA256 = "11907857c94c226caf82ada92ab09b1e0dbf538b5b80a93aed74be29e861020c"  # PyPI's, for 0.20.1's wheel

# The GPU machine's packages that vLLM 0.20.1's requirements reach (ci/gpu_machine_packages.txt),
# at the machine's versions where it gives them; torch the nearest CPU build (module docstring).
STANDIN = [
    "torch==2.13.0+cpu", "triton==3.6.0", "transformers==5.17.0", "tokenizers==0.23.2", "safetensors==0.8.0",
    "huggingface-hub==1.33.0", "sentencepiece==0.2.2", "tiktoken==0.14.0", "numpy", "aiohttp", "annotated-doc",
    "anyio", "attrs", "certifi", "click", "cloudpickle", "einops", "filelock", "grpcio", "h11", "httpx", "idna",
    "jinja2", "ninja", "numba", "opencv-python-headless", "packaging", "pillow", "prometheus-client", "protobuf",
    "psutil", "py-cpuinfo", "pyyaml", "regex", "requests", "rich", "setuptools", "six", "tqdm", "typer",
    "typing-extensions", "urllib3", "uvloop",
]
NOT_STOOD_IN = {"torchvision", "torchaudio"}  # on the machine; no CPU build for the stand-in torch here


def _canon(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


@pytest.fixture(scope="module")
def machine_venv() -> Path:
    """A venv of the machine's packages (STANDIN), made once and kept in kiln's cache."""
    key = hashlib.sha256(json.dumps([sys.version, STANDIN]).encode()).hexdigest()[:16]
    venv = _ASSETS / f"gpu-serve-machine-{key}"
    if (venv / "done").is_file() and (venv / "bin" / "python").exists():
        return venv
    shutil.rmtree(venv, ignore_errors=True)  # a venv names its own path: made where it is kept, "done" last
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True, timeout=300)
    # this machine's pip configuration (its mirror, /opt/wheels): where the stand-in torch is
    # --no-compile: the few modules the tests import compile as they load (pip would compile torch's thousands)
    proc = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-compile", *STANDIN],
                          capture_output=True, text=True, timeout=3000)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (venv / "done").write_text(json.dumps(STANDIN))
    return venv


def _installed(python: Path) -> dict[str, str]:
    proc = subprocess.run([str(python), "-c", "import importlib.metadata as m, json; print(json.dumps("
                           "{d.metadata['Name']: d.version for d in m.distributions()}))"],
                          capture_output=True, text=True, check=True)
    return {_canon(k): v for k, v in json.loads(proc.stdout).items()}


@pytest.fixture(scope="module")
def built(machine_venv, tmp_path_factory):
    """The bundle, built for this machine's Python with the stand-in venv making the model."""
    out = tmp_path_factory.mktemp("serve-bundle") / "bundle"
    downloads = _ASSETS / "gpu-serve-bundle" / "downloads"
    wheel = fetch_vllm_wheel()  # the tests' copy of PyPI's wheel: the builder checks its sha256 before use
    seeded = downloads / VLLM_SHA256 / wheel.name
    if not seeded.exists():
        seeded.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(wheel, seeded)  # the same bytes, not a second 233 MiB
        except OSError:
            shutil.copyfile(wheel, seeded)
    env = {**os.environ, "PYTHONPATH": str(REPO), "KILN_CACHE_DIR": str(_ASSETS / "gpu-serve-bundle" / "kiln-cache"),
           "KILN_TRITON_TOOLCHAINS": str(TOOLCHAIN_CACHE / "triton" / "toolchains")}
    sources = _ASSETS.parent / "sources"  # vLLM 0.20.1's pristine tree, as other tests keep it
    cache_sources = _ASSETS / "gpu-serve-bundle" / "kiln-cache" / "sources"
    if sources.is_dir() and not cache_sources.exists():
        cache_sources.parent.mkdir(parents=True, exist_ok=True)
        cache_sources.symlink_to(sources)
    started = time.monotonic()
    proc = subprocess.run([sys.executable, str(BUNDLER), "--out", str(out), "--gpu-triton-record",
                           str(TRITON_CP312_RECORD), "--model-python", str(machine_venv / "bin" / "python"),
                           "--python-version", f"{sys.version_info.major}.{sys.version_info.minor}",
                           "--downloads", str(downloads)], capture_output=True, text=True, env=env, timeout=3000)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, json.loads(proc.stdout), time.monotonic() - started


def _assemble(*args, python=sys.executable):
    return subprocess.run([python, str(ASSEMBLER), *map(str, args)], capture_output=True, text=True, timeout=1200)


def test_the_bundle_holds_what_the_machine_lacks_in_parts_under_the_limit(built, machine_venv):
    out, summary, _ = built
    manifest = json.loads((out / "parts" / "manifest.json").read_text())
    parts = sorted((out / "parts").glob("part-*"))
    assert [p.name for p in parts] == [p["name"] for p in manifest["parts"]] and len(parts) == summary["parts"]
    for part, entry in zip(parts, manifest["parts"], strict=True):
        assert part.stat().st_size == entry["size"] < 60 * MIB
        assert hashlib.sha256(part.read_bytes()).hexdigest() == entry["sha256"]
    bundle = json.loads((out / "stage" / "bundle.json").read_text())
    # vLLM's wheel: PyPI's sha256, without FA3 and the MoE ops, each omission with its reason
    assert bundle["vllm"]["sha256"] == VLLM_SHA256
    omitted = {o["path"]: o for o in bundle["vllm"]["omitted"]}
    assert set(omitted) == {"vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so", "vllm/_moe_C.abi3.so"}
    assert all(o["reason"] and o["size"] > 10 * MIB for o in omitted.values())
    with zipfile.ZipFile(out / "stage" / "wheels" / bundle["vllm"]["repacked"]) as repacked:
        names = set(repacked.namelist())
        record = repacked.read(next(n for n in names if n.endswith(".dist-info/RECORD"))).decode()
        arg_utils = repacked.read("vllm/engine/arg_utils.py").decode()
    # FA3's omission rests on this override; a pin without it would reach FA3 on sm_90
    assert 'resolved_cache_dtype.startswith("turboquant_")' in arg_utils
    assert "attention_config.flash_attn_version = 2" in arg_utils
    # FA2 stays: TurboQuant forces flash_attn_version 2 (arg_utils.py:2003-2014); the H200 run needed it
    assert not set(omitted) & names and "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so" in names
    assert not any(line.split(",")[0] in omitted for line in record.splitlines())
    # the requirements: carried only when the machine lacks them (or has a version vLLM's graph refuses)
    machine = {_canon(line.split()[0]) for line in (REPO / "ci" / "gpu_machine_packages.txt").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    carried = bundle["deps"]["carried"]
    assert {"fastapi", "pydantic", "openai", "xgrammar", "msgspec", "blake3"} <= set(carried)
    assert all(info["why"] != "not on the machine" or name not in machine for name, info in carried.items())
    assert all(name not in machine or info["why"].startswith("the machine has") for name, info in carried.items())
    assert {"torch", "transformers", "triton", "tokenizers"} <= set(bundle["deps"]["on_machine"])
    assert {"flashinfer-python", "tilelang"} <= set(bundle["deps"]["omitted"])
    wheels = {p.name for p in (out / "stage" / "wheels").glob("*.whl")}
    assert len(wheels) == len(carried) + 1
    # the stand-in venv holds every machine package the requirements reach
    installed = _installed(machine_venv / "bin" / "python")
    assert set(bundle["deps"]["on_machine"]) - NOT_STOOD_IN <= set(installed)
    # kiln's layers: the patched files, the audit file, the chat template; the sm_90 kernel cache
    kiln_files = bundle["kiln"]
    assert kiln_files["pin"] == "v0.20.1" and kiln_files["sm"] == 90 and "PN119" in kiln_files["applied"]
    audit = json.loads((out / "stage" / "overlay" / "opt" / "kiln" / "manifest.json").read_text())
    assert sorted(p[len("/site/vllm/"):] for p in audit["files"]) == kiln_files["changed"]
    assert (out / "stage" / "overlay" / "opt" / "kiln" / "chat-templates" / "qwen3.6.jinja").is_file()
    assert kiln_files["kernels"]["launches"] > 0 and not kiln_files["kernels"]["not_built"]
    assert any((out / "stage" / "kernels" / "opt" / "kiln" / "triton-cache").rglob("*.cubin"))
    # the model: Qwen3.5/3.6 hybrid with GDN and full attention, an MTP head, 27B-shaped attention
    config = json.loads((out / "stage" / "model" / "config.json").read_text())
    text = config["text_config"]
    assert config["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    assert set(text["layer_types"]) == {"linear_attention", "full_attention"} and text["mtp_num_hidden_layers"] == 1
    assert (text["head_dim"], text["num_attention_heads"], text["num_key_value_heads"]) == (256, 24, 4)
    assert any(t.startswith("mtp.layers.0.self_attn") for t in bundle["model"]["mtp_tensors"])
    tokenizer = json.loads((out / "stage" / "model" / "tokenizer_config.json").read_text())
    assert "<tool_call>" in tokenizer["chat_template"]
    assert {"<tool_call>", "</tool_call>", "<think>"} <= {t["content"] for t in tokenizer["added_tokens_decoder"].values()}


def test_the_plan_dry_run_carries_each_part_alone_assembles_and_both_sides_import_vllm(
        built, machine_venv, tmp_path):
    """ci/gpu_serve_plan.py's runs against a stand-in machine folder: one part (and the manifest) per
    run, received; then the last run's assembly and the serve preflight (both sides import the server)."""
    out, _, build_seconds = built
    python = machine_venv / "bin" / "python"
    standin = tmp_path / "machine"
    names = [p["name"] for p in json.loads((out / "parts" / "manifest.json").read_text())["parts"]]
    plan = json.loads(subprocess.run([sys.executable, str(PLAN), "plan", "--parts", str(out / "parts")],
                                     capture_output=True, text=True, check=True).stdout)
    assert [run["carry"] for run in plan] == [[".bundle"]] * len(names) + [[]]
    assert all(run["timeout_s"] <= 600 for run in plan) and "--opt-kiln /opt/kiln" in plan[-1]["command"]
    started = time.monotonic()
    proc = subprocess.run([sys.executable, str(PLAN), "dry-run", "--parts", str(out / "parts"), "--standin",
                           str(standin), "--python", str(python)], capture_output=True, text=True, timeout=2400,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    dry_seconds = time.monotonic() - started
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    steps = json.loads(proc.stdout)["steps"]
    received = steps[:len(names)]
    assert all(step["carried_mib"] < 60 for step in received)
    assert [step["said"].rsplit("; ", 1)[1] for step in received] == \
        [f"missing: {' '.join(names[i + 1:])}" for i in range(len(names) - 1)] + ["all parts here"]
    assert [step["run"] for step in steps[len(names):]] == ["assemble", "serve --preflight"]
    prefix = standin / "tmp" / "kiln-serve"
    assembled = json.loads((prefix / "assembled.json").read_text())
    changed = assembled["overlay"]["changed"]
    assert changed == json.loads((out / "stage" / "bundle.json").read_text())["kiln"]["changed"]
    assert any((standin / "opt" / "kiln" / "triton-cache").rglob("*.cubin"))
    preflight = json.loads((standin / "out" / "serve.json").read_text())["sides"]
    for side in ("pristine", "patched"):
        command = preflight[side]["command"]
        assert preflight[side]["imports"], preflight[side]["error"]
        # pristine 0.20.1 refuses TurboQuant for a hybrid model (the H200 run saw it): it serves "auto"
        assert command[command.index("--kv-cache-dtype") + 1] == \
            {"pristine": "auto", "patched": "turboquant_k8v4"}[side]
        assert json.loads(command[command.index("--speculative-config") + 1])["method"] == "mtp"
        assert "--async-scheduling" in command and "--quantization" not in command
    # every module kiln patches imports on both sides: the installed file on one, kiln's on the other
    audit = json.loads((standin / "opt" / "kiln" / "manifest.json").read_text())
    added = {rel for rel in changed if audit["files"][f"/site/vllm/{rel}"]["before"] is None}  # new files
    assert "v1/attention/ops/triton_turboquant_grouped_decode.py" in added  # PN119's kernel

    module = module_name
    # the preflight imported them, and said which file each came from
    seen = {side: preflight[side]["modules"] for side in ("pristine", "patched")}
    assert set(seen["patched"]) == {"vllm.entrypoints.openai.api_server", *map(module, changed)}
    assert set(seen["pristine"]) == {"vllm.entrypoints.openai.api_server", *(module(r) for r in changed if r not in added)}
    for rel in changed:
        sums = audit["files"][f"/site/vllm/{rel}"]
        if rel not in added:
            pristine = seen["pristine"][module(rel)]
            assert pristine[0].startswith(str(prefix / "site")) and pristine[1] == sums["before"]
        patched = seen["patched"][module(rel)]
        assert patched[0].startswith(str(prefix / "patched")) and patched[1] == sums["after"]
    assert not (prefix / "site" / "vllm" / next(iter(added))).exists()
    print(f"build {build_seconds:.0f} s, plan dry-run {dry_seconds:.0f} s")


def test_the_machine_bundle_resolves_for_python_3_12(built):
    """The GPU machine's own set (Python 3.12), resolved without installing: every carried wheel is one
    its CPython 3.12 loads, and only the version conflicts of the machine's packages are carried again."""
    out, _, _ = built
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, str(BUNDLER), "--out", str(out / "unused"), "--gpu-triton-record",
                           str(TRITON_CP312_RECORD), "--model-python", "unused", "--resolve-only",
                           "--downloads", str(_ASSETS / "gpu-serve-bundle" / "downloads")],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    deps = json.loads(proc.stdout)
    tags = {name: info["filename"].rsplit("-", 3)[-3:-1] for name, info in deps["carried"].items()}
    assert all(python in ("cp312", "py3", "py2.py3", "py37", "cp38", "cp39", "cp310", "cp311") and
               abi in ("cp312", "abi3", "none") for python, abi in tags.values()), tags
    assert all(len(info["sha256"]) == 64 for info in deps["carried"].values())
    conflicts = {name for name, info in deps["carried"].items() if info["why"].startswith("the machine has")}
    assert conflicts == {"numpy"}  # mistral-common needs numpy<2.4; the machine has 2.5.2
    assert {"torch", "torchvision", "torchaudio", "triton", "transformers"} <= set(deps["on_machine"])
    assert {"flashinfer-python", "tilelang", "fastsafetensors"} <= set(deps["omitted"])


def test_a_corrupt_part_is_refused_naming_it(built, tmp_path):
    out, _, _ = built
    manifest = json.loads((out / "parts" / "manifest.json").read_text())
    name = manifest["parts"][0]["name"]
    bad = tmp_path / name
    data = bytearray((out / "parts" / name).read_bytes())
    data[len(data) // 2] ^= 0xFF
    bad.write_bytes(bytes(data))
    proc = _assemble("--receive", bad, "--manifest", out / "parts" / "manifest.json", "--into", tmp_path / "in")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"gpu_serve_assemble: {bad}: sha256 differs from the manifest's"]
    assert not (tmp_path / "in" / name).exists()


def test_first_request_compiles_are_named_by_kernel(tmp_path):
    """The serve run names the kernels a first request compiled (a count alone says nothing of which);
    Triton's group files are not kernels."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("gpu_serve_plan", PLAN)
    plan = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plan)
    for entry, files in {"A": ["_tq_decode_stage1.json", "_tq_decode_stage1.cubin", "__grp___tq_decode_stage1.json"],
                         "B": ["chunk_fwd_kernel_o.json"], "C": ["_tq_decode_stage1.json"]}.items():
        (tmp_path / entry).mkdir()
        for name in files:
            (tmp_path / entry / name).write_text("{}")
    before = plan.cache_entries(tmp_path)
    (tmp_path / "D").mkdir()
    (tmp_path / "D" / "_tq_fused_store.json").write_text("{}")
    new = sorted(plan.cache_entries(tmp_path) - before)
    assert new == ["D"] and plan.kernel_names(tmp_path, new) == ["_tq_fused_store"]
    assert plan.kernel_names(tmp_path, ["A", "B", "C"]) == ["_tq_decode_stage1", "chunk_fwd_kernel_o"]
    (tmp_path / "D" / "_tq_fused_store.json").write_text('{"num_warps": 4, "constants": {"BLOCK": 64}}')
    assert plan.kernel_metadata(tmp_path, new) == {"D": {"num_warps": 4, "constants": {"BLOCK": 64}}}
    args = plan.scaled_args(["--kv-cache-dtype", "turboquant_k8v4", "--quantization", "auto_round"],
                            tmp_path / "m", tmp_path / "t.jinja", 0.4, "auto")
    assert args[args.index("--kv-cache-dtype") + 1] == "auto" and "--quantization" not in args


def test_the_plan_refuses_a_part_the_device_run_cannot_carry(tmp_path):
    """A part that, with the checkout's tracked files, is over the 64 MiB a run carries is refused in one
    line before any machine is held (the checkout is ~14 MiB: a 50 MiB part no longer fits)."""
    parts = tmp_path / "parts"
    parts.mkdir()
    for mib, ok in ((60, False), (30, True)):
        manifest = {"format": 1, "parts": [{"name": "part-000", "size": mib * MIB, "sha256": "0" * 64}]}
        (parts / "manifest.json").write_text(json.dumps(manifest))
        proc = subprocess.run([sys.executable, str(PLAN), "plan", "--parts", str(parts)], capture_output=True,
                              text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
        assert (proc.returncode == 0) is ok, proc.stderr
        if not ok:
            assert proc.stderr.count("\n") == 1 and "smaller --part-mib" in proc.stderr
