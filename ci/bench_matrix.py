"""The multi-platform runs of ``ci/bench_build.py --platforms`` (issue 35 item 8).

The base becomes a two-platform index, ``vllm/vllm-openai:<pin>-multi``: the amd64 half is the
benchmark's base, the arm64 half the same roles under an arm64 config, its fillers other
incompressible bytes (so a full pull of the tag moves both halves), its vLLM layer with Triton
3.6.0's real aarch64 cp312 RECORD (the kernels are keyed for each platform's ``libtriton.so``).
vLLM's files are the x86_64 wheel's on both halves: every ``.py`` file is byte-identical between
vLLM's x86_64 and aarch64 wheels (``tests/source/test_platform_wheels.py``), and kiln reads no
other vLLM file. The shipped ``images/qwen3.6-35b-a3b-fp8.toml`` is built, as a user builds it:

  * tag: ``--sm 90`` (linux/amd64 + linux/arm64: one index) from an empty kiln cache, against
    ``skopeo copy --all`` of the two-platform base: <= 0.4x;
  * matrix: every SM of the definition, one build each, each on an empty kiln cache (a CI
    runner each), all with ``--cache-from``/``--cache-to`` one registry build cache, empty at the
    start: the pin's matrix patches once (the ``--json`` lines: patched entries neither hit nor
    shared), and each (SM, platform) compiles its kernels once.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import statistics
import tomllib
from pathlib import Path

from benchlib import REPO, measured
from registry_host import BASE_REPO, REPO_ROOT, VLLM_VERSION

IMAGE, TAG_SM, PIN = "qwen3.6-35b-a3b-fp8", 90, f"v{VLLM_VERSION}"
AARCH64_RECORD = REPO_ROOT / "tests" / "support" / "triton-3.6.0-cp312-aarch64.RECORD"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
GOALS = {"tag_ratio": 0.4, "patch_runs": 1}


def add_arm64_half(work: Path, wheel: Path, filler_bytes: int, fillers: int, build_base) -> dict:
    """The arm64 half (``layout:arm``, from ``wheel``: vLLM's aarch64 wheel) and the index of both
    (``layout:multi``); the arm64 layers."""
    layers = build_base(work, wheel, filler_bytes, fillers, name="arm", arch="arm64", record=AARCH64_RECORD,
                        seed=1000)
    layout = work / "layout"
    index = json.loads((layout / "index.json").read_text())
    refs = {m["annotations"]["org.opencontainers.image.ref.name"]: m for m in index["manifests"]}
    body = json.dumps({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": [
        {"mediaType": refs[name]["mediaType"], "digest": refs[name]["digest"], "size": refs[name]["size"],
         "platform": {"os": "linux", "architecture": arch}} for name, arch in (("base", "amd64"), ("arm", "arm64"))]},
        sort_keys=True).encode()
    digest = hashlib.sha256(body).hexdigest()
    (layout / "blobs/sha256" / digest).write_bytes(body)
    index["manifests"].append({"mediaType": OCI_INDEX, "digest": f"sha256:{digest}", "size": len(body),
                               "annotations": {"org.opencontainers.image.ref.name": "multi"}})
    (layout / "index.json").write_text(json.dumps(index))
    return layers


def matrix_runs(work: Path, server, kiln, env, common: list[str], reps: int) -> dict:
    """Each repetition: ``skopeo copy --all`` of the two-platform base, the tag, the pin's matrix."""
    pins = work / "pins-multi.toml"
    pins.write_text('[pins."v0.33.0"]\nrole = "current"\nimage = "docker.io/vllm/vllm-openai:v0.33.0"\n'
                    'vllm = "0.33.0"\ncuda = "cu130"\n\n'
                    f'[pins."{PIN}"]\nrole = "rollback"\nimage = "docker.io/{BASE_REPO}:{PIN}-multi"\n'
                    f'vllm = "{VLLM_VERSION}"\ncuda = "cu130"\ndigest = ""\n')
    kiln(["--pins", str(pins), "pin", "lock", PIN, *common], env("lock-multi"))
    sms = tomllib.loads((REPO / "images" / f"{IMAGE}.toml").read_text())["sms"]

    def build(out: str, sm: int, *extra: str) -> list[str]:
        return ["--pins", str(pins), "build", "--image", IMAGE, "--pin", PIN, "--sm", str(sm), *common, "--push",
                "--repository", f"{server.host}/bench/{out}", "--json", *extra]

    runs: dict[str, list] = {"baseline": [], "tag": [], "matrix": []}
    for rep in range(1, reps + 1):
        print(f"multi-platform repetition {rep}/{reps}: copy --all, the sm_{TAG_SM} tag, the matrix "
              f"({', '.join(map(str, sms))}) ...", flush=True)
        copy = work / "baseline-all"
        baseline = measured(["skopeo", "copy", "--all", "--quiet", "--src-tls-verify=false",
                             f"docker://{server.host}/{BASE_REPO}:{PIN}-multi", f"oci:{copy}:base"])
        if baseline.returncode != 0:
            raise SystemExit(f"skopeo copy --all failed: {baseline.stderr[-2000:]}")
        runs["baseline"].append((baseline, sum(p.stat().st_size for p in (copy / "blobs/sha256").iterdir())))
        shutil.rmtree(copy)
        tag = kiln(build(f"tag-{rep}", TAG_SM), env(f"tag-{rep}"))
        runs["tag"].append((tag, json.loads(tag.stdout)))
        cache = ("--cache-from", f"{server.host}/bench/matrix-cache-{rep}",
                 "--cache-to", f"{server.host}/bench/matrix-cache-{rep}")
        matrix = [(sm, kiln(build(f"matrix-{rep}", sm, *cache), env(f"matrix-{rep}-sm{sm}"))) for sm in sms]
        runs["matrix"].append([(sm, m, json.loads(m.stdout)) for sm, m in matrix])
    return runs


def patch_runs(result: dict) -> int:
    """The patch runs a build did: its patched entries neither read from a cache nor shared."""
    return sum(1 for e in result["cache"]["entries"] if e["kind"] == "patched" and not e["hit"] and not e.get("shared"))


def compiles(result: dict) -> list[str]:
    return [platform for platform, part in result["platforms"].items()
            if part["triton"].get("compiled") and not part["triton"].get("from_cache")]


def section(runs: dict, verdict) -> str:
    """The markdown the benchmark's section gets for the multi-platform runs."""
    med = statistics.median
    baseline = med(m.wall for m, _ in runs["baseline"])
    tag = med(m.wall for m, _ in runs["tag"])
    tag_json = runs["tag"][0][1]
    totals = [sum(m.wall for _, m, _ in matrix) for matrix in runs["matrix"]]
    first = runs["matrix"][0]
    rows = "\n".join(
        f"| sm_{sm} | {', '.join(j['platforms'])} | {med(r[i][1].wall for r in runs['matrix']):.2f} s | "
        f"{patch_runs(j)} | {', '.join(compiles(j)) or 'none'} | "
        f"{sum(1 for e in j['cache']['entries'] if e['hit'])}/{len(j['cache']['entries'])} |"
        for i, (sm, _, j) in enumerate(first))
    runs_total = sum(patch_runs(j) for _, _, j in first)
    ratio = tag / baseline
    return f"""
### Multi-platform: `images/{IMAGE}.toml` on a linux/amd64 + linux/arm64 base (issue 35)

`skopeo copy --all` of the two-platform base: **{baseline:.2f} s** ({" / ".join(f"{m.wall:.2f}" for m, _ in runs["baseline"])};
{runs["baseline"][0][1] / 2**20:,.1f} MiB). One tag with all its platforms (`--sm {TAG_SM}`: an index
of {", ".join(tag_json["platforms"])}), an empty kiln cache: **{tag:.2f} s**
({" / ".join(f"{m.wall:.2f}" for m, _ in runs["tag"])}); {patch_runs(tag_json)} patch run
(the arm64 half reuses the amd64 half's: the same source), kernels compiled on {", ".join(compiles(tag_json))}.

The pin's whole matrix, one build per SM, each on an empty kiln cache, sharing one registry
build cache that starts empty: **{med(totals):.2f} s** in all ({" / ".join(f"{t:.2f}" for t in totals)}).
First repetition:

| SM | platforms | wall (median) | patch runs | kernels compiled on | cache entries hit |
|---|---|---|---|---|---|
{rows}

| goal | measured | |
|---|---|---|
| one tag, all its platforms, cold <= {GOALS['tag_ratio']}x `skopeo copy --all` | {ratio:.2f}x | {verdict(ratio <= GOALS['tag_ratio'])} |
| a pin's matrix patches once | {runs_total} patch run(s) | {verdict(runs_total == GOALS['patch_runs'])} |
"""
