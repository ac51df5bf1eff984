"""Pristine vLLM source out of a real registry image: only the needed layers, verified."""

import pytest

from kiln.cache import cache_root
from kiln.errors import KilnError
from kiln.oci.endpoints import RegistryConfig
from kiln.oci.image import OciLayoutImage
from kiln.oci.registry import TransferStats
from kiln.source.image import ImageSource, read_vllm
from tests.support.registry import REPO, SITE, VLLM_VERSION

pytestmark = pytest.mark.registry
HUB_REF = f"docker.io/{REPO}:v{VLLM_VERSION}"


def source(server, ref=HUB_REF, **kw) -> ImageSource:
    return ImageSource(ref, registry_config=RegistryConfig.load([server.mirror]), stats=TransferStats(), **kw)


def wheel_tree(layout) -> dict[str, bytes]:
    return {name.removeprefix("vllm/"): data for name, data in layout.wheel_files.items()}


def test_pull_reads_only_the_layers_holding_vllm(registry_plain, base_layout):
    src = source(registry_plain, expected_version=VLLM_VERSION)
    found = src.pull()
    layers = base_layout.layers
    assert found.layers_read == (layers["app"], layers["vllm"])
    fetched = set(src.stats.blobs_fetched)
    assert {layers["app"], layers["vllm"]} <= fetched
    assert not fetched & {layers["rootfs"], layers["filler-cuda"], layers["filler-torch"]}
    needed = base_layout.layer_sizes["app"] + base_layout.layer_sizes["vllm"]
    assert needed <= src.stats.bytes_down <= 1.05 * needed + 16_384  # + manifest and config
    blobs = cache_root() / "blobs/sha256"
    assert (blobs / layers["vllm"].split(":")[1]).is_file()
    assert not (blobs / layers["filler-cuda"].split(":")[1]).exists()


def test_pristine_source_equals_the_wheel(registry_plain, base_layout):
    found = source(registry_plain).pull()
    tree = found.tree
    expected = wheel_tree(base_layout)
    assert tree.python_files() == sorted(expected)
    for rel, data in expected.items():
        assert tree.file(rel).read_bytes() == data, rel
    assert str(tree.vllm_version) == VLLM_VERSION
    assert found.triton_version == "3.5.0"
    assert found.site_dir == SITE
    assert found.digest == registry_plain.digest_of(f"{REPO}:v{VLLM_VERSION}")
    assert tree.identity.startswith("sha256:")


def test_whiteouts_and_opaque_dirs_are_honoured(registry_plain, base_layout):
    found = source(registry_plain, f"{HUB_REF}-overlay").pull()
    tree, layers = found.tree, base_layout.layers
    assert found.layers_read == (layers["overlay"], layers["vllm"])
    assert tree.file(base_layout.overridden).read_bytes() == base_layout.override_bytes
    assert not tree.exists(base_layout.whited_out)
    opaque = sorted(p for p in tree.python_files() if p.startswith(base_layout.opaque_dir + "/"))
    assert opaque == sorted(f"{base_layout.opaque_dir}/{n}" for n in base_layout.opaque_files)
    untouched = {rel: data for rel, data in wheel_tree(base_layout).items()
                 if rel not in (base_layout.overridden, base_layout.whited_out)
                 and not rel.startswith(base_layout.opaque_dir + "/")}
    for rel, data in untouched.items():
        assert tree.file(rel).read_bytes() == data, rel


@pytest.mark.parametrize("tag_suffix", ["-index", "-docker"])
def test_index_and_docker_formats_give_the_same_tree(registry_plain, tag_suffix):
    plain = source(registry_plain).pull()
    other = source(registry_plain, HUB_REF + tag_suffix).pull()
    assert other.tree.identity == plain.tree.identity


def test_warm_cache_needs_one_head_for_a_tag_and_nothing_for_a_digest(registry_plain):
    first = source(registry_plain).pull()
    again = source(registry_plain)
    assert again.pull().tree == first.tree
    assert again.stats.requests == 1 and again.stats.bytes_down == 0
    pinned = source(registry_plain, f"{HUB_REF}@{first.digest}")
    assert pinned.fetch() == first.tree
    assert pinned.stats.requests == 0


def test_version_mismatch_is_refused(registry_plain):
    with pytest.raises(KilnError, match="carries vLLM 0.20.1, the pin expects 0.19.0"):
        source(registry_plain, expected_version="0.19.0").fetch()


def test_image_without_vllm_is_a_clear_error(registry_plain):
    with pytest.raises(KilnError, match="no vLLM in the image"):
        source(registry_plain, "docker.io/test/no-vllm:1").fetch()
    assert not list((cache_root() / "sources").glob("image-*"))  # no partial output


def test_corrupted_blob_is_detected_and_never_cached(start_registry, registry_plain, base_layout):
    broken = start_registry("plain", copy_from=registry_plain)
    vllm_layer = base_layout.layers["vllm"]
    blob = broken.blob_file(vllm_layer)
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    blob.write_bytes(bytes(data))
    with pytest.raises(KilnError, match=f"{vllm_layer}: digest mismatch"):
        source(broken).fetch()
    assert not (cache_root() / "blobs/sha256" / vllm_layer.split(":")[1]).exists()
    assert not list((cache_root() / "sources").glob("image-*"))


def test_corrupted_cache_entry_is_removed(registry_plain, base_layout):
    src = source(registry_plain)
    found = src.pull()
    cached = cache_root() / "blobs/sha256" / base_layout.layers["app"].split(":")[1]
    cached.write_bytes(b"garbage")
    for record in (cache_root() / "images").iterdir():
        record.unlink()  # force the layers to be read again
    with pytest.raises(KilnError, match="cached .* corrupted"):
        source(registry_plain).pull()
    assert not cached.exists()
    assert source(registry_plain).pull().tree == found.tree  # fetched again, verified


def test_read_from_an_oci_layout(base_layout):
    found = read_vllm(OciLayoutImage(base_layout.path, "base"))
    assert found.tree.python_files() == sorted(wheel_tree(base_layout))


def test_a_build_with_kernels_reads_on_for_triton_under_its_own_record(registry_plain, base_layout):
    ref = f"{HUB_REF}-notriton"  # its top layer whites out the Triton the vLLM layer holds
    plain = source(registry_plain, ref).pull()
    needing = source(registry_plain, ref, need_triton=True).pull()
    assert plain.triton_version is None and needing.triton_version is None
    assert set(base_layout.layers.values()) - set(plain.layers_read)  # vLLM settled it early
    assert len(needing.layers_read) > len(plain.layers_read)  # looked for Triton in every layer
    records = {p.name for p in (cache_root() / "images").glob(f"{plain.digest.replace(':', '-')}*.json")}
    assert len(records) == 2 and any(name.endswith("+triton.json") for name in records)
    found = source(registry_plain, f"{HUB_REF}-triton36", need_triton=True).pull()
    assert found.triton_version == "3.6.0" and "triton/_C/libtriton.so,sha256=" in found.triton_record


def test_a_record_from_another_kiln_version_is_read_again(registry_plain):
    import json

    first = source(registry_plain).pull()
    record = cache_root() / "images" / f"{first.digest.replace(':', '-')}.json"
    data = json.loads(record.read_text())
    del data["triton_record"]  # as the kiln before Triton's RECORD was read wrote it
    record.write_text(json.dumps(data))
    pinned = source(registry_plain, f"{HUB_REF}@{first.digest}")
    assert pinned.pull().triton_record is None  # (the plain base's Triton has only METADATA)
    # the layers were walked again (from the blob cache) and the record written anew
    assert "triton_record" in json.loads(record.read_text())
