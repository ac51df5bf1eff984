"""PN346 on real 0.20.1 source: under MTP a hybrid's prefix-cache hit never exceeds its attention blocks.

What runs: from the (pristine or patched) 0.20.1 tree,
``HybridKVCacheCoordinator.verify_and_split_kv_cache_groups`` and ``find_longest_cache_hit``
(``v1/core/kv_cache_coordinator.py``), ``FullAttentionManager.find_longest_cache_hit`` and
``MambaManager.find_longest_cache_hit`` (``v1/core/single_type_kv_cache_manager.py``),
``BlockHashListWithBlockSize`` (``v1/core/kv_cache_utils.py``) and the real
``FullAttentionSpec``/``MambaSpec`` (``tests/patchsets/support/kvspecs.py``), executed on CPU.
The block pool is a stand-in with ``BlockPool.get_cached_block``'s contract (a block per group
id, or None if any group misses). The coordinator's eagle groups follow
``KVCacheCoordinator.__init__``: none is flagged for Qwen3.5/3.6, so under EAGLE/MTP all are.
"""

from __future__ import annotations

import itertools
import types
from typing import overload

import pytest
from packaging.version import Version

from kiln.patch.engine import Session, isolated_run
from kiln.patch.model import BuildTarget, Verdict
from kiln.source.wheel import WheelSource
from tests.patchsets.support import kvspecs
from tests.patchsets.support.patchlib import extract

# releases' wheels from PyPI on a machine whose kiln cache lacks them (tests/conftest.py keeps this true)
pytestmark = pytest.mark.network

COORDINATOR = "v1/core/kv_cache_coordinator.py"
MANAGERS = "v1/core/single_type_kv_cache_manager.py"
UTILS = "v1/core/kv_cache_utils.py"


class Block:
    def __init__(self, name: str, is_null: bool = False):
        self.name, self.is_null = name, is_null

    def __repr__(self) -> str:
        return self.name


class BlockPool:
    """``get_cached_block(hash, group_ids)``: a block per group id, or None if any misses."""

    def __init__(self):
        self.cached: dict[tuple[bytes, int], Block] = {}
        self.null_block = Block("null", is_null=True)

    def get_cached_block(self, block_hash, kv_cache_group_ids):
        blocks = [self.cached.get((bytes(block_hash), gid)) for gid in kv_cache_group_ids]
        return None if any(b is None for b in blocks) else blocks


def _hashes(num: int) -> list[bytes]:
    return [f"h{i:03d}".encode() for i in range(num)]


def _coordinator_class(tree_files: dict[str, str], specs):
    """The coordinator's lookup methods and the two managers' finders, executed together."""
    namespace = {
        "itertools": itertools,
        "overload": overload,
        "Iterator": object,
        "BlockHash": bytes,
        "BlockHashList": object,
        "KVCacheBlock": Block,
        "KVCacheSpec": specs.KVCacheSpec,
        "FullAttentionSpec": specs.FullAttentionSpec,
        "MambaSpec": specs.MambaSpec,
        "ChunkedLocalAttentionSpec": type("ChunkedLocalAttentionSpec", (), {}),
        "SingleTypeKVCacheManager": object,
        "BlockPool": BlockPool,
        "lcm": __import__("math").lcm,
    }
    source = "from __future__ import annotations\n\n" + extract(tree_files[UTILS], "BlockHashListWithBlockSize")
    exec(compile(source, UTILS, "exec"), namespace)
    for manager in ("FullAttentionManager", "MambaManager"):
        body = extract(tree_files[MANAGERS], f"{manager}.find_longest_cache_hit")
        source = f"from __future__ import annotations\n\nclass {manager}:\n{_indent(body)}"
        exec(compile(source, MANAGERS, "exec"), namespace)
    methods = "\n".join(
        _indent(extract(tree_files[COORDINATOR], f"HybridKVCacheCoordinator.{name}"))
        for name in ("verify_and_split_kv_cache_groups", "find_longest_cache_hit")
    )
    source = f"from __future__ import annotations\n\nclass HybridKVCacheCoordinator:\n{methods}"
    exec(compile(source, COORDINATOR, "exec"), namespace)
    return namespace


def _indent(text: str) -> str:
    return "".join("    " + line if line.strip() else line for line in text.splitlines(True))


def _run(tree_files, *, attn_block: int, mamba_block: int, prompt: int, cached_attention: int, mamba_states, use_eagle=True):
    """(hit length, attention blocks, mamba blocks) for a prompt of ``prompt`` tokens."""
    specs = kvspecs.spec_classes(_Tree(tree_files))
    namespace = _coordinator_class(tree_files, specs)
    attn = specs.FullAttentionSpec(block_size=attn_block, num_kv_heads=2, head_size=16, dtype=kvspecs.TORCH.bfloat16)
    mamba = specs.MambaSpec(block_size=mamba_block, shapes=((4, 8),), dtypes=(kvspecs.TORCH.bfloat16,))
    groups = [types.SimpleNamespace(kv_cache_spec=attn, is_eagle_group=False),
              types.SimpleNamespace(kv_cache_spec=mamba, is_eagle_group=False)]
    coordinator = namespace["HybridKVCacheCoordinator"].__new__(namespace["HybridKVCacheCoordinator"])
    coordinator.kv_cache_config = types.SimpleNamespace(kv_cache_groups=groups)
    coordinator.single_type_managers = (namespace["FullAttentionManager"](), namespace["MambaManager"]())
    coordinator.hash_block_size = mamba_block if attn_block % mamba_block == 0 else attn_block
    # KVCacheCoordinator.__init__: no group flagged -> under eagle, every group is an eagle group
    flagged = {i for i, g in enumerate(groups) if g.is_eagle_group}
    coordinator.eagle_group_ids = flagged or (set(range(len(groups))) if use_eagle else set())
    coordinator.block_pool = pool = BlockPool()
    coordinator.verify_and_split_kv_cache_groups()

    hashes = _hashes(prompt // coordinator.hash_block_size)
    per_attn = attn_block // coordinator.hash_block_size
    for i in range(cached_attention // attn_block):  # attention KV of the shared prefix
        key = b"".join(hashes[i * per_attn : (i + 1) * per_attn])
        pool.cached[(key, 0)] = Block(f"attn{i}")
    per_mamba = mamba_block // coordinator.hash_block_size
    for end in mamba_states:  # Mamba states cached at these token boundaries
        i = end // mamba_block - 1
        key = b"".join(hashes[i * per_mamba : (i + 1) * per_mamba])
        pool.cached[(key, 1)] = Block(f"state@{end}")
    (attn_blocks, mamba_blocks), hit = coordinator.find_longest_cache_hit(hashes, prompt - 1)
    return hit, attn_blocks, mamba_blocks


class _Tree:
    def __init__(self, files):
        self.files = files

    def read(self, rel):
        return self.files[rel]


@pytest.fixture(scope="module")
def files(catalogue, sessions):
    """'pristine'/'patched' -> {rel: text} of the 0.20.1 files the lookup uses."""
    session = sessions("v0.20.1")
    tree = session.tree
    pristine = {rel: tree.read(rel) for rel in (COORDINATOR, MANAGERS, UTILS, "v1/kv_cache_interface.py")}
    result = isolated_run(catalogue, session, BuildTarget(tree.vllm_version), "PN346")
    assert result.outcomes["PN346"].verdict is Verdict.APPLIES
    return {"pristine": pristine, "patched": {**pristine, **result.changed_text()}}


def _consistent(hit, attn_blocks, mamba_blocks, attn_block, mamba_block):
    return len(attn_blocks) * attn_block == hit and len(mamba_blocks) * mamba_block == hit


def test_mamba_state_past_the_eagle_drop_is_not_taken(files):
    """One block size for both groups (the usual hybrid layout)."""
    case = dict(attn_block=16, mamba_block=16, prompt=100, cached_attention=96, mamba_states=[32, 64, 96])
    hit, attn, mamba = _run(files["pristine"], **case)
    assert hit == 96 and len(attn) == 5  # the failure: hit says 6 blocks, attention holds 5
    assert not _consistent(hit, attn, mamba, 16, 16)
    hit, attn, mamba = _run(files["patched"], **case)
    assert hit == 64 and _consistent(hit, attn, mamba, 16, 16)
    assert mamba[-1].name == "state@64" and [b.name for b in attn] == ["attn0", "attn1", "attn2", "attn3"]


def test_state_at_the_attention_hit_is_kept(files):
    case = dict(attn_block=16, mamba_block=16, prompt=100, cached_attention=96, mamba_states=[32, 80, 96])
    hit, attn, mamba = _run(files["patched"], **case)
    assert hit == 80 and _consistent(hit, attn, mamba, 16, 16) and mamba[-1].name == "state@80"


def test_kiln_preset_layout_was_masked_and_stays_the_same(files):
    """TurboQuant + P5: attention blocks twice the Mamba block, so the alignment hides it."""
    case = dict(attn_block=32, mamba_block=16, prompt=200, cached_attention=192, mamba_states=[64, 128, 160, 192])
    before = _run(files["pristine"], **case)
    after = _run(files["patched"], **case)
    assert before[0] == after[0] == 160
    assert _consistent(*after, 32, 16)


def test_without_spec_decode_nothing_changes(files):
    case = dict(attn_block=16, mamba_block=16, prompt=100, cached_attention=96, mamba_states=[32, 64, 96], use_eagle=False)
    before, after = _run(files["pristine"], **case), _run(files["patched"], **case)
    assert before[0] == after[0] == 96 and _consistent(*after, 16, 16)


@pytest.mark.parametrize(("version", "verdict"), [("0.21.0", Verdict.APPLIES), ("0.25.1", Verdict.APPLIES),
                                                   ("0.26.0", Verdict.UPSTREAM)])
def test_verdicts_across_releases(catalogue, version, verdict):
    session = Session(WheelSource(Version(version)).fetch())
    outcome = isolated_run(catalogue, session, BuildTarget(Version(version)), "PN346").outcomes["PN346"]
    assert outcome.verdict is verdict, outcome.detail


def test_upstream_on_0330_names_the_line(catalogue, sessions):
    session = sessions("v0.33.0")
    outcome = isolated_run(catalogue, session, BuildTarget(session.tree.vllm_version), "PN346").outcomes["PN346"]
    assert outcome.verdict is Verdict.UPSTREAM
    assert outcome.detail.startswith(f"{COORDINATOR}:875:")
    line = session.tree.read(COORDINATOR).splitlines()[874]
    assert "not isinstance(spec, MambaSpec)" in line


def test_vllm43650_shape_also_reads_upstream(catalogue, sessions):
    import libcst as cst

    session = sessions("v0.20.1")
    text = session.tree.read(MANAGERS)
    anchor = "        max_num_blocks = max_length // block_size\n        # Search from right to left"
    assert text.count(anchor) == 1
    fixed = text.replace(anchor, anchor.replace("\n        # Search", "\n        if use_eagle and max_num_blocks > 0:\n"
                                                "            max_num_blocks -= 1\n        # Search"))
    overlay = session.overlay({MANAGERS: cst.parse_module(fixed)})
    outcome = isolated_run(catalogue, overlay, BuildTarget(session.tree.vllm_version), "PN346").outcomes["PN346"]
    assert outcome.verdict is Verdict.UPSTREAM and MANAGERS in outcome.detail
