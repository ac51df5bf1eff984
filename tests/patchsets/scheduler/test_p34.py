"""P34 on real 0.20.1 and 0.33.0 source: a prompt with two images in Mamba align mode.

Behaviour test running real vLLM code extracted from the trees (the scheduler module imports the
engine, the KV cache manager and the connectors), executed on small stand-ins:
- ``Scheduler._try_schedule_encoder_inputs``, ``_mamba_block_aligned_split`` and
  ``_free_encoder_inputs`` of each file (0.20.1 pristine, 0.20.1 patched by P34, 0.33.0 pristine;
  0.33.0's also ``_free_encoder_input``, ``_reject_on_encoder_cache_embed_mismatch``,
  ``_reserve_prefill_lookahead``, ``kv_cache_interface``'s two checkpoint helpers its split calls and
  ``multimodal/utils.py``'s ``get_mm_features_in_window``);
- the tree's own ``EncoderCacheManager`` (``v1/core/encoder_cache_manager.py``) and
  ``PlaceholderRange`` (``multimodal/inputs.py``);
- the statements of ``Scheduler.schedule`` that size a chunk, in the file's own order: the
  running loop from ``num_new_tokens = ...`` through ``if num_new_tokens == 0: ... continue``,
  and (0.20.1, a request's first chunk) the waiting loop from ``encoder_inputs_to_schedule = None``
  up to the block-aligned split.
Restated (documented where used): what the rest of a step does to this one request: the encoder
cache allocates what was scheduled, the chunk's tokens become computed, and
``update_from_output`` then calls ``_free_encoder_inputs``.

The prompt (block 16, ``--max-num-batched-tokens`` 48, so the encoder cache holds 48 embeddings
and the encoder budget is 48): text [0, 4), image A [4, 36), two text tokens, image B [40, 72),
text [72, 100). A and B (32 each) never fit the cache together.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import types
from collections import OrderedDict
from collections.abc import Mapping

import libcst as cst
import libcst.matchers as m
import pytest
import torch

from kiln.patch.anchor import resolve
from kiln.patch.shapes import cls, func
from tests.patchsets.support.patchlib import (
    assert_applies_once,
    assert_upstream,
    extract_all,
    patched_files,
)

SCHED = "v1/core/sched/scheduler.py"
ECM = "v1/core/encoder_cache_manager.py"
BLOCK = 16
BUDGET = 48
PROMPT = 100
IMAGES = ((4, 32), (40, 32))  # (offset, length)
SCHEDULE = (cls("Scheduler"), func("schedule"))
RUNNING = m.While(test=m.BooleanOperation(left=m.Comparison(left=m.Name("req_index"))))
WAITING = m.While(test=m.BooleanOperation(left=m.BooleanOperation(left=m.Attribute(attr=m.Name("waiting")))))


# -- verdicts ------------------------------------------------------------------------------------


def test_verdicts(catalogue, sessions):
    assert_applies_once(catalogue, sessions("v0.20.1"), "P34")
    detail = assert_upstream(catalogue, sessions("v0.33.0"), "P34")
    assert detail.startswith(f"{SCHED}:860: ") and "lines 860, 1350" in detail and f"{SCHED}:621" in detail


# -- the real code, put together -------------------------------------------------------------------


def _is_num_new_tokens(statement, value) -> bool:
    return m.matches(
        statement,
        m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(m.Name("num_new_tokens"))], value=value)]),
    )


ZERO_CHECK = m.If(
    test=m.Comparison(left=m.Name("num_new_tokens"), comparisons=[m.ComparisonTarget(m.Equal(), m.Integer("0"))])
)


def _first(body, matcher, start=0) -> int:
    return next(i for i in range(start, len(body)) if matcher(body[i]))


def _as_loop(module: cst.Module, statements) -> types.CodeType:
    """The statements inside a one-pass loop (their `break`/`continue` end it); `_reached` marks
    that the last one ran to its end, i.e. the request was scheduled."""
    inner = cst.IndentedBlock(body=[*statements, *cst.parse_module("_reached = True\n").body])
    loop = cst.For(target=cst.Name("_once"), iter=cst.parse_expression("(0,)"), body=inner)
    return compile(module.with_changes(body=[loop]).code, "<schedule>", "exec")


def _segments(text: str) -> dict:
    module = cst.parse_module(text)
    running = resolve(module, (*SCHEDULE, RUNNING)).unique.body.body
    start = _first(running, lambda s: _is_num_new_tokens(s, m.BinaryOperation()))
    end = _first(running, lambda s: m.matches(s, ZERO_CHECK), start)
    out = {"running": _as_loop(module, running[start : end + 1])}
    waiting = resolve(module, (*SCHEDULE, WAITING))
    if waiting.unique is not None:  # 0.20.1: from the encoder placeholders to the block-aligned split
        body = waiting.unique.body.body
        is_init = m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(m.Name("encoder_inputs_to_schedule"))])])
        is_lookahead = m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(m.Name("effective_lookahead_tokens"))])])
        first = _first(body, lambda s: m.matches(s, is_init))
        last = _first(body, lambda s: m.matches(s, is_lookahead), first)
        out["waiting"] = _as_loop(module, body[first:last])
    return out


def _run(source: str, names: list[str], namespace: dict) -> dict:
    """Define ``names`` (methods or functions of ``source``) in ``namespace`` by running their code."""
    for name, code in extract_all(source, names).items():
        exec(compile("from __future__ import annotations\n" + code, f"<{name}>", "exec"), namespace)
    return namespace


class Request:
    """The fields of ``v1/request.py`` these paths read, for one prefill request with two images."""

    def __init__(self, placeholder_range):
        self.request_id = "r"
        self.mm_features = [
            types.SimpleNamespace(mm_position=placeholder_range(offset=o, length=n), identifier=f"image-{k}")
            for k, (o, n) in enumerate(IMAGES)
        ]
        self.num_prompt_tokens = self.num_tokens = self.num_tokens_with_spec = PROMPT
        self.num_computed_tokens = 0
        self.num_output_placeholders = 0
        self.num_output_tokens = 0
        self.max_tokens = 16
        self.shared_prefix_boundary = 0  # 0.33.0: no shared-prefix junction detected
        self.has_encoder_inputs = True

    def get_num_encoder_embeds(self, input_id: int) -> int:
        return self.mm_features[input_id].mm_position.get_num_embeds()


class Engine:
    """One tree's scheduling code for one request, stepped as ``schedule``/``update_from_output`` do."""

    def __init__(self, tree, sched_text: str, *, eagle: bool):
        self.upstream = "def _reserve_prefill_lookahead(" in sched_text
        self.segments = _segments(sched_text)
        inputs = _run(
            tree.read("multimodal/inputs.py"),
            ["PlaceholderRange"],
            {"dataclass": dataclasses.dataclass, "cached_property": functools.cached_property, "torch": torch},
        )
        logger = types.SimpleNamespace(debug=lambda *a, **k: None, warning=lambda *a, **k: None)
        ecm = _run(tree.read(ECM), ["EncoderCacheManager"], {"OrderedDict": OrderedDict, "Mapping": Mapping, "logger": logger})
        methods = ["_try_schedule_encoder_inputs", "_mamba_block_aligned_split", "_free_encoder_inputs"]
        if self.upstream:
            methods += ["_free_encoder_input", "_reject_on_encoder_cache_embed_mismatch", "_reserve_prefill_lookahead"]
        namespace = {"logger": logger}
        if self.upstream:
            namespace["cdiv"] = lambda a, b: -(-a // b)  # vllm.utils.math_utils.cdiv
            namespace["get_mm_features_in_window"] = _run(
                tree.read("multimodal/utils.py"), ["get_mm_features_in_window"], {"bisect": bisect}
            )["get_mm_features_in_window"]
            _run(tree.read("v1/kv_cache_interface.py"),
                 ["get_mamba_prefill_checkpoint_position", "is_mamba_prefill_checkpoint_valid"], namespace)
        _run(sched_text, [f"Scheduler.{name}" for name in methods], namespace)
        scheduler = type("Scheduler", (), {name: namespace[name] for name in methods})
        self.impl = impl = object.__new__(scheduler)
        impl.cache_config = types.SimpleNamespace(block_size=BLOCK)
        impl.scheduler_config = types.SimpleNamespace(
            long_prefill_token_threshold=0, disable_chunked_mm_input=False, enable_chunked_prefill=True
        )
        impl.encoder_cache_manager = ecm["EncoderCacheManager"](cache_size=BUDGET)  # max(batched tokens, item)
        impl.max_model_len = 4096
        impl.is_encoder_decoder = False
        impl.ec_connector = None
        impl.need_mamba_block_aligned_split = True
        impl.use_eagle = eagle  # 0.20.1: MTP is an eagle-style drafter (shift 1, one block pruned)
        # 0.33.0's names for the same configuration (no partial hits, no prefill checkpoints)
        impl.block_size = impl.hash_block_size = BLOCK
        impl.max_num_scheduled_tokens = BUDGET
        impl.mamba_partial_cache_hit = False
        impl.mamba_has_prefill_checkpoint_blocks = False
        impl.mamba_prefill_checkpoint_alignment = None
        impl.mamba_shared_prefix_checkpoint = False
        impl.use_eagle_block_drop = eagle
        impl.num_hash_lookahead_tokens = 0
        impl.num_prefill_lookahead = 1 if eagle else 0
        impl.num_sampled_tokens_per_step = 1
        impl.encoder_cache_mismatch_reqs = set()
        self.request = Request(inputs["PlaceholderRange"])
        self.steps = 0

    def step(self) -> int:
        """One ``schedule()`` for the request, then its output: the chunk's length (0: skipped)."""
        request, first = self.request, self.steps == 0 and "waiting" in self.segments
        ns = {"self": self.impl, "request": request, "token_budget": BUDGET, "encoder_compute_budget": BUDGET,
              "req_index": 0}
        if first:  # a new request: no prefix-cache hit, no connector
            ns |= {"load_kv_async": False, "num_computed_tokens": 0, "num_new_local_computed_tokens": 0,
                   "num_external_computed_tokens": 0}
        ns |= {"long_prefill_token_threshold": 0, "input_budget": BUDGET, "draft_slots": 0}  # 0.33.0's loop
        exec(self.segments["waiting" if first else "running"], ns)
        self.steps += 1
        if not ns.get("_reached"):
            return 0
        # Restated: schedule() allocates the scheduled encoder inputs; the step computes the chunk;
        # update_from_output frees what the computed tokens have passed.
        for i in ns["encoder_inputs_to_schedule"] or ():
            self.impl.encoder_cache_manager.allocate(request, i)
        request.num_computed_tokens += ns["num_new_tokens"]
        self.impl._free_encoder_inputs(request)
        return ns["num_new_tokens"]

    def cached(self) -> list[int]:
        """The images this request still holds in the encoder cache (referenced, not freeable)."""
        held = self.impl.encoder_cache_manager.cached
        return [i for i, f in enumerate(self.request.mm_features) if self.request.request_id in held.get(f.identifier, ())]


def _chunks(engine: Engine, steps: int = 12) -> list[tuple[int, int]]:
    """(start, end) of each step's chunk, 0-length ones included, until the prompt is computed."""
    out = []
    for _ in range(steps):
        start = engine.request.num_computed_tokens
        if start >= PROMPT:
            break
        out.append((start, start + engine.step()))
    return out


@pytest.fixture(scope="module")
def engines(catalogue, sessions):
    old, new = sessions("v0.20.1"), sessions("v0.33.0")
    texts = {
        "pristine": (old.tree, old.tree.read(SCHED)),
        "patched": (old.tree, patched_files(catalogue, old, "P34")[SCHED]),
        "upstream": (new.tree, new.tree.read(SCHED)),
    }
    return {name: functools.partial(Engine, tree, text) for name, (tree, text) in texts.items()}


# -- the scenario -----------------------------------------------------------------------------------


@pytest.mark.parametrize("eagle", [False, True], ids=["no-spec", "mtp"])
def test_pristine_hangs_before_the_second_image(engines, eagle):
    engine = engines["pristine"](eagle=eagle)
    chunks = _chunks(engine)
    assert chunks[0] == (0, 32)  # cut at image B (40), then rounded down to the block
    assert chunks[1:] == [(32, 32)] * 11  # 8 (or 7) tokens before B: rounded to 0, every step
    assert engine.request.num_computed_tokens == 32
    assert engine.cached() == [0]  # image A ends at 36: never passed, never freed; B never fits


@pytest.mark.parametrize("eagle", [False, True], ids=["no-spec", "mtp"])
def test_patched_progresses_with_block_aligned_ends(engines, eagle):
    engine = engines["patched"](eagle=eagle)
    chunks = _chunks(engine)
    assert engine.request.num_computed_tokens == PROMPT
    assert all(end > start for start, end in chunks)
    shift = 1 if eagle else 0
    assert chunks[0] == (0, 40 - shift)  # kept as the encoder cut it, mid-block
    assert chunks[1] == (40 - shift, 48)  # starts mid-block: ends at that block's boundary
    for start, end in chunks:
        if start % BLOCK:  # a chunk that starts mid-block never crosses its boundary
            assert end <= (start // BLOCK + 1) * BLOCK, (start, end)
    # every end before the prompt's last cacheable block is a block boundary, or the encoder's cut
    cuts = {offset - shift for offset, _ in IMAGES}
    assert all(end % BLOCK == 0 or end in cuts or end == PROMPT for _, end in chunks)
    assert engine.cached() == []


def test_patched_schedules_what_0_33_0_schedules(engines):
    """0.33.0's real loop (its first chunk through the running loop: its waiting loop calls the split
    before the encoder too, scheduler.py:1349-1363) gives the same chunks as patched 0.20.1. Without
    a drafter only: with MTP 0.20.1 stops one token before an image it cannot take (its eagle shift,
    scheduler.py:1229-1234), 0.33.0 at the image (its prefill lookahead), which P34 does not touch."""
    patched, upstream = engines["patched"](eagle=False), engines["upstream"](eagle=False)
    assert _chunks(patched) == _chunks(upstream)
    assert patched.request.num_computed_tokens == upstream.request.num_computed_tokens == PROMPT


def test_first_chunk_through_either_loop(engines):
    """The waiting loop (a new request) and the running loop size the first chunk alike."""
    for name in ("pristine", "patched"):
        waiting = engines[name](eagle=False)
        running = engines[name](eagle=False)
        del running.segments["waiting"]
        assert waiting.step() == running.step(), name
