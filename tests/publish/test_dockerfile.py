"""``build.py context`` + the top-level ``Dockerfile``, built by podman, against the daemonless image.

The base is the vLLM-shaped fixture image plus one layer of stale bytecode (built here with
GNU tar and umoci, pushed with skopeo): ``__pycache__`` entries for the module P65 patches
and for two modules it does not. Both images are built from the same inputs, then read back
through podman, file by file.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

from kiln import paths
from kiln.errors import KilnError
from kiln.oci.layer import LayerContents
from kiln.publish.context import (
    CONTEXT_MARKER,
    ENV_ARGS,
    ENV_STAGES,
    LABEL_ARGS,
    ContextPublisher,
    stage_context,
)
from kiln.staging import commit_all
from tests.support import TEST_IMAGES, podman_store_dir
from tests.support.kiln_process import run_kiln
from tests.support.registry import SITE, VLLM_VERSION, run

pytestmark = pytest.mark.registry

IMAGE = "e2e-p65"
IMAGES = TEST_IMAGES
SM = 120
TAG = f"cu130-sm{SM}-v{VLLM_VERSION}"
BASE_NAME = f"vllm/vllm-openai:v{VLLM_VERSION}-stale-pyc"
PATCHED = f"{SITE}/vllm/v1/attention/backends/turboquant_attn.py"  # what P65 edits
STALE = f"{SITE}/vllm/v1/attention/backends/__pycache__/turboquant_attn.cpython-312.pyc"
KEPT = (f"{SITE}/vllm/v1/attention/backends/__pycache__/registry.cpython-312.pyc",
        f"{SITE}/vllm/__pycache__/envs.cpython-312.pyc")
RUN_FLAGS = ("--rm", "--network", "none", "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024")


@pytest.fixture(scope="module")
def stale_pyc_base(tmp_path_factory, base_layout, registry_plain) -> str:
    """The fixture base plus a top layer of bytecode, as an image built by running vLLM once
    would have; pushed as ``BASE_NAME``. Returns its digest."""
    work = tmp_path_factory.mktemp("stale-pyc")
    layout = work / "layout"
    shutil.copytree(base_layout.path, layout)
    tree = work / "tree"
    for path in (STALE, *KEPT):
        (tree / path).parent.mkdir(parents=True, exist_ok=True)
        (tree / path).write_bytes(b"stale bytecode of " + path.encode() + b"\n")
    run("tar", "--sort=name", "--owner=0", "--group=0", "--numeric-owner", "--format=pax",
        "--mtime=2024-01-01T00:00:00Z", "-C", tree, "-cf", work / "pyc.tar", ".")
    run("umoci", "raw", "add-layer", "--image", f"{layout}:base", "--tag", "stale-pyc",
        "--history.created_by", "fixture bytecode", work / "pyc.tar")
    registry_plain.push(f"oci:{layout}:stale-pyc", BASE_NAME)
    return registry_plain.digest_of(BASE_NAME)


def _cli(capsys, pins: Path, registry, *argv: str, image: str = IMAGE) -> tuple[int, dict | None, str]:
    code, out, err = run_kiln("--pins", pins, "--images", IMAGES, *argv, "--image", image, "--pin", "v0.20.1",
                              "--sm", SM, "--mirror", registry.mirror, "--json")
    return code, (json.loads(out) if code == 0 else None), err


def _pins(tmp_path: Path, digest: str, base_name: str = BASE_NAME) -> Path:
    path = tmp_path / "pins.toml"
    path.write_text(f'[pins."v0.20.1"]\nrole = "current"\nimage = "docker.io/{base_name}"\n'
                    f'vllm = "{VLLM_VERSION}"\ncuda = "cu130"\ndigest = "{digest}"\n')
    return path


class Podman:
    """podman with a private store, and a registries.conf that mirrors docker.io to the test
    registry (plain HTTP), as a team's mirror config would: the context names the real base."""

    def __init__(self, store: Path, mirror_host: str):
        self.store = store
        conf = store / "registries.conf"
        conf.write_text(f'[[registry]]\nprefix = "docker.io"\nlocation = "docker.io"\n'
                        f'[[registry.mirror]]\nlocation = "{mirror_host}"\ninsecure = true\n')
        self.env = {k: v for k, v in os.environ.items() if k != "DOCKER_CONFIG"}
        self.env["CONTAINERS_REGISTRIES_CONF"] = str(conf)

    def __call__(self, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
        cmd = ["podman", "--root", str(self.store / "root"), "--runroot", str(self.store / "run"),
               "--runtime", "runc", *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=self.env, cwd=cwd)

    def ok(self, *args: str, cwd: Path | None = None) -> str:
        done = self(*args, cwd=cwd)
        assert done.returncode == 0, f"podman {' '.join(args)}:\n{done.stderr[-2000:]}"
        return done.stdout

    def pull_layout(self, layout: Path, tag: str) -> str:
        """Pull an OCI layout's tagged image; its image id. podman names the image after the
        layout's path, which must be lowercase: pulled by a relative name (the layout's own,
        lowercase) so that a temporary directory with capitals above it does not matter."""
        assert layout.name == layout.name.lower(), layout
        return self.ok("pull", "--quiet", f"oci:{layout.name}:{tag}", cwd=layout.parent).split()[-1]

    def sh(self, image: str, script: str) -> str:
        return self.ok("run", *RUN_FLAGS, image, "sh", "-c", script)

    def labels(self, image: str) -> dict[str, str]:
        return json.loads(self.ok("image", "inspect", "--format", "{{json .Labels}}", image)) or {}

    def config_env(self, image: str) -> list[str]:
        """The config Env, less the default PATH buildah gives an image whose base has none
        (the fixture base sets no Env; the vLLM images do set PATH)."""
        env = json.loads(self.ok("image", "inspect", "--format", "{{json .Config.Env}}", image)) or []
        return [e for e in env if e != "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]


@pytest.fixture
def podman(registry_plain):
    if shutil.which("podman") is None or shutil.which("runc") is None:
        pytest.fail("podman/runc not installed (run ci/test, which installs them)")
    store = podman_store_dir("kd-")
    tool = Podman(store, registry_plain.host)
    yield tool
    tool("system", "reset", "--force")
    shutil.rmtree(store, ignore_errors=True)


def _build_args(context: Path) -> list[str]:
    """What the docs' ``$(sed 's/^/--build-arg=/' DIR/build-args)`` expands to."""
    return [f"--build-arg={line}" for line in (context / "build-args").read_text().splitlines()]


def _read_back(podman: Podman, image: str, paths_in_image: list[str]) -> dict[str, str]:
    """path -> "sha256 mode uid gid size mtime", or "absent", read inside the running image."""
    script = "; ".join(
        f'if [ -e "{p}" ]; then echo "{p} $(sha256sum < "{p}" | cut -c1-64) '
        f'$(ls -ln --full-time "{p}" | tr -s " " | cut -d" " -f1,3,4,5,6,7)"; else echo "{p} absent"; fi'
        for p in paths_in_image
    )
    out = podman.sh(image, script)
    return dict(line.split(" ", 1) for line in out.strip().splitlines())


def test_dockerfile_image_matches_daemonless(capsys, tmp_path, registry_plain, stale_pyc_base, podman):
    pins = _pins(tmp_path, stale_pyc_base)
    code, built, err = _cli(capsys, pins, registry_plain, "build", "--oci", str(tmp_path / "daemonless"))
    assert code == 0, err
    code, context_json, err = _cli(capsys, pins, registry_plain, "context", "--out", str(tmp_path / "ctx"))
    assert code == 0, err
    context = tmp_path / "ctx"

    # the context: the base by digest, the one stale .pyc to remove, kiln's files
    base = f"docker.io/vllm/vllm-openai@{stale_pyc_base}"
    assert (context / "base.txt").read_text() == base + "\n"
    assert (context / "build-args").read_text().splitlines()[0] == f"BASE={base}"
    assert (context / "remove.txt").read_text() == f"/{STALE}\n"  # exactly: the kept ones stay
    assert (context / "Dockerfile").read_bytes() == paths.DOCKERFILE.read_bytes()
    rootfs = sorted(str(p.relative_to(context / "rootfs")) for p in (context / "rootfs").rglob("*") if p.is_file())
    assert rootfs == sorted([PATCHED, "opt/kiln/manifest.json"])
    assert context_json["files"] == [f"/{p}" for p in rootfs] and context_json["tag"] == TAG

    # podman builds the Dockerfile over the base (pulled by digest through the mirror)
    podman.ok("build", "--identity-label=false", *_build_args(context),
              "-t", f"localhost/kiln-dockerfile:{TAG}", str(context))
    daemonless_image = podman.pull_layout(tmp_path / "daemonless", TAG)
    dockerfile_image = f"localhost/kiln-dockerfile:{TAG}"

    # every file kiln wrote (from the audit file), the audit file itself, the bytecode
    audit = json.loads(podman.ok("run", *RUN_FLAGS, daemonless_image, "cat", "/opt/kiln/manifest.json"))
    patched = sorted(audit["files"])
    assert patched == [f"/{PATCHED}"]
    watched = [*patched, "/opt/kiln/manifest.json", f"/{STALE}", *(f"/{p}" for p in KEPT)]
    seen_daemonless = _read_back(podman, daemonless_image, watched)
    seen_dockerfile = _read_back(podman, dockerfile_image, watched)
    assert seen_dockerfile == seen_daemonless  # content, mode, owner, size and mtime alike
    assert seen_daemonless[f"/{STALE}"] == "absent"
    for path in KEPT:
        assert seen_daemonless[f"/{path}"].split()[0] == hashlib.sha256(
            b"stale bytecode of " + path.encode() + b"\n").hexdigest()
    for path in patched:
        assert seen_daemonless[path].split()[0] == audit["files"][path]["after"] != audit["files"][path]["before"]
    manifest_sha = seen_daemonless["/opt/kiln/manifest.json"].split()[0]
    assert manifest_sha == hashlib.sha256((context / "rootfs/opt/kiln/manifest.json").read_bytes()).hexdigest()
    assert audit["base"]["digest"] == stale_pyc_base

    assert podman.config_env(dockerfile_image) == podman.config_env(daemonless_image) == []  # no TRITON_CACHE_DIR here

    # labels: the daemonless image's, plus empty ones where kiln knew no value
    daemonless_labels, dockerfile_labels = podman.labels(daemonless_image), podman.labels(dockerfile_image)
    assert daemonless_labels["io.kiln.patches"] == "P65"
    assert {k: v for k, v in dockerfile_labels.items() if v} == daemonless_labels
    assert {k for k, v in dockerfile_labels.items() if not v} == set(LABEL_ARGS) - set(daemonless_labels)


def test_dockerfile_image_with_triton_cache_matches_daemonless(capsys, tmp_path, registry_plain, podman):
    """The Triton kernel cache layer and its TRITON_CACHE_DIR reach the context too."""
    base_name = f"vllm/vllm-openai:v{VLLM_VERSION}-triton36"
    pins = _pins(tmp_path, registry_plain.digest_of(base_name), base_name)
    code, built, err = _cli(capsys, pins, registry_plain, "build", "--oci", str(tmp_path / "daemonless"),
                            image="e2e-triton")
    assert code == 0, err
    code, _, err = _cli(capsys, pins, registry_plain, "context", "--out", str(tmp_path / "ctx"), image="e2e-triton")
    assert code == 0, err
    context = tmp_path / "ctx"

    # the context's rootfs holds exactly the files of the daemonless image's two kiln layers
    layout = tmp_path / "daemonless"
    [entry] = [m for m in json.loads((layout / "index.json").read_text())["manifests"] if "artifactType" not in m]
    manifest = json.loads((layout / "blobs/sha256" / entry["digest"].split(":")[1]).read_bytes())
    config = json.loads((layout / "blobs/sha256" / manifest["config"]["digest"].split(":")[1]).read_bytes())
    layer_files: dict[str, bytes] = {}
    for layer in manifest["layers"][-2:]:
        with tarfile.open(layout / "blobs/sha256" / layer["digest"].split(":")[1], "r:gz") as tar:
            for member in tar.getmembers():
                if member.isfile() and not Path(member.name).name.startswith(".wh."):
                    layer_files[member.name] = tar.extractfile(member).read()
    rootfs = {str(p.relative_to(context / "rootfs")): p.read_bytes()
              for p in (context / "rootfs").rglob("*") if p.is_file()}
    assert rootfs == layer_files
    assert any(name.startswith("opt/kiln/triton-cache/") for name in rootfs), sorted(rootfs)
    [cache_dir] = [e.split("=", 1)[1] for e in config["config"]["Env"] if e.startswith("TRITON_CACHE_DIR=")]
    args = (context / "build-args").read_text().splitlines()
    assert "KILN_ENV=triton" in args and f"KILN_TRITON_CACHE_DIR={cache_dir}" in args

    podman.ok("build", "--identity-label=false", *_build_args(context), "-t", "localhost/kiln-triton:ctx", str(context))
    daemonless_image = podman.pull_layout(layout, built["tag"])
    assert podman.config_env("localhost/kiln-triton:ctx") == podman.config_env(daemonless_image) == config["config"]["Env"]
    watched = sorted(f"/{name}" for name in rootfs)
    assert _read_back(podman, "localhost/kiln-triton:ctx", watched) == _read_back(podman, daemonless_image, watched)


def test_dockerfile_refuses_another_or_no_base(capsys, tmp_path, registry_plain, stale_pyc_base, podman):
    code, _, err = _cli(capsys, _pins(tmp_path, stale_pyc_base), registry_plain, "context", "--out", str(tmp_path / "ctx"))
    assert code == 0, err
    context = tmp_path / "ctx"
    args = [a for a in _build_args(context) if not a.startswith("--build-arg=BASE=")]
    # the fixture base without the bytecode layer: a valid image, but not the one in base.txt
    other = f"docker.io/vllm/vllm-openai@{registry_plain.digest_of(f'vllm/vllm-openai:v{VLLM_VERSION}')}"
    wrong = podman("build", *args, f"--build-arg=BASE={other}", str(context))
    assert wrong.returncode != 0
    assert f"is not {(context / 'base.txt').read_text().strip()}" in wrong.stderr + wrong.stdout
    unset = podman("build", *args, str(context))
    assert unset.returncode != 0 and "BASE" in unset.stderr


def test_context_command_replaces_its_output_and_says_how_to_build(capsys, tmp_path, registry_plain, stale_pyc_base):
    pins = _pins(tmp_path, stale_pyc_base)
    code, first, err = _cli(capsys, pins, registry_plain, "context", "--out", str(tmp_path / "ctx"))
    assert code == 0, err
    (tmp_path / "ctx/rootfs/leftover").write_text("from an earlier run")
    argv = ["--pins", str(pins), "--images", str(IMAGES), "context", "--image", IMAGE, "--pin", "v0.20.1",
            "--sm", str(SM), "--mirror", registry_plain.mirror, "--out", str(tmp_path / "ctx")]
    code, _, err = run_kiln(*argv)
    assert code == 2  # an existing context is replaced only when asked
    assert "already holds a build context (use --force" in err
    assert (tmp_path / "ctx/rootfs/leftover").exists()
    code, out, _ = run_kiln(*argv, "--force")
    out = " ".join(out.split())
    assert code == 0
    assert f"podman build $(sed 's/^/--build-arg=/' {tmp_path / 'ctx'}/build-args)" in out
    assert f"{IMAGE}:{TAG} {tmp_path / 'ctx'}" in out
    assert not (tmp_path / "ctx/rootfs/leftover").exists()  # replaced whole, not merged
    assert json.loads((tmp_path / "ctx" / CONTEXT_MARKER).read_text())["files"] == first["files"]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


# -- the context writer on its own ------------------------------------------------------------

DIGEST = "sha256:" + "a" * 64


def write_context(layers, base, labels, dest, env=None, force=False):
    """What ``build.py context`` does with a prepared build: check, stage, commit."""
    publisher = ContextPublisher(dest, force)
    publisher.check()
    commit_all([stage_context(layers, base, labels, publisher.path, env)])
    return publisher.path


def test_context_merges_layers_like_an_image(tmp_path):
    lower = LayerContents({"usr/lib/a.py": b"a", "usr/lib/gone.py": b"x"}, ("usr/lib/__pycache__/a.pyc",))
    upper = LayerContents({"usr/lib/__pycache__/a.pyc": b"new"}, ("usr/lib/gone.py", "usr/lib/base-only"))
    dest = write_context([lower, upper], f"docker.io/x/y@{DIGEST}", {"io.kiln.pin": "v1"}, tmp_path / "ctx")
    files = sorted(str(p.relative_to(dest / "rootfs")) for p in (dest / "rootfs").rglob("*") if p.is_file())
    assert files == ["usr/lib/__pycache__/a.pyc", "usr/lib/a.py"]  # upper re-added a.pyc, removed gone.py
    assert (dest / "remove.txt").read_text() == "/usr/lib/base-only\n/usr/lib/gone.py\n"
    assert (dest / "build-args").read_text() == f"BASE=docker.io/x/y@{DIGEST}\nKILN_PLATFORM=linux/amd64\nKILN_ENV=none\nKILN_PIN=v1\n"
    for path in (dest / "rootfs").rglob("*"):
        assert path.stat().st_mtime == 1_000_000_000
        assert oct(path.stat().st_mode & 0o777) == ("0o755" if path.is_dir() else "0o644")
    # written again over itself: refused without --force, then replaced whole, no staging left behind
    with pytest.raises(KilnError, match="already holds a build context"):
        write_context([lower], f"docker.io/x/y@{DIGEST}", {}, dest)
    write_context([lower], f"docker.io/x/y@{DIGEST}", {}, dest, force=True)
    assert (dest / "rootfs/usr/lib/gone.py").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["ctx"]


@pytest.mark.parametrize("base, labels, env, expect", [
    ("docker.io/x/y:latest", {}, {}, "pinned by digest"),
    (f"docker.io/x/y@{DIGEST}", {"io.kiln.new": "1"}, {}, "label io.kiln.new"),
    (f"docker.io/x/y@{DIGEST}", {"io.kiln.pin": "a b"}, {}, "label io.kiln.pin"),
    (f"docker.io/x/y@{DIGEST}", {}, {"TRITON_CACHE_DIR": "/c", "CUDA_HOME": "/x"}, "environment CUDA_HOME, TRITON"),
])
def test_context_bad_input_writes_nothing(tmp_path, base, labels, env, expect):
    with pytest.raises(KilnError, match=re.escape(expect)):
        write_context([LayerContents({"a": b""})], base, labels, tmp_path / "ctx", env=env)
    assert list(tmp_path.iterdir()) == []


def test_context_refuses_to_replace_a_foreign_directory(tmp_path):
    foreign = tmp_path / "ctx"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(KilnError, match="not a kiln build context"):
        write_context([LayerContents({"a": b""})], f"x/y@{DIGEST}", {}, foreign)
    assert [p.name for p in foreign.iterdir()] == ["notes.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["ctx"]
    assert (foreign / CONTEXT_MARKER).exists() is False


def test_dockerfile_declares_every_label_and_env_arg():
    """The Dockerfile's LABEL sets each label from its LABEL_ARGS build arg, and it has one
    stage per ENV_STAGES entry setting exactly those variables from their ENV_ARGS."""
    text = paths.DOCKERFILE.read_text().replace("\\\n", " ")
    declared = set(re.findall(r"^ARG (\w+)", text, re.M))
    assert set(LABEL_ARGS.values()) | set(ENV_ARGS.values()) | {"BASE", "KILN_ENV", "KILN_PLATFORM"} <= declared
    # the one stage on the base picks the context's platform of it
    assert [line for line in text.splitlines() if line.startswith("FROM ") and "${BASE}" in line] == [
        "FROM --platform=${KILN_PLATFORM} ${BASE} AS kiln-env-none"]
    [label_line] = [line for line in text.splitlines() if line.startswith("LABEL ")]
    pairs = dict(re.findall(r'([\w.]+)="\$\{(\w+)\}"', label_line))
    assert pairs == LABEL_ARGS
    stages: dict[str, set[str]] = {}
    current = None
    for line in text.splitlines():
        if match := re.match(r"FROM .* AS kiln-env-(\w+)$", line):
            current = match.group(1)
            stages[current] = set(stages.get("none", set())) if current != "none" else set()
        elif line.startswith("FROM "):
            current = None
        elif (match := re.match(r"ENV (\w+)=\$\{(\w+)\}$", line)) and current:
            assert ENV_ARGS[match.group(1)] == match.group(2)
            stages[current].add(match.group(1))
    assert {frozenset(v): k for k, v in stages.items()} == ENV_STAGES


def test_context_bad_input_from_the_command_line(capsys, tmp_path, registry_plain, stale_pyc_base):
    pins = _pins(tmp_path, "sha256:" + "0" * 64)  # locked to another digest
    code, _, err = _cli(capsys, pins, registry_plain, "context", "--out", str(tmp_path / "ctx"))
    assert code == 2 and "error:" in err and "now resolves to" in err
    assert not (tmp_path / "ctx").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".ctx")] == []


def test_context_for_a_platform_builds_on_that_platform_of_the_base(capsys, tmp_path, registry_plain, podman):
    """``context --platform linux/arm64`` on a two-platform base: build-args name the platform,
    and the Dockerfile's ``FROM --platform`` picks that manifest of the base's index (podman
    builds the base stage, which runs nothing, so no emulation is needed): its architecture and
    layers are the ones skopeo reads for that platform."""
    base_name = f"vllm/vllm-openai:v{VLLM_VERSION}-multi"
    images = tmp_path / "images"
    images.mkdir()
    (images / f"{IMAGE}.toml").write_text(
        (TEST_IMAGES / f"{IMAGE}.toml").read_text().replace("sms = [86, 120]", "sms = [86, 90, 120]"))
    pins = _pins(tmp_path, registry_plain.digest_of(base_name), base_name)
    for platform in ("linux/amd64", "linux/arm64"):
        arch = platform.split("/")[1]
        context = tmp_path / f"ctx-{arch}"
        code, _, err = run_kiln("--pins", pins, "--images", images, "context", "--out", context,
                                "--image", IMAGE, "--pin", "v0.20.1", "--sm", "90", "--platform", platform,
                                "--mirror", registry_plain.mirror, "--json")
        assert code == 0, err
        assert f"KILN_PLATFORM={platform}" in (context / "build-args").read_text().splitlines()
        assert json.loads((context / CONTEXT_MARKER).read_text())["platform"] == platform
        podman.ok("build", "--identity-label=false", *_build_args(context), "--target", "kiln-env-none",
                  "-t", f"localhost/kiln-base:{arch}", str(context))
        built = json.loads(podman.ok("image", "inspect", f"localhost/kiln-base:{arch}"))[0]
        config = json.loads(run_out("skopeo", "--override-arch", arch, "inspect", "--config", "--raw",
                                    "--tls-verify=false", f"docker://{registry_plain.host}/{base_name}"))
        assert built["Architecture"] == config["architecture"] == arch
        assert built["RootFS"]["Layers"] == config["rootfs"]["diff_ids"], platform


def run_out(*argv: str) -> str:
    return subprocess.run(list(argv), capture_output=True, text=True, check=True).stdout
