# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The adaptive budget's step on the worker: the host plan that trims the
scheduler's output, and the GPU split that hands the step's nodes to the
requests, against MRv2's own input writers run on the split a brute-force
ranking gives (CPU: Triton interpreter)."""

import ast
import copy
import dataclasses
import inspect
import textwrap
import types

import numpy as np
import pytest
import torch

from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.spec_decode.ddtree_adaptive import AdaptiveTreeBudget
from vllm.v1.spec_decode.ddtree_config import DDTreeConfig

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
CFG = DDTreeConfig(7, 3, (1, 3), adaptive=True)


def _vllm_config(max_num_seqs=8, tokens=256):
    return types.SimpleNamespace(
        scheduler_config=types.SimpleNamespace(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=tokens
        ),
        compilation_config=types.SimpleNamespace(max_cudagraph_capture_size=64),
        parallel_config=types.SimpleNamespace(tensor_parallel_size=1),
    )


def _budget(choice):
    """An AdaptiveTreeBudget whose controller picks ``choice(num_reqs, cap)``."""
    budget = AdaptiveTreeBudget(CFG, _vllm_config(), 8, DEVICE)
    controller = budget._controller()
    calls = []

    def choose(num_reqs, max_budget, has_trees, timed):
        calls.append((num_reqs, max_budget, has_trees, timed))
        return choice(num_reqs, max_budget)

    controller.choose = choose
    budget.drafted_last = True
    budget.full_step_pending = False  # past the engine's warm-up
    return budget, calls


def _output(tokens, spec):
    out = SchedulerOutput.make_empty()
    out.num_scheduled_tokens = dict(tokens)
    out.scheduled_spec_decode_tokens = {r: [-1] * n for r, n in spec.items()}
    out.total_num_scheduled_tokens = sum(tokens.values())
    return out


def test_plan_trims_a_uniform_decode_step():
    budget, calls = _budget(lambda r, cap: 3)
    out = _output({"a": 8, "b": 8, "c": 8}, {"a": 7, "b": 7, "c": 7})
    before = copy.deepcopy(out)
    trimmed = budget.plan(out)
    assert trimmed is not out
    assert trimmed.num_scheduled_tokens == {"a": 4, "b": 4, "c": 4}
    assert trimmed.scheduled_spec_decode_tokens == {r: [-1] * 3 for r in "abc"}
    assert trimmed.total_num_scheduled_tokens == 12
    # The scheduler's own output is left as it gave it (it counts rejections
    # against the slots it scheduled).
    assert out == before
    assert calls == [(3, 7, True, True)]
    plan = budget._plan
    assert (plan.num_reqs, plan.budget, plan.cap, plan.decode_only) == (3, 3, 7, True)
    # Each request verifies at most 3 nodes unless the batch-wide split runs.
    assert budget.step_max_nodes == 3


def test_plan_keeps_a_full_step_and_drops_every_draft_at_zero():
    budget, _ = _budget(lambda r, cap: cap)
    out = _output({"a": 8, "b": 8}, {"a": 7, "b": 7})
    assert budget.plan(out) is out
    assert budget.step_max_nodes == 7
    budget, _ = _budget(lambda r, cap: 0)
    trimmed = budget.plan(out)
    assert budget.step_max_nodes == 0
    assert trimmed.num_scheduled_tokens == {"a": 1, "b": 1}
    assert trimmed.scheduled_spec_decode_tokens == {}
    assert trimmed.total_num_scheduled_tokens == 2


def test_plan_leaves_prompts_and_trimmed_trees_their_tokens():
    """A prompt chunk keeps its tokens; a request the scheduler gave fewer
    slots caps the step's budget; neither step is timed nor re-split."""
    budget, calls = _budget(lambda r, cap: min(3, cap))
    out = _output({"a": 8, "p": 5, "b": 3}, {"a": 7, "b": 2})
    trimmed = budget.plan(out)
    assert trimmed.num_scheduled_tokens == {"a": 3, "p": 5, "b": 3}
    assert trimmed.scheduled_spec_decode_tokens == {"a": [-1] * 2, "b": [-1] * 2}
    assert trimmed.total_num_scheduled_tokens == 11
    assert calls == [(2, 2, True, False)]
    assert not budget._plan.decode_only


def test_plan_without_drafts_or_trees():
    budget, calls = _budget(lambda r, cap: cap)
    out = _output({"p": 9}, {})
    budget.step_max_nodes = 5
    assert budget.plan(out) is out and calls == []
    assert budget.step_max_nodes == 0
    # No tree was drafted for this step: the controller is told so.
    budget.drafted_last = False
    budget.plan(_output({"a": 8}, {"a": 7}))
    assert calls == [(1, 7, False, True)]


def test_report_gives_the_step_budget_and_the_next_best():
    """What the step's output tells the scheduler: the budget the step
    verified (None where it verified every slot it was given) and the budget
    should_draft found best for the next step of this many requests."""
    budget, _ = _budget(lambda r, cap: 3)
    assert budget.report() is None  # nothing drafted yet
    controller = budget.controller
    controller.best_budget = lambda num_reqs, max_budget, **_: min(num_reqs, max_budget)
    budget.plan(_output({"a": 8, "b": 8, "c": 8}, {"a": 7, "b": 7, "c": 7}))
    assert budget.should_draft(3)
    assert budget.report() == (3, 3, 3)
    # A step without drafts verified nothing; a batch the scheduler gives no
    # slots at all has nothing to report for the next step but 0.
    budget.plan(_output({"p": 9}, {}))
    budget.should_draft(2)
    assert budget.report() == (None, 2, 2)
    budget, _ = _budget(lambda r, cap: cap)
    budget.controller.best_budget = lambda num_reqs, max_budget, **_: max_budget
    budget.plan(_output({"a": 8, "b": 8}, {"a": 7, "b": 7}))
    budget.should_draft(2)
    assert budget.report() == (7, 2, budget.slots[2])


def test_the_first_steps_draft_and_verify_every_slot(monkeypatch):
    """vLLM's kernel warm-up (a prefill, then a decode step) must reach the
    verification kernels even where the cost model would not speculate: else
    they first compile inside a user's request."""
    from vllm.v1.spec_decode import ddtree_adaptive

    budget = AdaptiveTreeBudget(CFG, _vllm_config(), 8, DEVICE)
    controller = budget._controller()
    controller.should_draft = lambda num_reqs, max_budget: False
    calls = []

    def choose(num_reqs, max_budget, has_trees, timed):
        calls.append((num_reqs, max_budget, has_trees, timed))
        return 0

    controller.choose = choose
    out = _output({"a": 8, "b": 8}, {"a": 7, "b": 7})
    # No tree yet (the prefill step's plan): nothing forced.
    budget.plan(_output({"a": 2, "b": 2}, {}))
    assert budget.full_step_pending
    # Even at a batch size the scheduler gives no slots: vLLM's warm-up decode
    # step schedules tree_budget placeholders for every request regardless.
    slots, budget.slots = budget.slots, [0] * len(budget.slots)
    assert budget.should_draft(2) and budget.drafted_last
    budget.slots = slots
    # Requests with fewer slots keep theirs: the step runs as scheduled.
    uneven = _output({"a": 8, "b": 4}, {"a": 7, "b": 3})
    assert budget.plan(uneven) is uneven and calls == []
    assert budget._plan is None  # nothing for reallocate to split
    assert not budget.full_step_pending
    # Nor do the trees drafted before and right after it estimate anything
    # for the controller (it keeps its prior until a user's trees).
    marked = []
    monkeypatch.setattr(
        ddtree_adaptive, "expected_accepted_nodes", lambda *a: marked.append(a)
    )
    lp, temp = torch.zeros(2, 7, device=DEVICE), torch.zeros(8, device=DEVICE)
    budget.observe_trees(lp, temp, torch.arange(2))
    assert marked == [] and not any(budget._host_pending)
    budget.plan(_output({}, {}))  # the next step's plan: a user's trees now
    budget.observe_trees(lp, temp, torch.arange(2))
    assert len(marked) == 1 and budget._host_pending[0]
    # Its walk (over vLLM's dummy prompts) does not teach the calibration;
    # the next step's does.
    updates = []
    budget.calibration = types.SimpleNamespace(update=lambda *a: updates.append(a))
    batch = types.SimpleNamespace(idx_mapping="idx", cu_num_logits="cu")
    budget.observe_walk("lp", batch, "t", "nodes", "n")
    assert updates == []
    budget.observe_walk("lp", batch, "t", "nodes", "n")
    assert updates == [("lp", "idx", "t", "cu", "nodes", "n")]
    # Then the controller decides, both whether to draft and the budget.
    assert not budget.should_draft(2)
    budget.drafted_last = True
    trimmed = budget.plan(out)
    assert calls == [(2, 7, True, True)]
    assert trimmed.total_num_scheduled_tokens == 2


# ---------------------------------------------------------------------------
# The GPU split
# ---------------------------------------------------------------------------

MAX_REQS, CAP = 8, 7


def _runner(gen, num_reqs, log_probs, temperature, logprobs=False):
    from vllm.v1.worker.gpu.input_batch import InputBuffers
    from vllm.v1.worker.gpu.sample.states import NO_LOGPROBS

    def tensor(x):
        return x.to(DEVICE)

    return types.SimpleNamespace(
        input_buffers=InputBuffers(MAX_REQS, 256, DEVICE),
        req_states=types.SimpleNamespace(
            num_computed_tokens=types.SimpleNamespace(
                gpu=tensor(torch.randint(5, 50, (MAX_REQS,), generator=gen).int())
            ),
            last_sampled_tokens=tensor(
                torch.randint(0, 99, (MAX_REQS,), generator=gen)
            ),
            prefill_len=types.SimpleNamespace(gpu=tensor(torch.ones(MAX_REQS).int())),
            draft_tokens=tensor(torch.randint(0, 99, (MAX_REQS, CAP), generator=gen)),
        ),
        sampler=types.SimpleNamespace(
            sampling_states=types.SimpleNamespace(
                temperature=types.SimpleNamespace(gpu=tensor(temperature)),
                max_num_logprobs=lambda idx: 5 if logprobs else NO_LOGPROBS,
            )
        ),
        speculator=types.SimpleNamespace(
            trees=types.SimpleNamespace(log_probs=tensor(log_probs))
        ),
        model_state=types.SimpleNamespace(num_new_sampled_tokens_per_step=1),
        decode_query_len=1 + CAP,
    )


def _prepared_batch(runner, idx_mapping, counts):
    """What MRv2's prepare_inputs writes for a decode batch whose request r
    verifies counts[r] drafts (its positions, seq_lens, input ids, logit rows
    and sampler row mapping)."""
    from vllm.v1.worker.gpu.input_batch import (
        InputBatch,
        combine_sampled_and_draft_tokens,
        expand_idx_mapping,
        prepare_pos_seq_lens,
    )

    buffers, req_states = runner.input_buffers, runner.req_states
    num_reqs = len(counts)
    qsl_np = np.concatenate([[0], np.cumsum(1 + np.asarray(counts))]).astype(np.int32)
    num_tokens = int(qsl_np[-1])
    buffers.query_start_loc.fill_(num_tokens)
    buffers.query_start_loc[: num_reqs + 1] = torch.from_numpy(qsl_np)
    qsl = buffers.query_start_loc[: num_reqs + 1]
    cu = torch.from_numpy(qsl_np.copy()).to(DEVICE)
    idx = torch.tensor(idx_mapping, dtype=torch.int32, device=DEVICE)
    prepare_pos_seq_lens(
        idx,
        qsl,
        req_states.num_computed_tokens.gpu,
        buffers.positions,
        buffers.seq_lens,
    )
    logits_indices = combine_sampled_and_draft_tokens(
        buffers.input_ids,
        idx,
        req_states.last_sampled_tokens,
        qsl,
        buffers.seq_lens[:num_reqs],
        req_states.prefill_len.gpu,
        req_states.draft_tokens,
        cu,
        num_tokens,
        1,
    )
    expanded, local = expand_idx_mapping(idx, num_tokens, cu, runner.decode_query_len)
    computed = req_states.num_computed_tokens.gpu[idx.long()].cpu().numpy()
    return InputBatch(
        req_ids=[f"r{i}" for i in range(num_reqs)],
        num_reqs=num_reqs,
        num_reqs_after_padding=num_reqs,
        idx_mapping=idx,
        idx_mapping_np=np.asarray(idx_mapping, dtype=np.int32),
        expanded_idx_mapping=expanded,
        expanded_local_pos=local,
        num_scheduled_tokens=np.diff(qsl_np),
        num_tokens=num_tokens,
        num_tokens_after_padding=num_tokens,
        num_draft_tokens=int(sum(counts)),
        num_draft_tokens_per_req=np.asarray(counts, dtype=np.int32),
        query_start_loc=qsl,
        query_start_loc_np=qsl_np,
        seq_lens=buffers.seq_lens[:num_reqs],
        seq_lens_cpu_upper_bound=torch.from_numpy(computed + np.diff(qsl_np)),
        dcp_local_seq_lens=None,
        num_computed_tokens_np=computed,
        prefill_len_np=np.ones(num_reqs, dtype=np.int32),
        num_computed_prefill_tokens_np=np.ones(num_reqs, dtype=np.int32),
        is_prefilling_np=np.zeros(num_reqs, dtype=bool),
        max_seq_len_np=None,
        input_ids=buffers.input_ids[:num_tokens],
        positions=buffers.positions[:num_tokens],
        is_padding=buffers.is_padding[:num_tokens],
        logits_indices=logits_indices,
        cu_num_logits=cu,
        cu_num_logits_np=qsl_np.copy(),
        has_structured_output_reqs=False,
        prompt_lens=None,
    )


def _snapshot(batch):
    n = batch.num_tokens
    return {
        "query_start_loc": batch.query_start_loc.cpu(),
        "cu_num_logits": batch.cu_num_logits.cpu(),
        "positions": batch.positions[:n].cpu(),
        "seq_lens": batch.seq_lens.cpu(),
        "input_ids": batch.input_ids[:n].cpu(),
        "logits_indices": batch.logits_indices.cpu(),
        "expanded_idx_mapping": batch.expanded_idx_mapping.cpu(),
        "expanded_local_pos": batch.expanded_local_pos.cpu(),
    }


@pytest.mark.parametrize("num_reqs,b", [(2, 3), (3, 3), (5, 1), (6, 3), (8, 1)])
def test_reallocate_equals_mrv2_inputs_of_the_ranked_split(num_reqs, b):
    """After the trimmed step's inputs (b drafts each), reallocate leaves the
    batch MRv2 would have prepared for the brute-force ranking's split: every
    input the target and the sampler read, and the host's sequence bound."""
    from tests.v1.spec_decode.test_ddtree_budget import assign_tree_nodes_reference

    compared = moved = 0
    for seed in range(3):
        gen = torch.Generator().manual_seed(100 * num_reqs + 10 * b + seed)
        log_probs = -torch.rand(MAX_REQS, CAP, generator=gen).cumsum(1) * 3
        log_probs[0, 2:] = -torch.inf  # a short tree
        log_probs[1] = -torch.inf  # a slot with no tree (a join)
        temperature = (torch.rand(MAX_REQS, generator=gen) > 0.5).float()
        idx_mapping = torch.randperm(MAX_REQS, generator=gen)[:num_reqs].tolist()
        runner = _runner(gen, num_reqs, log_probs, temperature, logprobs=seed == 1)
        budget = AdaptiveTreeBudget(CFG, _vllm_config(), MAX_REQS, DEVICE)
        budget._plan = types.SimpleNamespace(
            num_reqs=num_reqs, budget=b, cap=CAP, decode_only=True
        )
        batch = _prepared_batch(runner, idx_mapping, [b] * num_reqs)
        even_bound = batch.seq_lens_cpu_upper_bound.clone()
        out = budget.reallocate(runner, batch)
        # A request may now verify up to the cap: its path bound follows.
        assert budget.step_max_nodes == CAP
        got = _snapshot(out)
        counts, _ = assign_tree_nodes_reference(
            log_probs.numpy(),
            np.asarray(idx_mapping),
            temperature.numpy(),
            budget.calibration.rate.cpu().numpy(),
            CAP,
            num_reqs * b,
        )
        assert counts.sum() == num_reqs * b
        moved += int((counts != b).any())
        assert torch.equal(
            budget.counts[:num_reqs].cpu(), torch.from_numpy(counts).int()
        )
        want = _snapshot(_prepared_batch(runner, idx_mapping, counts.tolist()))
        for name, value in want.items():
            assert torch.equal(got[name], value), name
            compared += value.numel()
        assert torch.equal(out.seq_lens_cpu_upper_bound, even_bound + CAP - b)
    print(f"{compared} input values compared, {moved} of 3 splits uneven")
    assert moved >= 2  # the split really moves nodes between requests
    assert compared >= 3 * 5 * num_reqs * (1 + b)


def test_reallocate_keeps_the_even_split_where_there_is_none_to_make():
    """One request, a full or empty budget, a step with a prompt in it: no
    split. Requests with logprobs are split (the tree
    sampler lays their entries out at offsets the host knows)."""
    gen = torch.Generator().manual_seed(0)
    log_probs = -torch.rand(MAX_REQS, CAP, generator=gen).cumsum(1)
    temperature = torch.zeros(MAX_REQS)
    cases = [
        (dict(num_reqs=1, budget=3, cap=CAP, decode_only=True), False),
        (dict(num_reqs=3, budget=CAP, cap=CAP, decode_only=True), False),
        (dict(num_reqs=3, budget=0, cap=CAP, decode_only=True), False),
        (dict(num_reqs=3, budget=3, cap=CAP, decode_only=False), False),
    ]
    for plan, logprobs in cases:
        runner = _runner(gen, plan["num_reqs"], log_probs, temperature, logprobs)
        budget = AdaptiveTreeBudget(CFG, _vllm_config(), MAX_REQS, DEVICE)
        budget._plan = types.SimpleNamespace(**plan)
        n = plan["num_reqs"]
        batch = _prepared_batch(runner, list(range(n)), [plan["budget"]] * n)
        before = _snapshot(batch)
        out = budget.reallocate(runner, batch)
        assert out is batch and budget._plan is None
        after = _snapshot(out)
        assert all(torch.equal(before[k], after[k]) for k in before)


def test_start_up_times_never_fall_with_the_batch():
    # A replay timed slower than a larger batch's was timed over something
    # else: the larger batch's time bounds it (and the prior stays a lower
    # bound of a step's cost).
    from vllm.v1.spec_decode.ddtree_adaptive import _never_faster_when_larger

    times = {1: 2e-4, 2: 3e-4, 4: 5.6, 8: 4e-4, 16: 3.5e-4, 32: 9e-4}
    fixed = _never_faster_when_larger(times)
    assert fixed == {1: 2e-4, 2: 3e-4, 4: 3.5e-4, 8: 3.5e-4, 16: 3.5e-4, 32: 9e-4}
    assert _never_faster_when_larger({}) == {}


def test_start_up_reports_graphs_slower_than_larger_ones():
    # The drafter graphs of 2 and 4 requests once replayed for seconds at
    # start-up; the monotone fix hid it from the log.
    from vllm.v1.spec_decode.ddtree_adaptive import _slower_than_larger

    times = {1: 2e-4, 2: 2.37, 4: 7.1, 8: 1.3e-4, 16: 1.5e-4, 32: 2.1e-4}
    assert _slower_than_larger(times) == [2, 4]
    # Small differences are noise, and the largest shape bounds nothing.
    assert _slower_than_larger({1: 3e-4, 2: 2e-4, 4: 5e-4, 8: 1.0}) == []
    assert _slower_than_larger({}) == []


def test_graph_timing_keeps_the_fastest_timed_replay(monkeypatch):
    """The start-up times of ``_time_graphs``: FULL graphs only, the ones
    ``keep`` picks, each prepared before its replays; the warm-up replay
    counts in the GPU total only. Replays are timed by fake events that read
    the seconds a fake graph manager gives each replay."""
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.spec_decode import ddtree_adaptive

    clock = [0.0]

    class Event:
        def __init__(self, enable_timing=False):
            self.at = None

        def record(self):
            self.at = clock[0]

        def elapsed_time(self, end):
            return 1e3 * (end.at - self.at)

    monkeypatch.setattr(ddtree_adaptive.torch.cuda, "Event", Event)
    monkeypatch.setattr(ddtree_adaptive.torch.cuda, "synchronize", lambda: None)

    @dataclasses.dataclass(frozen=True)
    class Desc:  # MRv2's BatchExecutionDescriptor keys the graphs
        num_tokens: int
        cg_mode: CUDAGraphMode = CUDAGraphMode.FULL
        num_reqs: int | None = None

    graphs = [Desc(16), Desc(32), Desc(48), Desc(64), Desc(16, CUDAGraphMode.NONE)]
    # Another graph of 64 tokens, in more requests: not timed.
    graphs.append(Desc(64, num_reqs=4))
    # Seconds of each replay of each graph, the warm one first.
    replays = {16: [5.0, 3e-4, 2e-4, 4e-4], 32: [2.0, 6e-4, 5e-4, 7e-4]}
    replays[64] = [1.0, 9e-4, 8e-4, 9e-4]
    order, prepared = [], []

    class Manager:
        def __init__(self):
            self.graphs = {g: None for g in graphs}

        def run_fullgraph(self, d):
            assert d.cg_mode == CUDAGraphMode.FULL
            order.append(d.num_tokens)
            clock[0] += replays[d.num_tokens][order.count(d.num_tokens) - 1]

    times, gpu = ddtree_adaptive._time_graphs(
        Manager(), prepared.append, keep=lambda n: n != 48
    )
    assert [d.num_tokens for d in prepared] == [16, 32, 64]
    assert order == [16] * 4 + [32] * 4 + [64] * 4
    assert times == pytest.approx({16: 2e-4, 32: 5e-4, 64: 8e-4})
    assert gpu == pytest.approx(sum(sum(v) for v in replays.values()))
    assert ddtree_adaptive._time_graphs(None) == ({}, 0.0)
    powers = [n for n in range(1, 40) if ddtree_adaptive._is_power_of_two(n)]
    assert powers == [1, 2, 4, 8, 16, 32]


def test_profile_times_one_target_graph_per_token_count(monkeypatch):
    """The graphs vLLM 0.26's graph manager plans for the default adaptive
    server (``vllm serve`` on an H100: 1024 sequences and 8192 batched
    tokens, which DDTree fits to 512 sequences; tree_budget 1024): a uniform
    decode graph per capture size and ladder budget that divides it. The
    profile times one graph per token count, the one of fewest requests,
    with 1 + _PROFILE_REPLAYS replays each."""
    from vllm.config.compilation import CUDAGraphMode

    from vllm.v1.spec_decode import ddtree_adaptive
    from vllm.v1.spec_decode.ddtree_config import (
        adaptive_ladder,
        batch_limits,
        cudagraph_capture_sizes,
        tree_budget_of,
    )
    from vllm.v1.worker.gpu import cudagraph_utils

    tree = tree_budget_of(1024, None, True)
    cfg = DDTreeConfig(1024, 15, adaptive_ladder(1024)[1:-1], adaptive=True)
    seqs, tokens = batch_limits(cfg, 1024, 8192, False, False)
    sizes = cudagraph_capture_sizes(cfg, seqs, tokens)
    vllm_config = types.SimpleNamespace(
        scheduler_config=types.SimpleNamespace(max_num_seqs=seqs),
        compilation_config=types.SimpleNamespace(
            cudagraph_capture_sizes=sizes, max_cudagraph_capture_size=sizes[-1]
        ),
        parallel_config=types.SimpleNamespace(
            data_parallel_size=1, tensor_parallel_size=1
        ),
        speculative_config=types.SimpleNamespace(
            uses_dynamic_speculative_decoding=lambda: True,
            num_speculative_tokens_per_batch_size=(
                tree.num_speculative_tokens_per_batch_size
            ),
        ),
        num_speculative_tokens=1024,
    )
    monkeypatch.setattr(
        cudagraph_utils,
        "get_pp_group",
        lambda: types.SimpleNamespace(is_first_rank=True, is_last_rank=True),
    )
    monkeypatch.setattr(
        cudagraph_utils.current_platform,
        "get_global_graph_pool",
        lambda: None,
        raising=False,
    )
    manager = cudagraph_utils.CudaGraphManager(
        vllm_config, torch.device("cpu"), CUDAGraphMode.FULL_AND_PIECEWISE, 1025
    )
    full = [d for d in manager._capture_descs[CUDAGraphMode.FULL]]
    manager.graphs = {
        d: None for descs in manager._capture_descs.values() for d in descs
    }
    timed = ddtree_adaptive._profiled_graphs(manager)
    per_graph = 1 + ddtree_adaptive._PROFILE_REPLAYS
    counts = sorted({d.num_tokens for d in full})
    before, after = per_graph * len(full), per_graph * len(timed)
    print(
        f"target graphs {len(full)} over {len(counts)} token counts: "
        f"{before} replays before, {after} now"
    )
    assert sorted(d.num_tokens for d in timed) == counts
    for d in timed:
        assert d.num_reqs == min(
            e.num_reqs for e in full if e.num_tokens == d.num_tokens
        )
    assert (len(full), len(counts)) == (261, 51) and (before, after) == (1044, 204)


def test_profile_replays_the_drafter_over_its_own_shapes_metadata(monkeypatch):
    """Before the step-cost profile replays a drafter graph, the drafter's
    buffers hold a dummy batch of that graph's shape and its attention
    metadata is rebuilt from them (the order ``propose`` keeps). Without the
    rebuild, on an H200 the graphs of 2 and 4 requests replayed for 2.4 s
    and 7.1 s each."""
    import types

    from vllm.v1.spec_decode import ddtree_adaptive

    calls = []
    monkeypatch.setattr(
        ddtree_adaptive.InputBatch,
        "make_dummy",
        lambda num_reqs, num_tokens, buffers: calls.append(
            ("batch", num_reqs, num_tokens, buffers)
        ),
    )
    buffers = object()
    spec = types.SimpleNamespace(
        num_query_per_req=16,
        input_buffers=buffers,
        _group_causal={0: False},
        block_tables=types.SimpleNamespace(
            get_dummy_slot_mappings=lambda n: calls.append(("slots", n))
        ),
        _build_draft_attn_metadata=lambda **kw: calls.append(("attn", kw)),
    )
    shapes = [(64, 4), (32, None), (512, 32)]
    for num_tokens, num_reqs in shapes:
        desc = types.SimpleNamespace(num_tokens=num_tokens, num_reqs=num_reqs)
        ddtree_adaptive._dummy_draft_inputs(spec, desc)
    expected = []
    for num_tokens, num_reqs in shapes:
        reqs = num_reqs or num_tokens // 16
        expected += [
            ("batch", reqs, num_tokens, buffers),
            ("slots", num_tokens),
            (
                "attn",
                {
                    "num_reqs": reqs,
                    "num_reqs_padded": reqs,
                    "num_tokens_padded": num_tokens,
                    "causal": {0: False},
                },
            ),
        ]
    assert calls == expected
    print(f"drafter graph shapes prepared: {len(shapes)}, calls checked: {len(calls)}")
    assert len(calls) >= 9


def test_warm_up_compiles_the_split_for_every_cap_block(monkeypatch):
    """A step's cap is the fewest slots a request got (the scheduler trims a
    request near max_model_len to any count), and the split's kernel is
    compiled per block of it (``cap_block``: powers of 4): the warm-up
    launches one cap of every block up to the largest slot count. The kernels
    are stubbed; the calls are what is checked."""
    from vllm.v1.spec_decode import ddtree_adaptive

    from vllm.v1.spec_decode.ddtree_cost import budget_ladder

    cfg = DDTreeConfig(128, 15, budget_ladder(128)[1:-1], adaptive=True)
    budget = AdaptiveTreeBudget(cfg, _vllm_config(tokens=8192), 8, DEVICE)
    assert max(budget.slots) == 128
    caps, widths = [], []
    monkeypatch.setattr(
        ddtree_adaptive,
        "assign_tree_nodes",
        lambda lp, idx, t, s, cap, *a: caps.append(cap),
    )
    monkeypatch.setattr(
        ddtree_adaptive, "build_ddtree", lambda logits, width, out: widths.append(width)
    )
    monkeypatch.setattr(ddtree_adaptive, "expected_accepted_nodes", lambda *a: None)

    class Scratch:
        def __init__(self, device):
            pass

        def update(self, *a):
            pass

    monkeypatch.setattr(ddtree_adaptive, "TreeAcceptanceCalibration", Scratch)
    trees = types.SimpleNamespace(
        scatter_=lambda *a: None, reset_=lambda slot: None, log_probs=None
    )
    spec = types.SimpleNamespace(
        trees=trees,
        hidden_size=4,
        dtype=torch.float32,
        model=types.SimpleNamespace(compute_logits=lambda h: h),
        _batch_trees=lambda n, w: types.SimpleNamespace(log_probs=None),
        draft_tokens=None,
    )
    temperature = types.SimpleNamespace(gpu=torch.zeros(8))
    runner = types.SimpleNamespace(
        speculator=spec,
        sampler=types.SimpleNamespace(
            sampling_states=types.SimpleNamespace(temperature=temperature)
        ),
    )
    budget.warm_up(runner)
    from vllm.v1.spec_decode.ddtree_budget import cap_block

    blocks = {cap_block(c) for c in caps}
    needed = {cap_block(c) for c in range(1, 129)}
    assert blocks == needed == {4, 16, 64, 256} and len(caps) == len(needed)
    assert max(caps) == 128 and sorted(set(widths)) == sorted(
        {max(1, k) for k in budget.slots[1:]}
    )


def test_tensor_parallel_without_graphs_warns(monkeypatch):
    """Under tensor parallelism periods are not learned (ranks must agree), so
    an engine without captured graphs would never speculate: it says so."""
    from vllm.v1.spec_decode import ddtree_adaptive

    warnings = []
    monkeypatch.setattr(
        ddtree_adaptive.logger, "warning", lambda msg, *a: warnings.append(msg % a)
    )
    config = _vllm_config()
    config.parallel_config.tensor_parallel_size = 2
    budget = AdaptiveTreeBudget(CFG, config, 8, DEVICE)
    controller = budget._controller()
    assert not controller.learn and controller.best_budget(1, 7) == 0
    assert len(warnings) == 1 and "captured none" in warnings[0]
    budget._controller()
    assert len(warnings) == 1
    AdaptiveTreeBudget(CFG, _vllm_config(), 8, DEVICE)._controller()
    assert len(warnings) == 1


@pytest.mark.parametrize("tp_size", [1, 2])
def test_estimates_reach_the_plan_that_may_read_them(monkeypatch, tp_size):
    """The GPU's estimate of the trees just built reaches a later step's plan
    through a pinned host copy: on one rank as soon as it landed (here at
    once: no events on the CPU); under tensor parallelism, alike on every
    rank, the newest copy made before the previous step began, also after a
    long stretch without drafting (a probe's trees)."""
    from vllm.v1.spec_decode import ddtree_adaptive

    def estimate(lp, t, idx, calibration, width, nodes, out):
        out.fill_(float(lp[0, 0]))

    monkeypatch.setattr(ddtree_adaptive, "expected_accepted_nodes", estimate)
    config = _vllm_config()
    config.parallel_config.tensor_parallel_size = tp_size
    budget = AdaptiveTreeBudget(CFG, config, 8, DEVICE)
    budget.full_step_pending = False  # past the engine's warm-up
    controller = budget._controller()
    # Which estimate arrives, not how the controller blends it
    # (test_ddtree_cost.py checks that).
    controller.update_curve = controller.set_curve
    idle = _output({}, {})

    def trees(marker):
        lp = torch.full((2, 7), float(marker), device=DEVICE)
        budget.observe_trees(lp, torch.zeros(8, device=DEVICE), torch.arange(2))

    def read():
        budget.plan(idle)
        curve = controller._curve
        return None if curve is None else curve.per_request[1] * curve.num_reqs

    seen = []
    budget.plan(idle)
    trees(10)  # drafted every step: one copy per step
    seen.append(read())
    trees(20)
    seen.append(read())
    seen.append(read())
    for _ in range(30):  # no drafting, then a probe
        read()
    trees(30)
    seen.append(read())
    seen.append(read())
    if tp_size == 1:
        assert seen == [10, 20, 20, 30, 30]
    else:
        assert seen == [None, 10, 20, 20, 30]


class _LaggingGpu:
    """Stand-in CUDA events for the estimate's host copies: a copy lands once
    the stand-in GPU has finished the step whose trees it estimates, which
    happens ``lag`` steps after the host enqueued it (a GPU-bound engine
    under async scheduling)."""

    def __init__(self, lag: int):
        self.lag = lag
        self.host_step = 0

    def event(self):
        gpu = self

        class Event:
            recorded_at = None

            def record(self):
                self.recorded_at = gpu.host_step

            def query(self):
                return (
                    self.recorded_at is not None
                    and gpu.host_step - self.recorded_at >= gpu.lag
                )

        return Event()


@pytest.mark.parametrize("num_copies, lag", [(4, 1), (4, 2), (4, 3), (2, 3)])
def test_estimates_reach_the_plan_while_the_gpu_runs_behind(
    monkeypatch, num_copies, lag
):
    """A GPU-bound engine whose every step drafts: each step's plan reads the
    newest estimate that has landed, ``lag`` steps old. Under async
    scheduling the host plans step k once step k-2's sampled tokens are back,
    while the GPU may still run step k-2's drafter: the copies of steps k-1
    and k-2 have then not landed (lag 3). With two host copies (the ring's
    size before) each copy was overwritten before it landed and the
    controller kept an old estimate for good: the control case, which must
    read nothing."""
    from vllm.v1.spec_decode import ddtree_adaptive

    def estimate(lp, t, idx, calibration, width, nodes, out):
        out.fill_(float(lp[0, 0]))

    monkeypatch.setattr(ddtree_adaptive, "expected_accepted_nodes", estimate)
    monkeypatch.setattr(ddtree_adaptive, "_NUM_ESTIMATE_COPIES", num_copies)
    budget = AdaptiveTreeBudget(CFG, _vllm_config(), 8, DEVICE)
    budget.full_step_pending = False  # past the engine's warm-up
    gpu = _LaggingGpu(lag)
    budget._host_ready = [gpu.event() for _ in budget._host_ready]
    controller = budget._controller()
    read = []
    controller.update_curve = lambda curve: read.append(
        (gpu.host_step, round(curve.per_request[1] * curve.num_reqs))
    )
    idle = _output({}, {})
    steps = 40
    for step in range(1, steps + 1):
        gpu.host_step = step
        budget.plan(idle)
        lp = torch.full((2, 7), float(step), device=DEVICE)
        budget.observe_trees(lp, torch.zeros(8, device=DEVICE), torch.arange(2))
    print(f"{len(read)} estimates read over {steps} steps")
    if num_copies <= lag:
        assert read == []
        return
    # Every plan from the first landed copy on reads the newest one.
    assert read == [(step, step - lag) for step in range(lag + 1, steps + 1)]
    assert len(read) >= steps - 3


def _self_attributes(cls) -> set[str]:
    """Names a class's methods assign as ``self.<name>``."""
    names = set()
    for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(cls)))):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        for target in targets:
            if (
                isinstance(target, ast.Attribute)
                and isinstance(target.value, ast.Name)
                and target.value.id == "self"
            ):
                names.add(target.attr)
    return names


def test_stand_in_speculator_matches_the_real_one():
    """The tests above give the budget stand-in speculators; every attribute
    ddtree_adaptive reads from the runner's speculator must exist on
    DDTreeSpeculator, or a renamed attribute passes here and fails only on a
    GPU engine (as ``speculator.state`` once did)."""
    from vllm.v1.spec_decode import ddtree_adaptive
    from vllm.v1.spec_decode.ddtree import DDTreeSpeculator

    tree = ast.parse(inspect.getsource(ddtree_adaptive))

    def is_speculator(node) -> bool:
        return isinstance(node, ast.Attribute) and node.attr == "speculator"

    # Per function: local names bound to the runner's speculator
    # (``spec = runner.speculator``) and helpers' ``spec`` parameters, and
    # what is read from them.
    read, num_aliases = set(), 0
    for func in ast.walk(tree):
        if not isinstance(func, ast.FunctionDef):
            continue
        aliases = {
            target.id
            for node in ast.walk(func)
            if isinstance(node, ast.Assign) and is_speculator(node.value)
            for target in node.targets
            if isinstance(target, ast.Name)
        }
        aliases |= {a.arg for a in func.args.args if a.arg in ("spec", "speculator")}
        num_aliases += len(aliases)
        read |= {
            node.attr
            for node in ast.walk(func)
            if isinstance(node, ast.Attribute)
            and (
                is_speculator(node.value)
                or (isinstance(node.value, ast.Name) and node.value.id in aliases)
            )
        }
    provided = set(dir(DDTreeSpeculator))
    for cls in DDTreeSpeculator.__mro__[:-1]:
        provided |= _self_attributes(cls)
    print(f"{len(read)} speculator attributes read by ddtree_adaptive: {sorted(read)}")
    assert num_aliases and len(read) >= 5
    assert not read - provided, sorted(read - provided)


class _GraphManager:
    """MRv2's graph manager as far as the profile asks it: a uniform decode
    step replays a FULL graph up to ``largest`` tokens, for the query
    lengths it captured."""

    def __init__(self, largest, query_lens):
        self.largest = largest
        self.query_lens = query_lens

    def dispatch(self, num_reqs, num_tokens, uniform_token_count, num_loras):
        from vllm.config.compilation import CUDAGraphMode

        full = num_tokens <= self.largest and uniform_token_count in self.query_lens
        mode = CUDAGraphMode.FULL if full else CUDAGraphMode.NONE
        return types.SimpleNamespace(cg_mode=mode)


def test_the_profile_asks_the_runners_dispatch_which_steps_replay_a_graph():
    from vllm.v1.spec_decode import ddtree_adaptive

    ladder = (0, 1, 3, 7)
    table = ddtree_adaptive._graphed_budgets(_GraphManager(32, {1, 2, 8}), ladder, 8)
    assert len(table) == 9 and table[0] == ()
    # No graph of 4-token queries was captured; 8 requests of 8 tokens is 64.
    assert table[1] == (0, 1, 7)
    assert table[4] == (0, 1, 7)
    assert table[8] == (0, 1)
    assert ddtree_adaptive._graphed_budgets(None, ladder, 8) is None
    # The controller bounds its budgets by the table; without graphs, none.
    budget = AdaptiveTreeBudget(CFG, _vllm_config(), 8, DEVICE)
    controller = budget._new_controller({8: 1e-3, 32: 2e-3}, {1: 1e-4}, table)
    assert controller.cost.graphed_budgets is table
    assert not controller.cost.graphed(8, 7)
    assert budget._new_controller({}, {}, table).cost.graphed_budgets is None
