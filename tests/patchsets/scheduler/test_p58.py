"""P58 on real 0.20.1 and 0.33.0 source: a request that sat out a step reaches the GPU without -1 ids.

Behaviour test running real vLLM code extracted from the trees (the scheduler and runner
modules import torch.cuda paths, the config package and the KV cache manager). Real code:
- ``AsyncScheduler`` (the whole class, over the real ``Scheduler._update_after_schedule``):
  after scheduling a decode it sets the ``-1`` draft placeholders;
- from ``Scheduler.schedule``'s running-request loop, the statements a decode goes through:
  kiln's guard (patched side), ``num_new_tokens = ...`` and the "Speculative decode related"
  block that fills ``scheduled_spec_decode_tokens``;
- the V1 runner's input path: ``InputBatch.update_req_spec_token_ids`` (scheduled drafts into
  ``token_ids_cpu``), ``CpuGpuBuffer`` and ``GPUModelRunner._prepare_input_ids`` (overwrites
  placeholders on the device from the previous step's sampled/draft tokens), on CPU torch.
Restated (documented where used): the request's token counters (``num_tokens_with_spec`` =
tokens + drafts, as in ``v1/request.py``), the output accounting of a step (accepted drafts
appended, rejected ones subtracted, placeholders drained), and ``_prepare_inputs``' gather of
``token_ids_cpu`` into ``input_ids.cpu``. Which requests a step schedules is the test's choice:
the failure needs one request to sit out a step (a prefill chunk ahead of it took the budget).
"""

from __future__ import annotations

import types
from typing import Any

import libcst as cst
import libcst.matchers as m
import numpy as np
import pytest
import torch

from kiln.patch.anchor import resolve
from kiln.patch.shapes import cls, func
from tests.patchsets.support.patchlib import extract, patched_files

SCHED = "v1/core/sched/scheduler.py"
ASYNC_SCHED = "v1/core/sched/async_scheduler.py"
RUNNER = "v1/worker/gpu_model_runner.py"
INPUT_BATCH = "v1/worker/gpu_input_batch.py"
UTILS = "v1/utils.py"

K = 3  # num_speculative_tokens
SCHEDULE = (cls("Scheduler"), func("schedule"))
NUM_NEW_TOKENS = m.SimpleStatementLine(
    body=[
        m.Assign(
            targets=[m.AssignTarget(target=m.Name("num_new_tokens"))],
            value=m.BinaryOperation(
                left=m.BinaryOperation(left=m.Attribute(attr=m.Name("num_tokens_with_spec")))
            ),
        )
    ]
)
SPEC_BLOCK = m.If(test=m.Attribute(value=m.Name("request"), attr=m.Name("spec_token_ids")))


def _statement(module: cst.Module, anchor) -> Any:
    node = resolve(module, anchor).unique
    assert node is not None, anchor
    code = module.code_for_node(node)
    lines = code.splitlines()
    indent = min(len(x) - len(x.lstrip()) for x in lines if x.strip())
    return compile("\n".join(x[indent:] for x in lines), "<schedule>", "exec")


class Request:
    """The counters of ``v1/request.py`` a decode step reads and writes."""

    def __init__(self, request_id, tokens):
        self.request_id = request_id
        self.all_token_ids = list(tokens)
        self.spec_token_ids: list[int] = []
        self.num_computed_tokens = len(tokens) - 1  # decoding: all but the last sampled token
        self.num_output_placeholders = 0
        self.is_prefill_chunk = False
        self.use_structured_output = False
        self.num_in_flight_tokens = 0  # 0.33.0's in-flight accounting (not read here)
        self.next_decode_eligible_step = 0

    @property
    def num_tokens(self):
        return len(self.all_token_ids)

    @property
    def num_tokens_with_spec(self):
        return len(self.all_token_ids) + len(self.spec_token_ids)


class Scheduler:
    """The real scheduling statements and AsyncScheduler of one source, over stand-in state."""

    def __init__(self, sched_text, async_text, *, guard=None, v2_runner=False, use_pp=False):
        """``guard``: the anchor of kiln's guard in a patched ``sched_text``."""
        module = cst.parse_module(sched_text)
        self.loop = [_statement(module, guard)] if guard else []
        self.loop += [
            _statement(module, (*SCHEDULE, NUM_NEW_TOKENS)),
            _statement(module, (*SCHEDULE, SPEC_BLOCK)),
        ]
        base = {}
        exec(compile(extract(sched_text, "Scheduler._update_after_schedule"), "<base>", "exec"), base)
        stand_in = type("Scheduler", (), {"_update_after_schedule": base["_update_after_schedule"]})
        ns = {"Scheduler": stand_in, "SchedulerOutput": object, "Request": object, "RequestStatus": object}
        ns |= {"envs": types.SimpleNamespace(VLLM_XPU_PP_MICROBATCH=False)}
        ns |= {"current_platform": types.SimpleNamespace(is_xpu=lambda: False)}
        exec(compile(extract(async_text, "AsyncScheduler"), "<async_scheduler>", "exec"), ns)
        self.impl = object.__new__(ns["AsyncScheduler"])
        self.impl.requests = {}
        self.impl.num_spec_tokens = K
        self.impl._spec_token_placeholders = [-1] * K
        self.impl.num_sampled_tokens_per_step = 1
        self.impl.use_v2_model_runner = v2_runner
        self.impl.use_pp = use_pp
        self.impl.prev_step_scheduled_req_ids = set()
        self.impl.current_step = 0
        self.impl.decode_stagger = 1
        self.impl.defer_block_free = False  # 0.33.0
        self.impl._inflight_prefills = set()  # 0.33.0

    def step(self, requests):
        """Schedule ``requests`` (in this order); the rest of ``running`` sits this step out."""
        num_scheduled, spec = {}, {}
        for request in requests:
            self.impl.requests[request.request_id] = request
            ns = {
                "self": self.impl,
                "request": request,
                "scheduled_spec_decode_tokens": spec,
            }
            for statement in self.loop:
                exec(statement, ns)
            num_scheduled[request.request_id] = ns["num_new_tokens"]
        output = types.SimpleNamespace(
            # what the runner receives as each request's num_computed_tokens
            num_computed_tokens={r.request_id: r.num_computed_tokens for r in requests},
            num_scheduled_tokens=num_scheduled,
            scheduled_spec_decode_tokens=spec,
            num_spec_tokens_to_schedule=K,
            pending_structured_output_tokens=False,
            has_structured_output_requests=False,
        )
        # schedule(): remember the batch, then _update_after_schedule (async: placeholders)
        self.impl.prev_step_scheduled_req_ids = set(num_scheduled)
        self.impl._update_after_schedule(output)
        return output

    def finish(self, output, accepted):
        """The step's output comes back: ``accepted`` drafts per request plus one sampled token."""
        for req_id in output.num_scheduled_tokens:
            request = self.impl.requests[req_id]
            drafts = len(output.scheduled_spec_decode_tokens.get(req_id, ()))
            rejected = drafts - min(accepted, drafts)
            request.num_computed_tokens -= rejected
            request.num_output_placeholders -= rejected
            new = [1000 + len(request.all_token_ids) + i for i in range(drafts - rejected + 1)]
            request.all_token_ids += new
            request.num_output_placeholders -= len(new)
            assert request.num_output_placeholders >= 0


# --- the V1 runner's input path ----------------------------------------------------------


def _runner_parts(tree):
    ns: dict = {"torch": torch, "np": np, "CachedRequestState": object, "PIN_MEMORY": False}
    exec(compile(extract(tree.read(UTILS), "CpuGpuBuffer"), "<utils>", "exec"), ns)
    exec(
        compile(extract(tree.read(INPUT_BATCH), "InputBatch.update_req_spec_token_ids"), "<ib>", "exec"),
        ns,
    )
    exec(compile(extract(tree.read(RUNNER), "GPUModelRunner._prepare_input_ids"), "<runner>", "exec"), ns)
    return ns


def worker_input_ids(tree, output, batch, prev_batch, prev_drafts, requests):
    """Token ids the model embeds for ``output`` (V1 runner, async scheduling)."""
    parts = _runner_parts(tree)
    max_len = 64
    input_batch = types.SimpleNamespace(
        req_ids=list(batch),
        req_id_to_index={r: i for i, r in enumerate(batch)},
        spec_token_ids=[[] for _ in batch],
        token_ids_cpu=np.zeros((len(batch), max_len), dtype=np.int32),
        is_token_ids=np.zeros((len(batch), max_len), dtype=bool),
        num_tokens_no_spec=np.zeros(len(batch), dtype=np.int64),
        # previous step's sampled token per request of the previous batch (on the device)
        prev_sampled_token_ids=torch.tensor(
            [[7000 + i] for i in range(len(prev_batch))], dtype=torch.int32
        ),
    )
    for i, req_id in enumerate(batch):
        request = requests[req_id]
        known = request.all_token_ids
        input_batch.token_ids_cpu[i, : len(known)] = known
        input_batch.num_tokens_no_spec[i] = len(known)
        state = types.SimpleNamespace(req_id=req_id, prev_num_draft_len=0)
        parts["update_req_spec_token_ids"](input_batch, state, output.scheduled_spec_decode_tokens)
    total = sum(output.num_scheduled_tokens[r] for r in batch)
    runner = types.SimpleNamespace(
        input_batch=input_batch,
        input_ids=parts["CpuGpuBuffer"](max_len, dtype=torch.int32, device="cpu", pin_memory=False),
        prev_positions=types.SimpleNamespace(
            np=np.array([prev_batch.index(r) if r in prev_batch else -1 for r in batch])
        ),
        enable_prompt_embeds=False,
        num_spec_tokens=K,
        prev_num_spec_tokens=K,
        _draft_token_ids=torch.tensor(prev_drafts, dtype=torch.int64),
        pin_memory=False,
        device=torch.device("cpu"),
        _pp_recv_work=None,
    )
    # _prepare_inputs: gather each request's scheduled positions from token_ids_cpu
    flat = []
    for i, req_id in enumerate(batch):
        start = output.num_computed_tokens[req_id]
        flat += list(input_batch.token_ids_cpu[i, start : start + output.num_scheduled_tokens[req_id]])
    runner.input_ids.np[:total] = flat
    cu_num_tokens = np.cumsum([output.num_scheduled_tokens[r] for r in batch])
    parts["_prepare_input_ids"](runner, output, len(batch), total, cu_num_tokens)
    ids = runner.input_ids.gpu[:total].tolist()
    out, at = {}, 0
    for req_id in batch:
        n = output.num_scheduled_tokens[req_id]
        out[req_id] = ids[at : at + n]
        at += n
    return out


def run_scenario(sched_text, async_text, tree, *, guard=None):
    """A and R decode; R sits out step 2 (a prefill chunk ahead of it took the budget)."""
    scheduler = Scheduler(sched_text, async_text, guard=guard)
    a = Request("A", range(1, 11))
    r = Request("R", range(101, 111))
    requests = {"A": a, "R": r}
    # step 1: both decode; the scheduler sets their [-1]*K placeholders afterwards
    first = scheduler.step([a, r])
    scheduler.finish(first, accepted=1)
    # step 2: only A (R sat out); step 1's output has been processed by now
    second = scheduler.step([a])
    scheduler.finish(second, accepted=K)
    # step 3: both again; the runner's previous batch is step 2's [A]
    third = scheduler.step([a, r])
    prev_drafts = [[5001, 5002, 5003]]  # what the drafter proposed for A in step 2
    ids = worker_input_ids(tree, third, ["A", "R"], ["A"], prev_drafts, requests)
    return third, ids, r


def _sources(catalogue, sessions, label, patched):
    session = sessions(label)
    if patched:
        files = patched_files(catalogue, session, "P58")
        return files[SCHED], session.tree.read(ASYNC_SCHED), session.tree
    return session.tree.read(SCHED), session.tree.read(ASYNC_SCHED), session.tree


@pytest.fixture(scope="module")
def guard(catalogue):
    (edit,) = catalogue.get("P58").edits
    return edit.patched


LABELS = ["v0.20.1", "v0.33.0"]


@pytest.mark.parametrize("label", LABELS)
def test_pristine_sends_minus_one_to_the_embedding(catalogue, sessions, label):
    third, ids, r = run_scenario(*_sources(catalogue, sessions, label, False))
    assert third.scheduled_spec_decode_tokens["R"] == [-1] * K  # stale placeholders shipped
    assert ids["R"][1:] == [-1] * K  # and nothing overwrote them
    assert -1 not in ids["A"]  # A was in the previous batch: filled from its drafts


@pytest.mark.parametrize("label", LABELS)
def test_patched_schedules_a_plain_decode(catalogue, sessions, guard, label):
    third, ids, r = run_scenario(*_sources(catalogue, sessions, label, True), guard=guard)
    assert "R" not in third.scheduled_spec_decode_tokens
    assert third.num_scheduled_tokens["R"] == 1
    assert ids["R"] == [r.all_token_ids[-1]]  # its last real token, no placeholder
    # A keeps its drafts, filled on the device from the previous step
    assert third.scheduled_spec_decode_tokens["A"] == [-1] * K
    assert ids["A"] == [7000, 5001, 5002, 5003]
    # and R gets placeholders again after this step, as a member of this batch
    assert r.spec_token_ids == [-1] * K


@pytest.mark.parametrize("label", LABELS)
def test_no_change_when_every_request_runs_every_step(catalogue, sessions, guard, label):
    outputs = []
    for patched in (False, True):
        sources = _sources(catalogue, sessions, label, patched)[:2]
        scheduler = Scheduler(*sources, guard=guard if patched else None)
        a, b = Request("A", range(1, 11)), Request("B", range(101, 111))
        trace = []
        for accepted in (0, 2, K, 1):
            out = scheduler.step([a, b])
            trace.append((dict(out.num_scheduled_tokens), dict(out.scheduled_spec_decode_tokens)))
            scheduler.finish(out, accepted=accepted)
        outputs.append(trace)
    assert outputs[0] == outputs[1]
    assert outputs[1][-1][1] == {"A": [-1] * K, "B": [-1] * K}


def test_v2_runner_and_pipeline_parallel_keep_the_placeholders(catalogue, sessions, guard):
    sched, async_text, _ = _sources(catalogue, sessions, "v0.20.1", True)
    for kwargs in ({"v2_runner": True}, {"use_pp": True}):
        scheduler = Scheduler(sched, async_text, guard=guard, **kwargs)
        a, r = Request("A", range(1, 11)), Request("R", range(101, 111))
        scheduler.finish(scheduler.step([a, r]), accepted=1)
        scheduler.finish(scheduler.step([a]), accepted=1)
        assert scheduler.step([a, r]).scheduled_spec_decode_tokens["R"] == [-1] * K


@pytest.mark.parametrize("label", LABELS)
def test_applies_once(catalogue, sessions, label):
    from kiln.patch.engine import isolated_run
    from kiln.patch.model import BuildTarget, Verdict

    session = sessions(label)
    target = BuildTarget(session.tree.vllm_version)
    first = isolated_run(catalogue, session, target, "P58")
    assert first.outcomes["P58"].verdict is Verdict.APPLIES
    again = isolated_run(catalogue, session.overlay(first.state.changed), target, "P58")
    assert again.outcomes["P58"].verdict is Verdict.ALREADY_PATCHED
