"""The images kiln ships (``images/qwen3.6-27b-tq.toml`` and ``qwen3.6-35b-a3b-fp8.toml``, their
Triton layers included), built as a new user builds them: from empty caches, against a
vLLM-shaped base in a local registry.

Only what must be is overridden: ``--pins`` points the definition's pin at the local base
(the fixture image with Triton 3.6.0's dist-info) and ``--mirror`` stands the registry in for
Docker Hub. Builds run as subprocesses of ``build.py``, as a user runs them.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from kiln import paths
from tests.support import TEST_IMAGES
from tests.support.registry import VLLM_VERSION

pytestmark = pytest.mark.registry

IMAGE, PIN, SM = "qwen3.6-27b-tq", f"v{VLLM_VERSION}", 120
SHIPPED = paths.IMAGES / f"{IMAGE}.toml"


def _pins(root: Path, registry, variant: str = "triton36", release: str | None = None) -> Path:
    """Both shipped pins: PIN on the vLLM-shaped local base ``variant``, locked; v0.33.0 locked on
    ``release`` (0.33.0's two-platform base made from its real wheels) when given, else unlocked
    (not built)."""
    name = f"vllm/vllm-openai:v{VLLM_VERSION}-{variant}"
    path = root / "pins.toml"
    current = f'digest = "{registry.digest_of(release)}"\n' if release else ""
    path.write_text('[pins."v0.33.0"]\nrole = "current"\nimage = "docker.io/vllm/vllm-openai:v0.33.0"\n'
                    f'vllm = "0.33.0"\ncuda = "cu130"\n{current}\n'
                    f'[pins."{PIN}"]\nrole = "rollback"\nimage = "docker.io/{name}"\nvllm = "{VLLM_VERSION}"\n'
                    f'cuda = "cu130"\ndigest = "{registry.digest_of(name)}"\n')
    return path


def _kiln(python: str, cwd: Path, env: dict, *argv: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("KILN_", "TMPDIR"))}
    return subprocess.run([python, str(paths.REPO / "build.py"), *argv], cwd=cwd, env={**base, **env},
                          capture_output=True, text=True, timeout=900)


_NO_TORCH = """import sys


class _Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("torch", "numpy"):
            raise ModuleNotFoundError(f"No module named {name!r} (the README's install has none)")


sys.meta_path.insert(0, _Refuse())
"""


def _other_venv(root: Path) -> str:
    """A second interpreter path (another venv) that sees kiln's packages, as another user's would,
    but not torch or numpy: the README's install has neither, and a build must not need them."""
    venv.EnvBuilder(with_pip=False).create(root)
    [site] = root.glob("lib/python3*/site-packages")
    own = next(p for p in sys.path if p.endswith("site-packages") and Path(p, "libcst").is_dir())
    (site / "kiln_no_torch.py").write_text(_NO_TORCH)
    (site / "kiln-test.pth").write_text(f"import site; site.addsitedir({own!r})\nimport kiln_no_torch\n")
    python = str(root / "bin" / "python")
    probe = subprocess.run([python, "-c", "import torch"], capture_output=True, text=True)
    assert probe.returncode == 1 and "the README's install has none" in probe.stderr
    return python


def _layers(layout: Path) -> dict[str, list[str]]:
    """manifest digest -> its layers, of the one tag in the layout: the image, or each platform's of an index."""
    def blob(digest: str) -> dict:
        return json.loads((layout / "blobs/sha256" / digest.split(":")[1]).read_bytes())

    [entry] = [m for m in json.loads((layout / "index.json").read_text())["manifests"] if "artifactType" not in m]
    top = blob(entry["digest"])
    manifests = [m["digest"] for m in top["manifests"]] if "manifests" in top else [entry["digest"]]
    return {digest: [layer["digest"] for layer in blob(digest)["layers"]] for digest in manifests}


def _skopeo_platforms(registry, name: str) -> list[str]:
    """The platforms a pushed tag holds, as skopeo reads them: an index's entries, or an image's config."""
    def inspect(*flags: str) -> dict:
        return json.loads(subprocess.run(["skopeo", "inspect", *flags, "--tls-verify=false",
                                          f"docker://{registry.host}/{name}"], capture_output=True, check=True).stdout)

    top = inspect("--raw")
    if "manifests" in top:
        return [f"{m['platform']['os']}/{m['platform']['architecture']}" for m in top["manifests"]]
    config = inspect("--config", "--raw")
    return [f"{config['os']}/{config['architecture']}"]


def _base_layers(registry, name: str) -> dict[str, list[str]]:
    """platform -> its manifest's layers, of a two-platform index in ``registry``, read by skopeo."""
    def raw(ref: str) -> dict:
        return json.loads(subprocess.run(["skopeo", "inspect", "--raw", "--tls-verify=false",
                                          f"docker://{registry.host}/{ref}"], capture_output=True, check=True).stdout)

    repo = name.rsplit(":", 1)[0]
    return {f"{m['platform']['os']}/{m['platform']['architecture']}":
            [layer["digest"] for layer in raw(f"{repo}@{m['digest']}")["layers"]] for m in raw(name)["manifests"]}


# sm_120 on the rollback pin: one linux/amd64 image. On the current pin, v0.33.0, whose base is
# an index of amd64 and arm64 made from both of its real wheels: sm_90 an index of both, each
# platform's kernels keyed for its own Triton (3.8.0's x86_64 and aarch64 builds); sm_121 (DGX
# Spark) one linux/arm64 image
@pytest.mark.parametrize(("image", "pin", "sm", "platforms"), [
    (IMAGE, PIN, SM, ["linux/amd64"]),
    ("qwen3.6-35b-a3b-fp8", "v0.33.0", 90, ["linux/amd64", "linux/arm64"]),
    ("qwen3.6-35b-a3b-fp8", "v0.33.0", 121, ["linux/arm64"])])
def test_shipped_definition_builds_bit_reproducibly(tmp_path, registry_plain, release_multi, image, pin, sm,
                                                    platforms):
    """Two cold builds: other cache, toolchain location, working and temp directory, interpreter path
    (the second without torch or numpy). sm_121 is built once: its arm64 image is the sm_90 index's
    arm64 half at another SM, whose reproducibility the sm_90 case shows (CI's time, docs/CI.md)."""
    assert "[model.kernels]" in (paths.IMAGES / f"{image}.toml").read_text()  # the Triton layer is compared
    pins = _pins(tmp_path, registry_plain, release=release_multi)
    triton = "3.6.0" if pin == PIN else "3.8.0"
    results, layers = [], []
    runs = [("one", sys.executable)] + ([("two", _other_venv(tmp_path / "venv-two"))] if sm != 121 else [])
    for run, python in runs:
        work = tmp_path / f"work-{run}"
        (work / "tmp").mkdir(parents=True)
        env = {"KILN_CACHE_DIR": str(work / "cache"), "TMPDIR": str(work / "tmp"),
               "KILN_REGISTRIES": str(work / "registries.toml"), "DOCKER_CONFIG": str(work / "docker")}
        pushed = f"{registry_plain.host}/kiln/shipped-{image}-{run}"  # the push and the layout: one image
        done = _kiln(python, work, env, "--pins", str(pins), "build", "--image", image, "--pin", pin,
                     "--sm", str(sm), "--mirror", registry_plain.mirror, "--oci", str(work / "out"), "--json",
                     "--push", "--repository", pushed)
        assert done.returncode == 0, done.stderr[-3000:]
        result = json.loads(done.stdout)
        # a cold build: the toolchain fetched into this cache, every kernel compiled here
        assert (work / f"cache/triton/toolchains/triton-{triton}/triton/__init__.py").is_file()
        for part in result["platforms"].values():
            assert part["triton"]["compiled"] > 0 and not part["triton"]["from_cache"]
        # the first platform's kernels compiled beside the patching, from the patched text they read
        assert next(iter(result["platforms"].values()))["triton"]["beside_patching"] is True
        results.append(result)
        layers.append(_layers(work / "out"))
    one, two = results[0], results[-1]
    assert one["image"] == image and one["tag"] == f"cu130-sm{sm}-{pin}"
    assert list(one["platforms"]) == platforms
    assert one["triton"]["kernels"] >= 3 and layers[0] == layers[-1]  # every layer of every platform
    for part in one["platforms"].values():
        found = layers[0][part["manifest_digest"]]
        assert found[-2] == part["layer_digest"] == one["layer_digest"]  # the patched-source layer
    assert one["config_digest"] == two["config_digest"]
    assert one["manifest_digest"] == two["manifest_digest"]
    # each platform's kernels keyed for its own Triton (sm_90: two libtriton.so, two keys)
    keyed = {p: part["triton"]["libtriton_sha256"] for p, part in one["platforms"].items()}
    assert len(set(keyed.values())) == len(platforms), keyed
    assert all(part["triton"]["keyed_for_image"] for part in one["platforms"].values())
    if pin != PIN:  # each platform's image starts with its own half of 0.33.0's base, layer for layer
        base = _base_layers(registry_plain, release_multi)
        assert len({tuple(v) for v in base.values()}) == 2  # two halves: two wheels, two Tritons
        for platform, part in one["platforms"].items():
            assert layers[0][part["manifest_digest"]][:len(base[platform])] == base[platform], platform
    # what the registry holds under the tag, read by skopeo: exactly the SM's platforms (sm_121:
    # one arm64 image), at the digest both builds reported
    for run, _ in runs:
        name = f"kiln/shipped-{image}-{run}:{one['tag']}"
        assert registry_plain.digest_of(name) == one["manifest_digest"]
        assert _skopeo_platforms(registry_plain, name) == platforms


def test_push_without_a_repository_asks_for_one_before_any_work(tmp_path, registry_plain):
    assert not re.search(r"^repository\s*=", SHIPPED.read_text(), re.MULTILINE)
    pins = _pins(tmp_path, registry_plain)
    before = registry_plain.log()
    done = _kiln(sys.executable, tmp_path, {"KILN_CACHE_DIR": str(tmp_path / "cache")},
                 "--pins", str(pins), "build", "--image", IMAGE, "--pin", PIN,
                 "--sm", str(SM), "--mirror", registry_plain.mirror, "--push")
    assert done.returncode == 2
    assert done.stderr.strip() == (f"error: {SHIPPED}: repository: not set; --push needs one: pass --repository "
                                   "REGISTRY/NAMESPACE/NAME or set `repository` in the image definition")
    assert registry_plain.log() == before  # nothing was asked of the mirror


def test_push_through_a_mirror_goes_to_docker_hub_never_to_the_mirror(tmp_path, start_registry, registry_plain):
    mirror = start_registry("plain", copy_from=registry_plain)  # its own access log
    name = f"vllm/vllm-openai:v{VLLM_VERSION}"
    pins = tmp_path / "pins.toml"
    pins.write_text(f'[pins."{PIN}"]\nrole = "current"\nimage = "docker.io/{name}"\nvllm = "{VLLM_VERSION}"\n'
                    f'cuda = "cu130"\ndigest = "{mirror.digest_of(name)}"\n')
    done = _kiln(sys.executable, tmp_path,
                 {"KILN_CACHE_DIR": str(tmp_path / "cache"), "KILN_REGISTRY_RETRIES": "0",
                  "KILN_REGISTRIES": str(tmp_path / "none.toml"), "DOCKER_CONFIG": str(tmp_path / "docker")},
                 "--pins", str(pins), "--images", str(TEST_IMAGES), "build", "--image", "e2e-p65", "--pin", PIN,
                 "--sm", str(SM), "--mirror", f"docker.io=http://{mirror.host}", "--push",
                 "--repository", "docker.io/x/y")
    log = mirror.log()
    writes = [line for line in log.splitlines() if re.search(r'"(PUT|POST|PATCH|DELETE) /v2/', line)]
    assert writes == []
    if done.returncode == 0:  # a machine that reaches Docker Hub (with push rights to x/y)
        assert re.search(r'"GET /v2/vllm/vllm-openai/blobs/', log)  # the pull did use the mirror
        assert "registry-1.docker.io" in done.stdout + done.stderr
    else:  # the push check (before any work) asked Docker Hub, not the mirror: nothing was pulled
        assert not re.search(r'"GET /v2/vllm/vllm-openai/blobs/', log)
        assert done.returncode == 2 and "registry-1.docker.io" in done.stderr, done.stderr[-2000:]
        assert mirror.host not in done.stderr.splitlines()[-1]
