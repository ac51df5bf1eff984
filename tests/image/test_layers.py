"""The deterministic layer writer, the pure image steps and the bake, checked with real tools.

No registry needed: layers are written to a temporary directory and read back with Python's
gzip/tarfile and GNU tar; determinism is checked across two separate Python processes.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from kiln.errors import KilnError
from kiln.image.layers import AUDIT_PATH, patched_contents, pyc_whiteouts
from kiln.oci.layer import GZIP_LEVEL, LAYER_MTIME, LayerBuilder, diff_id_of, write_layer
from kiln.oci.manifest import Manifest
from kiln.oci.mediatypes import DOCKER_LAYER_GZIP, DOCKER_MANIFEST, OCI_LAYER_GZIP, OCI_MANIFEST
from kiln.oci.mutate import (
    ImageModel,
    append_layer,
    canonical_json,
    to_oci,
    with_annotations,
    with_env,
    with_labels,
)

pytestmark = pytest.mark.isolated

SITE = "usr/local/lib/python3.12/dist-packages"


def _members(path: Path) -> list[tarfile.TarInfo]:
    with tarfile.open(path, "r:gz") as tar:
        return tar.getmembers()


def _sample(builder: LayerBuilder, tmp: Path) -> None:
    big = tmp / "big.bin"
    big.write_bytes(bytes(range(256)) * 4096)
    builder.add_file(f"/{SITE}/vllm/v1/attention/backends/" + "very_long_module_name_" * 6 + ".py", b"x = 1\n")
    builder.add_file(f"{SITE}/vllm/envs.py", "# ünïcode\n".encode())
    builder.add_file("./opt/kiln/big.bin", big)
    builder.add_file("usr/local/bin/tool", b"#!/bin/sh\n", mode=0o755)
    builder.add_whiteout(f"{SITE}/vllm/__pycache__/envs.cpython-312.pyc")


def test_layer_is_reproducible_across_processes(tmp_path):
    script = (
        "import sys; from pathlib import Path; sys.path.insert(0, sys.argv[2]);"
        "from tests.image.test_layers import _sample; from kiln.oci.layer import LayerBuilder;"
        "b = LayerBuilder(); _sample(b, Path(sys.argv[1])); l = b.write(Path(sys.argv[1]) / 'out');"
        "print(l.digest, l.diff_id, l.size)"
    )
    root = Path(__file__).resolve().parents[2]
    outputs = []
    for run in ("a", "b"):
        work = tmp_path / run
        work.mkdir()
        result = subprocess.run([sys.executable, "-c", script, str(work), str(root)], capture_output=True,
                                text=True, check=True)
        outputs.append(result.stdout.split())
    assert outputs[0] == outputs[1]
    builder = LayerBuilder()
    _sample(builder, tmp_path)
    layer = builder.write(tmp_path / "here")
    assert [layer.digest, layer.diff_id, str(layer.size)] == outputs[0]


def test_layer_digests_and_entries(tmp_path):
    builder = LayerBuilder()
    _sample(builder, tmp_path)
    layer = builder.write(tmp_path / "out")
    data = layer.path.read_bytes()
    assert layer.digest == "sha256:" + hashlib.sha256(data).hexdigest()
    assert layer.size == len(data)
    assert layer.path.name == layer.digest.split(":")[1] + ".tar.gz"
    raw = gzip.decompress(data)
    # diff_id is the sha256 of the uncompressed tar: podman does not check it, so kiln must.
    assert layer.diff_id == "sha256:" + hashlib.sha256(raw).hexdigest() == diff_id_of(layer.path)
    assert layer.uncompressed_size == len(raw)
    # gzip header: no file name, mtime 0
    assert data[3] & 0x08 == 0 and data[4:8] == b"\0\0\0\0"
    members = _members(layer.path)
    names = [m.name for m in members]
    assert names == sorted(names)
    for member in members:  # every parent directory present, before its children
        parent = member.name.rsplit("/", 1)[0] if "/" in member.name else None
        if parent:
            assert parent in names[: names.index(member.name)]
        assert (member.uid, member.gid, member.uname, member.gname) == (0, 0, "", "")
        assert member.mtime == LAYER_MTIME and isinstance(member.mtime, int)
        assert member.mode == (0o755 if member.isdir() or member.name.endswith("/tool") else 0o644)
        assert not member.pax_headers.get("mtime")
    assert f"{SITE}/vllm/__pycache__/.wh.envs.cpython-312.pyc" in names
    # GNU tar reads it (PAX long names included) and sees the same bytes
    listing = subprocess.run(["tar", "-tzf", str(layer.path)], capture_output=True, text=True, check=True).stdout
    assert any(line.endswith("very_long_module_name_.py") for line in listing.splitlines())
    with tarfile.open(layer.path, "r:gz") as tar:
        assert tar.extractfile(f"{SITE}/vllm/envs.py").read() == "# ünïcode\n".encode()
        assert tar.extractfile("opt/kiln/big.bin").read() == bytes(range(256)) * 4096


def test_layer_ignores_source_file_metadata(tmp_path):
    """A copied file's own mtime/mode/owner never leak in (the stale-.pyc trap)."""
    digests = []
    for mtime in (1_700_000_000, 1_000_000_001):
        src = tmp_path / f"m{mtime}.py"
        src.write_bytes(b"A = 1\n")
        src.chmod(0o600)
        import os

        os.utime(src, (mtime, mtime))
        builder = LayerBuilder()
        builder.add_file("app/m.py", src)
        digests.append(builder.write(tmp_path / str(mtime)).diff_id)
    assert digests[0] == digests[1]
    assert GZIP_LEVEL == 6


def test_layer_refuses_bad_entries():
    builder = LayerBuilder()
    builder.add_file("a/b", b"")
    with pytest.raises(KilnError, match="added twice"):
        builder.add_file("/a/b", b"")
    with pytest.raises(KilnError, match="is a file"):
        builder.add_file("a/b/c", b"")
    for bad in ("../etc/passwd", "", "/", "a/../../x"):
        with pytest.raises(KilnError, match="not a path inside"):
            builder.add_file(bad, b"")
    with pytest.raises(KilnError, match="mode"):
        builder.add_file("x", b"", mode=0o777)


def test_pyc_whiteouts_exact_and_fallback():
    base = ["v1/attn.py", "v1/__pycache__/attn.cpython-312.pyc", "v1/__pycache__/attn.cpython-312.opt-1.pyc",
            "v1/__pycache__/attn_ext.cpython-312.pyc", "__pycache__/envs.cpython-312.pyc", "envs.py"]
    assert pyc_whiteouts("v1/attn.py", SITE, base) == [
        f"{SITE}/vllm/v1/__pycache__/attn.cpython-312.opt-1.pyc",
        f"{SITE}/vllm/v1/__pycache__/attn.cpython-312.pyc",
    ]
    assert pyc_whiteouts("envs.py", SITE, base) == [f"{SITE}/vllm/__pycache__/envs.cpython-312.pyc"]
    # no .pyc known: CPython's names for the site dir's Python version
    assert pyc_whiteouts("v1/attn.py", "usr/lib/python3.11/site-packages", ["v1/attn.py"]) == [
        f"usr/lib/python3.11/site-packages/vllm/v1/__pycache__/attn.cpython-311{s}.pyc"
        for s in ("", ".opt-1", ".opt-2")
    ]
    assert pyc_whiteouts("data.json", SITE, base) == []


def test_bake_layer_contents(tmp_path):
    changed = {"envs.py": "PATCHED = True\n", "v1/new_module.py": "NEW = 1\n"}
    base_files = ["envs.py", "__pycache__/envs.cpython-312.pyc"]
    audit = {"pin": {"name": "v0.20.1"}, "files": {}}
    layer = write_layer(patched_contents(changed, SITE, base_files, audit), tmp_path)
    with tarfile.open(layer.path, "r:gz") as tar:
        files = {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}
    assert files == {
        f"{SITE}/vllm/envs.py": b"PATCHED = True\n",
        f"{SITE}/vllm/v1/new_module.py": b"NEW = 1\n",
        f"{SITE}/vllm/__pycache__/.wh.envs.cpython-312.pyc": b"",  # only the changed module's bytecode
        AUDIT_PATH: files[AUDIT_PATH],
    }
    assert json.loads(files[AUDIT_PATH]) == audit
    again = write_layer(patched_contents(changed, SITE, base_files, audit), tmp_path / "again")
    assert (again.digest, again.diff_id) == (layer.digest, layer.diff_id)


# -- image model ----------------------------------------------------------------------------


def _base(media_type: str = OCI_MANIFEST) -> tuple[Manifest, bytes]:
    layer_type = OCI_LAYER_GZIP if media_type == OCI_MANIFEST else DOCKER_LAYER_GZIP
    config = {"architecture": "amd64", "os": "linux", "created": "2024-01-01T00:00:00Z",
              "config": {"Env": ["PATH=/bin", "A=1"], "Labels": {"keep": "me"}},
              "rootfs": {"type": "layers", "diff_ids": ["sha256:" + "1" * 64, "sha256:" + "2" * 64]},
              "history": [{"created_by": "one"}, {"created_by": "env", "empty_layer": True}, {"created_by": "two"}]}
    config_bytes = json.dumps(config, indent=3).encode()
    manifest = {"schemaVersion": 2, "mediaType": media_type,
                "config": {"mediaType": "x", "digest": "sha256:" + hashlib.sha256(config_bytes).hexdigest(), "size": len(config_bytes)},
                "layers": [{"mediaType": layer_type, "digest": "sha256:" + c * 64, "size": 10} for c in "ab"]}
    data = json.dumps(manifest).encode()
    return Manifest(data, media_type, "sha256:" + hashlib.sha256(data).hexdigest()), config_bytes


def test_mutate_steps_are_pure_and_canonical():
    manifest, config_bytes = _base()
    base = ImageModel.from_base(manifest, config_bytes)
    snapshot = canonical_json(base.config)
    new = append_layer(base, "sha256:" + "c" * 64, "sha256:" + "3" * 64, 42, created_by="kiln bake", comment="kiln 0.1")
    new = with_labels(new, {"io.kiln.pin": "v0.20.1"})
    new = with_annotations(new, {"io.kiln.pin": "v0.20.1"})
    new = with_env(new, {"A": "2", "TRITON_CACHE_DIR": "/cache"})
    assert canonical_json(base.config) == snapshot and len(base.layers) == 2  # inputs untouched
    config = json.loads(new.config_bytes())
    assert config["rootfs"]["diff_ids"][-1] == "sha256:" + "3" * 64
    assert config["history"][-1] == {"created_by": "kiln bake", "comment": "kiln 0.1", "created": "2024-01-01T00:00:00Z"}
    assert sum(1 for h in config["history"] if not h.get("empty_layer")) == len(config["rootfs"]["diff_ids"])
    assert config["config"]["Env"] == ["PATH=/bin", "A=2", "TRITON_CACHE_DIR=/cache"]
    assert config["config"]["Labels"] == {"keep": "me", "io.kiln.pin": "v0.20.1"}
    out = new.manifest()
    body = json.loads(out.data)
    assert out.digest == "sha256:" + hashlib.sha256(out.data).hexdigest()
    assert body["config"]["digest"] == new.config_descriptor().digest
    assert body["config"]["mediaType"] == "application/vnd.oci.image.config.v1+json"
    assert body["layers"][-1] == {"mediaType": OCI_LAYER_GZIP, "digest": "sha256:" + "c" * 64, "size": 42}
    assert body["annotations"] == {"io.kiln.pin": "v0.20.1"}
    assert out.data == canonical_json(body)  # sorted keys, no whitespace
    # same steps on the same base -> byte-identical manifest
    again = with_env(with_annotations(with_labels(append_layer(
        ImageModel.from_base(manifest, config_bytes), "sha256:" + "c" * 64, "sha256:" + "3" * 64, 42,
        created_by="kiln bake", comment="kiln 0.1"), {"io.kiln.pin": "v0.20.1"}), {"io.kiln.pin": "v0.20.1"}),
        {"A": "2", "TRITON_CACHE_DIR": "/cache"})
    assert again.manifest().data == out.data


def test_docker_v2_base_keeps_its_flavour():
    manifest, config_bytes = _base(DOCKER_MANIFEST)
    new = with_annotations(append_layer(ImageModel.from_base(manifest, config_bytes), "sha256:" + "c" * 64,
                                        "sha256:" + "3" * 64, 1, created_by="k"), {"a": "b"})
    body = json.loads(new.manifest().data)
    assert body["mediaType"] == DOCKER_MANIFEST
    assert body["config"]["mediaType"] == "application/vnd.docker.container.image.v1+json"
    assert body["layers"][-1]["mediaType"] == DOCKER_LAYER_GZIP
    assert "annotations" not in body  # Docker v2 has no annotations field


def test_to_oci_maps_media_types_only():
    manifest, config_bytes = _base(DOCKER_MANIFEST)
    docker = ImageModel.from_base(manifest, config_bytes)
    oci = to_oci(docker)
    assert oci.media_type == OCI_MANIFEST and oci.config_bytes() == docker.config_bytes()
    assert [layer.media_type for layer in oci.layers] == [OCI_LAYER_GZIP, OCI_LAYER_GZIP]
    assert [layer.digest for layer in oci.layers] == [layer.digest for layer in docker.layers]
    assert to_oci(oci) is oci


def test_short_history_is_padded():
    manifest, config_bytes = _base()
    config = json.loads(config_bytes)
    del config["history"]
    new = append_layer(ImageModel.from_base(manifest, json.dumps(config).encode()), "sha256:" + "c" * 64,
                       "sha256:" + "3" * 64, 1, created_by="k")
    history = json.loads(new.config_bytes())["history"]
    assert len(history) == 3 and history[-1]["created_by"] == "k"


def test_base_with_inconsistent_diff_ids_is_refused():
    manifest, config_bytes = _base()
    config = json.loads(config_bytes)
    config["rootfs"]["diff_ids"].pop()
    with pytest.raises(KilnError, match="rootfs.diff_ids lists 1 digests for 2 layers"):
        ImageModel.from_base(manifest, json.dumps(config).encode())
