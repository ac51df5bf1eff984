"""The warm layer's parts without a server: the key and its one-line refusal, the captured caches
(vllm#52154's path trap refused), the bundle checked file by file, the layer deterministic, and a
build's ``with_warm`` refusing a bundle made for other inputs before it bakes anything."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest

from kiln.errors import KilnError
from kiln.image.layers import AUDIT_PATH
from kiln.image.prepare import PreparedBuild
from kiln.image.warmlayer import (
    WARM_ROOT,
    check_bundle,
    key_factors,
    warm_contents,
    warm_env,
    warm_key,
)
from kiln.oci.layer import LayerContents, write_layer
from kiln.warm.bake import with_warm
from kiln.warm.capture import capture, read_bundle, write_bundle

AUDIT = {"image": "qwen3.6-tiny-cpu", "base": {"digest": "sha256:" + "b" * 64},
         "pin": {"name": "cpu-v0.32.0", "vllm": "0.32.0", "cuda": "cpu"}, "sm": 90,
         "patches": [{"patch": "K1", "verdict": "APPLIES"}, {"patch": "P58", "verdict": "APPLIES"}],
         "files": {"/opt/venv/lib/python3.11/site-packages/vllm/parser/qwen3.py": {"before": "0" * 64, "after": "1" * 64}},
         "kiln": {"version": "0.1", "commit": "abc", "dirty": False}}


@dataclass(frozen=True)
class Model:
    id: str = "kiln-local/qwen3.6-tiny"


@dataclass(frozen=True)
class Definition:
    model: Model = Model()
    serve_args: tuple = ("--dtype", "bfloat16", "--max-num-seqs", "4")
    serve_env: dict = field(default_factory=lambda: {"VLLM_TARGET_DEVICE": "cpu"})


def record_for(audit=AUDIT, definition=Definition()) -> dict:
    factors = key_factors(audit, definition, "linux/amd64")
    return {"key": warm_key(factors), "factors": factors, "booted": {"serve": ["vllm", "serve"]},
            "hardware": {"machine": "x86_64"}, "versions": {"torch": "2.13.0+cpu"}, "vllm_cache_dirs": []}


def rootfs_with_cache(tmp_path: Path, text: bytes = b"compiled for /opt/kiln/warm/inductor") -> Path:
    rootfs = tmp_path / "rootfs"
    entry = rootfs / WARM_ROOT / "vllm" / "torch_compile_cache" / "torch_aot_compile" / "abc" / "rank_0_0"
    entry.mkdir(parents=True)
    (entry / "model").write_bytes(text)
    (rootfs / WARM_ROOT / "inductor").mkdir()
    (rootfs / WARM_ROOT / "inductor" / "kernel.so").write_bytes(b"\x7fELF..")
    (rootfs / WARM_ROOT / "inductor" / "kernel.so.lock").write_bytes(b"")
    return rootfs


def test_the_key_moves_with_every_factor_and_not_with_kiln_s_commit():
    base = warm_key(key_factors(AUDIT, Definition(), "linux/amd64"))
    assert warm_key(key_factors({**AUDIT, "kiln": {"commit": "other"}}, Definition(), "linux/amd64")) == base
    changed = [
        {**AUDIT, "base": {"digest": "sha256:" + "c" * 64}},
        {**AUDIT, "pin": {**AUDIT["pin"], "vllm": "0.33.0"}},
        {**AUDIT, "sm": 120},
        {**AUDIT, "patches": AUDIT["patches"][:1]},
        {**AUDIT, "files": {k: {"after": "2" * 64} for k in AUDIT["files"]}},
    ]
    keys = {warm_key(key_factors(audit, Definition(), "linux/amd64")) for audit in changed}
    keys |= {warm_key(key_factors(AUDIT, Definition(serve_args=("--max-num-seqs", "8")), "linux/amd64")),
             warm_key(key_factors(AUDIT, Definition(model=Model("other/model")), "linux/amd64")),
             warm_key(key_factors(AUDIT, Definition(serve_env={"OMP_NUM_THREADS": "4"}), "linux/amd64")),
             warm_key(key_factors(AUDIT, Definition(), "linux/arm64"))}
    assert base not in keys and len(keys) == 9


def test_a_bundle_made_for_other_serve_args_is_refused_in_one_line_naming_the_factor():
    record = record_for(definition=Definition(serve_args=("--max-num-seqs", "8")))
    check_bundle(record_for(), AUDIT, Definition(), "linux/amd64", "--warm x")  # its own inputs: accepted
    with pytest.raises(KilnError) as refused:
        check_bundle(record, AUDIT, Definition(), "linux/amd64", "--warm x")
    line = str(refused.value)
    assert "\n" not in line and line.startswith("--warm x: a warm cache made for other inputs (1 differ; serve_args:")
    assert "build.py warm" in line
    tampered = dict(record_for(), key="sha256:" + "0" * 64)  # the factors agree, the key does not
    with pytest.raises(KilnError, match="other inputs"):
        check_bundle(tampered, AUDIT, Definition(), "linux/amd64", "--warm x")
    with pytest.raises(KilnError, match="os_arch"):  # made on another machine's platform
        check_bundle(record_for(), AUDIT, Definition(), "linux/arm64", "--warm x")


def test_capture_takes_the_warm_root_and_leaves_out_locks(tmp_path):
    files = capture(rootfs_with_cache(tmp_path), [str(tmp_path / "rootfs")])
    assert sorted(files) == [f"{WARM_ROOT}/inductor/kernel.so",
                             f"{WARM_ROOT}/vllm/torch_compile_cache/torch_aot_compile/abc/rank_0_0/model"]


def test_a_cache_that_names_the_warm_host_s_path_is_refused(tmp_path):
    """vllm#52154: a cache entry recording where it was made (here the rootfs as the host sees it)."""
    host = str(tmp_path / "rootfs")
    rootfs = rootfs_with_cache(tmp_path, text=f"graph compiled in {host}/opt/kiln/warm/vllm".encode())
    with pytest.raises(KilnError) as refused:
        capture(rootfs, [host])
    assert "\n" not in str(refused.value) and "vllm#52154" in str(refused.value) and host in str(refused.value)
    # the host's name, when long enough to search for
    named = rootfs_with_cache(tmp_path / "b", text=b"built on warm-host-0042")
    with pytest.raises(KilnError, match="warm-host-0042"):
        capture(named, [], hostname="warm-host-0042")
    assert capture(named, [], hostname="vm")  # two letters occur in any binary: not searched for


def test_a_symlink_in_the_cache_is_refused(tmp_path):
    rootfs = rootfs_with_cache(tmp_path)
    os.symlink("/etc/passwd", rootfs / WARM_ROOT / "inductor" / "link")
    with pytest.raises(KilnError, match="symbolic link"):
        capture(rootfs, [])


def test_the_bundle_is_checked_file_by_file(tmp_path):
    files = capture(rootfs_with_cache(tmp_path), [])
    record = write_bundle(tmp_path / "bundle", files, record_for())
    assert read_bundle(tmp_path / "bundle") == (json.loads((tmp_path / "bundle/warm.json").read_text()), files)
    assert record["bytes"] == sum(map(len, files.values()))
    (tmp_path / "bundle/files" / WARM_ROOT / "inductor/kernel.so").write_bytes(b"other")
    with pytest.raises(KilnError, match="does not match its sha256"):
        read_bundle(tmp_path / "bundle")
    (tmp_path / "bundle/files" / WARM_ROOT / "inductor/extra").write_bytes(b"")
    with pytest.raises(KilnError, match="not as warm.json lists"):
        read_bundle(tmp_path / "bundle")
    with pytest.raises(KilnError, match="not a new or empty folder"):
        write_bundle(tmp_path / "bundle", files, record_for())


def test_the_warm_layer_is_the_same_from_caches_written_at_other_times(tmp_path):
    one = capture(rootfs_with_cache(tmp_path / "one"), [])
    rootfs = rootfs_with_cache(tmp_path / "two")
    for path in (rootfs / WARM_ROOT).rglob("*"):
        os.utime(path, (12345, 12345))
    two = capture(rootfs, [])
    key = record_for()["key"]
    first, second = write_layer(warm_contents(one, key), tmp_path / "l1"), write_layer(warm_contents(two, key), tmp_path / "l2")
    assert first.digest == second.digest and first.diff_id == second.diff_id


def prepared_with(audit: dict, env: dict | None = None) -> PreparedBuild:
    audit_bytes = json.dumps(audit).encode()
    fields = {name: None for name in PreparedBuild.__dataclass_fields__}
    fields.update(inputs=SimpleNamespace(definition=Definition(), platform="linux/amd64"), layers=[LayerContents({AUDIT_PATH: audit_bytes})],
                  base_model=SimpleNamespace(config={"config": {"Env": [f"{k}={v}" for k, v in (env or {}).items()]}}),
                  env={}, warm={}, cache=[])
    return PreparedBuild(**fields)


def test_with_warm_bakes_the_layer_sets_the_env_and_records_it_in_the_audit(tmp_path):
    write_bundle(tmp_path / "bundle", capture(rootfs_with_cache(tmp_path), []), record_for())
    warmed = with_warm(prepared_with(AUDIT), tmp_path / "bundle")
    assert [sorted(layer.files) for layer in warmed.layers[1:]] == [sorted(read_bundle(tmp_path / "bundle")[1])]
    assert warmed.env == warm_env({}) == {"VLLM_CACHE_ROOT": "/opt/kiln/warm/vllm",
                                          "TORCHINDUCTOR_CACHE_DIR": "/opt/kiln/warm/inductor",
                                          "TRITON_CACHE_DIR": "/opt/kiln/warm/triton",
                                          "TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS": "0"}
    audit = json.loads(warmed.layers[0].files[AUDIT_PATH])
    assert audit["warm"]["key"] == record_for()["key"] and audit["warm"]["files"] == read_bundle(tmp_path / "bundle")[0]["files"]
    assert warmed.warm["record_sha256"] and warmed.warm["files"] == 2
    # the registry build cache's warm entry, for --cache-to: the layer baked, the record the bundle's bytes
    [use] = warmed.cache
    assert (use.kind, use.key) == ("warm", record_for()["key"].removeprefix("sha256:"))
    assert use.fields == {"bundle": (tmp_path / "bundle" / "warm.json").read_text()} and use.contents == [warmed.layers[-1]]
    # an image whose kernel layer set TRITON_CACHE_DIR keeps it
    kept = with_warm(prepared_with(AUDIT, {"TRITON_CACHE_DIR": "/opt/kiln/triton/sm120"}), tmp_path / "bundle")
    assert "TRITON_CACHE_DIR" not in kept.env


def test_with_warm_refuses_a_bundle_planted_for_another_base(tmp_path):
    other = {**AUDIT, "base": {"digest": "sha256:" + "9" * 64}}
    write_bundle(tmp_path / "bundle", capture(rootfs_with_cache(tmp_path), []), record_for(audit=other))
    with pytest.raises(KilnError) as refused:
        with_warm(prepared_with(AUDIT), tmp_path / "bundle")
    assert "\n" not in str(refused.value) and "base_digest" in str(refused.value)


def test_warm_on_a_tag_of_several_platforms_is_refused_before_any_work(tmp_path):
    from kiln.pipeline import run_build

    with pytest.raises(KilnError) as refused:
        run_build(SimpleNamespace(platform="linux/amd64"), [], "repo", platforms=("linux/amd64", "linux/arm64"),
                  warm=tmp_path / "bundle")
    assert str(refused.value) == (f"--warm {tmp_path / 'bundle'}: a warm cache is made on one platform's hardware, "
                                  "and this tag has 2 (linux/amd64, linux/arm64): build one (--platform OS/ARCH)")
