# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""One tree budget per step for the whole batch, sized by cost and acceptance.

The scheduler gives each decoding request a cap of draft slots
(:func:`~vllm.v1.spec_decode.ddtree_config.scheduled_tree_budgets`); each step
the model runner then verifies fewer, in three parts:

1. :meth:`AdaptiveTreeBudget.plan` (host, before the step's inputs are
   prepared): the controller (``ddtree_cost.py``) picks a per-request budget
   ``b`` from the ladder, and the step is trimmed to ``b`` drafts per request,
   so that vLLM prepares, pads and dispatches a batch of ``num_reqs * (1 + b)``
   tokens (a uniform decode batch, replayed from its CUDA graph).
2. :meth:`AdaptiveTreeBudget.reallocate` (GPU, after MRv2 prepared the
   trimmed batch): the ``num_reqs * b`` nodes are handed to the requests by
   one batch-wide ranking of every tree's nodes by estimated acceptance
   (:func:`~vllm.v1.spec_decode.ddtree_budget.assign_tree_nodes`), at most the
   scheduler's cap each; query offsets, positions, input ids, logit rows and
   the sampler's row mapping are rewritten for that split (the tree sampler
   lays out logprobs at offsets the host knows). Skipped where MRv2 reads a
   host copy of the split (prompts in the step, whose offsets it keeps) or
   where there is nothing to move (one request).
3. After the walk, :meth:`AdaptiveTreeBudget.observe_walk` teaches the
   calibration what was accepted; after the next trees are built,
   :meth:`AdaptiveTreeBudget.observe_trees` estimates what each ladder budget
   would accept and starts copying it to the host, where a later step's plan
   reads the newest copy that has landed (a few steps late on a GPU-bound
   engine, so the host never waits for the GPU).

``b = 0`` is a plain decode step; when the controller expects the next step
not to speculate either, the speculator skips the drafter's forward and keeps
only its context up to date (:meth:`AdaptiveTreeBudget.should_draft`).
"""

import copy
import time
from dataclasses import dataclass
from typing import NamedTuple

import torch

from vllm.config import VllmConfig
from vllm.config.compilation import CUDAGraphMode
from vllm.logger import init_logger
from vllm.triton_utils.parallel_compile import compile_in_parallel
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.spec_decode.ddtree_budget import (
    TreeAcceptanceCalibration,
    assign_tree_nodes,
    cap_block,
    expected_accepted_nodes,
)
from vllm.v1.spec_decode.ddtree_config import DDTreeConfig, engine_tree_slots
from vllm.v1.spec_decode.dflash_tree_builder import build_ddtree
from vllm.v1.spec_decode.ddtree_cost import (
    AcceptanceCurve,
    StepCostModel,
    TreeBudgetController,
)
from vllm.v1.worker.gpu.cudagraph_utils import prepare_inputs_to_capture
from vllm.v1.worker.gpu.input_batch import (
    InputBatch,
    combine_sampled_and_draft_tokens,
    expand_idx_mapping,
    prepare_pos_seq_lens,
)

logger = init_logger(__name__)

# CUDA-graph replays timed per captured shape at start-up (after one warm
# one); the fastest counts.
_PROFILE_REPLAYS = 3
# A graph timed this many times slower than a larger one's is reported.
_SLOW_FACTOR = 4
# Host copies of the acceptance estimate (AdaptiveTreeBudget._read_estimate):
# enough that one made a few steps before a plan has landed while the GPU runs
# behind the host.
_NUM_ESTIMATE_COPIES = 4


class BudgetReport(NamedTuple):
    """Sent with a step's output to the scheduler (``ddtree_slots.py``)."""

    step_budget: int | None  # nodes per request this step (None: its slots)
    num_reqs: int  # the batch the next budget was chosen for
    next_budget: int  # the budget should_draft found best for it


@dataclass
class StepPlan:
    """The host's choice for one step, handed from ``plan`` to ``reallocate``."""

    num_reqs: int  # decoding requests with draft slots
    budget: int  # b: nodes per request on average
    cap: int  # the fewest draft slots the scheduler gave a request
    # Every scheduled request decodes with draft slots (no prompt in the
    # step): the batch-wide split may move nodes between requests, each up
    # to ``cap``.
    decode_only: bool


class AdaptiveTreeBudget:
    """The worker's side of an adaptive DDTree engine (one per speculator)."""

    def __init__(
        self,
        cfg: DDTreeConfig,
        vllm_config: VllmConfig,
        max_num_reqs: int,
        device: torch.device,
    ):
        self.cfg = cfg
        self.max_num_reqs = max_num_reqs
        # Draft slots per request by batch size, as the scheduler gives them.
        self.slots = engine_tree_slots(cfg, vllm_config)
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.calibration = TreeAcceptanceCalibration(device)
        self.controller: TreeBudgetController | None = None
        self.device = device
        ladder = cfg.ladder
        # [max_num_reqs] nodes each request of the step verifies.
        self.counts = torch.zeros(max_num_reqs, dtype=torch.int32, device=device)
        # Row r, first len(ladder) entries: the ladder's node totals for r
        # requests, so that a step reads a view instead of launching a
        # multiply. Rows are padded to 16 bytes: every row's address has the
        # alignment Triton specialises on, whatever r.
        num_ladder = len(ladder)
        padded = torch.zeros(-(-num_ladder // 4) * 4, dtype=torch.int32)
        padded[:num_ladder] = torch.tensor(ladder, dtype=torch.int32)
        self._ladder_nodes = (
            torch.arange(max_num_reqs + 1, dtype=torch.int32)[:, None] * padded
        ).to(device)[:, :num_ladder]
        # Expected accepted nodes per ladder budget, then the calibration's
        # running totals; a ring of pinned host copies, written in turn, of
        # which a plan reads the newest that has landed. Under async
        # scheduling a GPU-bound engine runs steps behind its host: a copy
        # made one or two steps before a plan has often not landed, and with
        # too few copies each is overwritten before it is read.
        self._estimate = torch.zeros(len(ladder) + 4, device=device)
        on_gpu = device.type == "cuda"
        num_copies = _NUM_ESTIMATE_COPIES
        self._host = [
            torch.zeros(len(ladder) + 4, pin_memory=on_gpu) for _ in range(num_copies)
        ]
        self._host_reqs = [0] * num_copies
        # Steps planned so far, and at which count each host copy was made:
        # under tensor parallelism a copy is read once two steps have
        # started since (the same step on every rank).
        self._plans = 0
        self._host_plan = [0] * num_copies
        # Without a GPU the copies are synchronous and need no events.
        self._host_ready = [
            torch.cuda.Event() if on_gpu else None for _ in range(num_copies)
        ]
        self._host_pending = [False] * num_copies
        self._slot = 0  # the copy the next estimate goes to
        self._plan: StepPlan | None = None
        # For the scheduler, with the step's output (``report``): the budget
        # this step verified per request (None: every slot as scheduled), and
        # the requests and budget should_draft found best for the next one.
        self._step_budget: int | None = None
        self._advice: tuple[int, int] | None = None
        # The most tree nodes a request verifies in the current step (0:
        # none): bounds the accepted path the drafter's context keeps.
        self.step_max_nodes = 0
        # Whether the drafter ran at the end of the last step: the trees the
        # next step can verify.
        self.drafted_last = False
        # Until the first decode step with trees: draft, and verify every
        # slot. vLLM's kernel warm-up (a prefill step, then a decode step)
        # runs the engine's own step, whose verification kernels (tree inputs,
        # walk, KV compaction) would otherwise first compile inside a user's
        # request, as the cost model's first choice there is a plain step.
        self.full_step_pending = True
        # That step's walk accepts over vLLM's dummy prompts: it must not
        # teach the calibration (a pessimistic start would keep requests from
        # ever verifying a tree, and only verified trees correct it).
        self._skip_walk = False
        # Nor do the trees drafted for it and right after it (the plan count
        # of that step): the first estimate the controller reads is of a
        # user's trees, until then its prior.
        self._warm_plan = -1

    # -- start-up -------------------------------------------------------------

    @torch.inference_mode()
    def profile(self, runner) -> None:
        """Seed the cost model with GPU times of the captured step shapes:
        a target graph of every token count and the drafter's graphs,
        replayed a few times each once the engine has captured them."""

        def dummy_inputs(desc) -> None:
            # A graph reads what its capture left in the buffers: make them a
            # batch of this graph's own shape (causal rows, padded slots), and
            # its attention metadata as capture built it (a single-token graph
            # runs FlashAttention, whose scheduler buffer holds the last
            # batch's plan otherwise).
            prepare_inputs_to_capture(
                desc.num_reqs,
                desc.num_tokens,
                runner.model_state,
                runner.input_buffers,
                runner.block_tables,
                runner.attn_groups,
                runner.kv_cache_config,
            )

        spec = runner.speculator
        start = time.perf_counter()
        target, target_gpu = _time_graphs(runner.cudagraph_manager, dummy_inputs)
        target_seconds = time.perf_counter() - start
        # The drafter's graphs at 1, 2, 4, ... requests and the largest: its
        # time barely grows with the batch (interpolated between them). The
        # log line below gives each group's GPU time, which shows a replay
        # over inputs no step would leave.
        manager = getattr(spec, "query_cudagraph_manager", None)
        largest = max((d.num_tokens for d in getattr(manager, "graphs", ())), default=0)
        drafter, drafter_gpu = _time_graphs(
            manager,
            lambda desc: _dummy_draft_inputs(spec, desc),
            keep=lambda n: n == largest or _is_power_of_two(n // self.cfg.draft_len),
        )
        drafter = {
            n // self.cfg.draft_len: t
            for n, t in drafter.items()
            if n % self.cfg.draft_len == 0
        }
        graphed = _graphed_budgets(
            runner.cudagraph_manager, self.cfg.ladder, self.max_num_reqs
        )
        if self.tp_size > 1:
            from vllm.distributed.parallel_state import get_tp_group

            # Every rank must choose the same budgets: rank 0's times.
            target, drafter, graphed = get_tp_group().broadcast_object(
                (target, drafter, graphed), src=0
            )
        for name, times in (("target", target), ("drafter", drafter)):
            slow = _slower_than_larger(times)
            if slow:
                # A replay over inputs no step leaves: the cost model takes the
                # larger shape's time, but start-up paid for the slow replays.
                logger.warning(
                    "DDTree: the %s's CUDA graphs for %s replayed at least %dx "
                    "slower than a larger shape's at start-up",
                    name,
                    ", ".join(f"{n} ({1e3 * times[n]:.2f} ms)" for n in slow),
                    _SLOW_FACTOR,
                )
        target, drafter = (
            _never_faster_when_larger(target),
            _never_faster_when_larger(drafter),
        )
        self.controller = self._new_controller(target, drafter, graphed)
        logger.info(
            "DDTree: adaptive tree budget over %s nodes per request; step-cost "
            "prior from %d target graph shapes (%s) and %d drafter graph shapes "
            "(%s), timed in %.1f s (the target's in %.1f s; their replays "
            "kept the GPU busy %.1f s, the drafter's %.1f s)",
            list(self.cfg.ladder),
            len(target),
            _time_range(target, "tokens"),
            len(drafter),
            _time_range(drafter, "requests"),
            time.perf_counter() - start,
            target_seconds,
            target_gpu,
            drafter_gpu,
        )

    @torch.inference_mode()
    def warm_up(self, runner) -> int:
        """Compile every kernel variant an adaptive step can meet, with the
        engine's own buffers: a variant first met by a user's request would
        compile inside that step. The variants follow the tree widths the
        drafter builds (the scheduler's slots by batch size, also where the
        drafter runs without a graph) and the step caps; they compile on a
        thread pool first (:func:`compile_in_parallel`). Returns the launches.
        """
        start = time.perf_counter()
        widths, launches = compile_in_parallel(lambda: self._warm_up_launches(runner))
        logger.info(
            "DDTree: adaptive budget kernels warmed up for tree widths %s in %.1f s",
            widths,
            time.perf_counter() - start,
        )
        return launches

    def _warm_up_launches(self, runner) -> tuple[list[int], int]:
        """:meth:`warm_up`'s launches: (the tree widths, the launches)."""
        spec = runner.speculator
        trees_state = spec.trees
        temperature = runner.sampler.sampling_states.temperature.gpu
        device = self.device
        idx = torch.zeros(1, dtype=torch.int32, device=device)
        scratch = TreeAcceptanceCalibration(device)
        qsl = torch.zeros(2, dtype=torch.int32, device=device)
        cu = torch.zeros(2, dtype=torch.int32, device=device)
        hidden = torch.zeros(
            self.cfg.draft_depth, spec.hidden_size, dtype=spec.dtype, device=device
        )
        launches = 0
        widths = sorted({max(1, k) for k in self.slots[1:]})
        for width in widths:
            # The drafter's logits as _generate_draft computes them (layout
            # and strides included), built into the flat output's views.
            logits = spec.model.compute_logits(hidden)
            trees = spec._batch_trees(1, width)
            build_ddtree(
                logits.unflatten(0, (1, self.cfg.draft_depth)), width, out=trees
            )
            trees_state.scatter_(idx, trees, 1, spec.draft_tokens)
            expected_accepted_nodes(
                trees.log_probs,
                temperature,
                idx,
                scratch,
                width,
                self._ladder_nodes[1],
                self._estimate,
            )
            launches += 3
        # The step's cap is the fewest slots a request got, which the
        # scheduler trims near max_model_len: any value up to the largest, so
        # one cap of every block of the split's kernel up to it.
        most = max(self.slots[1:], default=0)
        caps = {min(cap_block(c), most) for c in range(1, most + 1)}
        for cap in sorted(caps):
            assign_tree_nodes(
                trees_state.log_probs,
                idx,
                temperature,
                scratch,
                cap,
                1,
                self.counts,
                qsl,
                cu,
            )
            launches += 1
        accepted = torch.zeros(
            1, self.cfg.draft_depth, dtype=torch.int32, device=device
        )
        scratch.update(
            trees_state.log_probs, idx, temperature, cu, accepted, accepted[:, 0]
        )
        # Slot 0's tree is not a request's: a request added there is reset.
        trees_state.reset_(0)
        return widths, launches + 2

    # -- before the step ------------------------------------------------------

    def plan(self, scheduler_output: SchedulerOutput) -> SchedulerOutput:
        """This step's budget; returns the scheduler output trimmed to it (the
        scheduler's own object is left as it is: it counts rejections against
        the slots it gave)."""
        controller = self._controller()
        self._plans += 1
        self._read_estimate(controller)
        controller.step_started()
        self._step_budget = None
        self.step_max_nodes = 0
        spec = scheduler_output.scheduled_spec_decode_tokens
        if not spec:
            return scheduler_output
        num_tokens = scheduler_output.num_scheduled_tokens
        slots = list(map(len, spec.values()))
        cap, most, num_slots = min(slots), max(slots), sum(slots)
        num_reqs = len(spec)
        pure = len(num_tokens) == num_reqs and (
            scheduler_output.total_num_scheduled_tokens == num_reqs + num_slots
        )
        if self.full_step_pending and self.drafted_last:
            # The warm-up's decode step: every slot as scheduled (no split),
            # neither timed nor logged.
            self.full_step_pending = False
            self._skip_walk = True
            self._warm_plan = self._plans
            self._plan = None
            self.step_max_nodes = most
            return scheduler_output
        b = controller.choose(num_reqs, cap, has_trees=self.drafted_last, timed=pure)
        self._plan = StepPlan(num_reqs, b, cap, pure)
        self._step_budget = b
        # Each request keeps at most b of its slots; the batch-wide split
        # (reallocate) may raise one to the cap.
        self.step_max_nodes = b
        if b == most:
            return scheduler_output
        trimmed = copy.copy(scheduler_output)
        if pure and cap == most:
            # Every request decodes with as many slots: 1 + b tokens each.
            trimmed.num_scheduled_tokens = dict.fromkeys(num_tokens, 1 + b)
        else:
            trimmed.num_scheduled_tokens = {
                r: n - len(spec[r]) + min(b, len(spec[r])) if r in spec else n
                for r, n in num_tokens.items()
            }
        trimmed.scheduled_spec_decode_tokens = (
            {r: v[:b] for r, v in spec.items()} if b else {}
        )
        trimmed.total_num_scheduled_tokens = (
            scheduler_output.total_num_scheduled_tokens - num_slots + num_reqs * b
        )
        return trimmed

    def reallocate(self, runner, input_batch: InputBatch) -> InputBatch:
        """The batch-wide split of the trimmed step's nodes (GPU, no sync)."""
        plan, self._plan = self._plan, None
        if (
            plan is None
            or not plan.decode_only
            or plan.budget == 0
            or plan.budget == plan.cap
            or plan.num_reqs < 2
            or input_batch.num_reqs != plan.num_reqs
        ):
            return input_batch
        num_reqs = plan.num_reqs
        self.step_max_nodes = plan.cap
        buffers = runner.input_buffers
        req_states = runner.req_states
        trees_state = runner.speculator.trees
        assign_tree_nodes(
            trees_state.log_probs,
            input_batch.idx_mapping,
            runner.sampler.sampling_states.temperature.gpu,
            self.calibration,
            plan.cap,
            num_reqs * plan.budget,
            self.counts,
            buffers.query_start_loc,
            input_batch.cu_num_logits,
        )
        # MRv2's own writers again, over the new split.
        prepare_pos_seq_lens(
            input_batch.idx_mapping,
            input_batch.query_start_loc,
            req_states.num_computed_tokens.gpu,
            buffers.positions,
            buffers.seq_lens,
        )
        num_logits = num_reqs * (1 + plan.budget)
        input_batch.logits_indices = combine_sampled_and_draft_tokens(
            buffers.input_ids,
            input_batch.idx_mapping,
            req_states.last_sampled_tokens,
            input_batch.query_start_loc,
            input_batch.seq_lens,
            req_states.prefill_len.gpu,
            req_states.draft_tokens,
            input_batch.cu_num_logits,
            num_logits,
            runner.model_state.num_new_sampled_tokens_per_step,
        )
        input_batch.expanded_idx_mapping, input_batch.expanded_local_pos = (
            expand_idx_mapping(
                input_batch.idx_mapping,
                num_logits,
                input_batch.cu_num_logits,
                runner.decode_query_len,
            )
        )
        # A request may now verify up to the cap: the host's sequence-length
        # bound (the drafter's attention reads it) grows with it.
        input_batch.seq_lens_cpu_upper_bound[:num_reqs] += plan.cap - plan.budget
        return input_batch

    # -- after the step ----------------------------------------------------------

    def observe_walk(
        self,
        # [max_num_reqs, budget] float32, request-state order: the trees verified
        tree_log_probs: torch.Tensor,
        input_batch: InputBatch,
        # [max_num_reqs]
        temperature: torch.Tensor,
        # [num_reqs, depth] int32
        accepted_nodes: torch.Tensor,
        # [num_reqs] int32
        num_accepted: torch.Tensor,
    ) -> None:
        if self._skip_walk:
            self._skip_walk = False
            return
        self.calibration.update(
            tree_log_probs,
            input_batch.idx_mapping,
            temperature,
            input_batch.cu_num_logits,
            accepted_nodes,
            num_accepted,
        )

    def should_draft(self, num_reqs: int) -> bool:
        """Whether the drafter runs for the next step (the controller's call,
        for a batch of the same size)."""
        controller = self._controller()
        max_budget = self.slots[min(num_reqs, len(self.slots) - 1)]
        did = controller.should_draft(num_reqs, max_budget)
        if self.full_step_pending:
            # Even where the batch gets no slots (vLLM's warm-up decode step
            # schedules every request tree_budget placeholders regardless).
            did = True
        controller.drafted(did)
        self.drafted_last = did
        self._advice = (num_reqs, controller.last_best)
        return did

    def report(self) -> "BudgetReport | None":
        """What the scheduler learns from this step's output: the budget it
        verified (its spec-decode counters count that many nodes per request,
        not the slots it gave) and the budget the next step of this many
        requests is expected to take (its slots follow it). None before the
        first drafted step."""
        if self._advice is None:
            return None
        return BudgetReport(self._step_budget, *self._advice)

    def observe_trees(
        self,
        # [num_reqs, width] float32, batch order: the trees just built
        log_probs: torch.Tensor,
        # [max_num_reqs]
        temperature: torch.Tensor,
        # [num_reqs]
        idx_mapping: torch.Tensor,
    ) -> None:
        """Estimate what each ladder budget accepts for these trees and start
        the copy to the host."""
        if self.full_step_pending or self._plans <= self._warm_plan:
            return  # vLLM's warm-up: dummy prompts' trees
        num_reqs, width = log_probs.shape
        num_ladder = self._ladder_nodes.shape[1]
        expected_accepted_nodes(
            log_probs,
            temperature,
            idx_mapping,
            self.calibration,
            width,
            self._ladder_nodes[num_reqs],
            self._estimate[:num_ladder],
        )
        self._estimate[num_ladder:].copy_(self.calibration.totals)
        slot = self._slot
        ready = self._host_ready[slot]
        self._host[slot].copy_(self._estimate, non_blocking=ready is not None)
        if ready is not None:
            ready.record()
        self._host_reqs[slot] = num_reqs
        self._host_plan[slot] = self._plans
        self._host_pending[slot] = True
        self._slot = (slot + 1) % len(self._host)

    # -- helpers -----------------------------------------------------------------

    def _controller(self) -> TreeBudgetController:
        if self.controller is None:
            # Engines that never captured (eager) learn every period online.
            self.controller = self._new_controller({}, {})
            if self.tp_size > 1:
                # Ranks must choose alike, so timed periods are not learned
                # there, and the near-zero prior never pays for a tree.
                logger.warning(
                    "DDTree: the adaptive budget with tensor parallelism sizes "
                    "trees from the step times of CUDA graphs, and this engine "
                    "captured none: its steps will not speculate (drop "
                    "enforce_eager, or set adaptive_budget false)"
                )
        return self.controller

    def _new_controller(
        self,
        target: dict[int, float],
        drafter: dict[int, float],
        graphed: list[tuple[int, ...]] | None = None,
    ) -> TreeBudgetController:
        """A controller over these start-up times and the budgets each batch
        size replays a FULL graph for (:func:`_graphed_budgets`); without
        times (no graphs), a near-zero prior that the timed periods replace."""
        return TreeBudgetController(
            self.cfg.ladder,
            self.cfg.draft_depth,
            StepCostModel(
                target or {1: 1e-4},
                drafter or {1: 0.0},
                graphed_budgets=graphed if target else None,
            ),
            learn=self.tp_size == 1,
        )

    def _read_estimate(self, controller: TreeBudgetController) -> None:
        """The newest estimate whose copy has landed. With tensor parallelism
        every rank must choose alike: there, the newest copied before the
        step before this one began (its step is done, so the wait returns at
        once), however many steps ago the drafter last ran."""
        n = len(self._host)
        newest_first = [(self._slot - 1 - i) % n for i in range(n)]
        pending = [s for s in newest_first if self._host_pending[s]]
        if self.tp_size == 1:
            landed = (
                s
                for s in pending
                if self._host_ready[s] is None or self._host_ready[s].query()
            )
        else:
            landed = (s for s in pending if self._plans - self._host_plan[s] >= 2)
        slot = next(landed, None)
        if slot is None:
            return
        if self.tp_size > 1 and self._host_ready[slot] is not None:
            self._host_ready[slot].synchronize()
        # Read, and every older copy superseded.
        for s in pending[pending.index(slot) :]:
            self._host_pending[s] = False
        values = self._host[slot].tolist()
        num_reqs = self._host_reqs[slot]
        num_ladder = len(self.cfg.ladder)
        controller.update_curve(
            AcceptanceCurve(
                num_reqs,
                tuple(v / num_reqs for v in values[:num_ladder]),
                tuple(values[num_ladder:]),
            )
        )


def _dummy_draft_inputs(spec, desc) -> None:
    """The drafter's inputs as a step of ``desc``'s shape leaves them before
    its graph replays: a dummy batch in the drafter's input buffers and its
    attention metadata rebuilt, as ``propose`` does before every replay.
    Without it the attention builders' persistent buffers hold another
    shape's metadata, the likely reason why replays at 2 and 4 requests took
    seconds of GPU time each instead of a fraction of a millisecond."""
    num_reqs = desc.num_reqs or desc.num_tokens // spec.num_query_per_req
    InputBatch.make_dummy(num_reqs, desc.num_tokens, spec.input_buffers)
    spec.block_tables.get_dummy_slot_mappings(desc.num_tokens)
    spec._build_draft_attn_metadata(
        num_reqs=num_reqs,
        num_reqs_padded=num_reqs,
        num_tokens_padded=desc.num_tokens,
        causal=spec._group_causal,
    )


def _graphed_budgets(
    manager, ladder: tuple[int, ...], max_num_reqs: int
) -> list[tuple[int, ...]] | None:
    """Per number of requests n (the index), the ladder budgets b whose
    uniform decode step (n requests of 1 + b tokens) the runner replays from a
    FULL CUDA graph, asked of its own dispatch: the capture sizes decide,
    including ones a user set, and a count between them pads up to one.
    None without a manager."""
    if manager is None:
        return None
    return [()] + [
        tuple(
            b
            for b in ladder
            if manager.dispatch(n, n * (1 + b), 1 + b, 0).cg_mode == CUDAGraphMode.FULL
        )
        for n in range(1, max_num_reqs + 1)
    ]


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _profiled_graphs(manager, keep=None) -> list:
    """The FULL graphs of a MRv2 graph manager that the profile times: one
    per token count (``keep(num_tokens)``, if given, picks the counts), the
    one of fewest requests. The cost model keys times by token count, and a
    count's graphs differ only in how its tokens split into requests (an
    adaptive engine captures a uniform decode graph per ladder budget that
    divides the count: about five per count, each a full forward)."""
    chosen = {}
    for desc in manager.graphs:
        if desc.cg_mode != CUDAGraphMode.FULL:
            continue
        if keep is not None and not keep(desc.num_tokens):
            continue
        best = chosen.get(desc.num_tokens)
        if best is None or (desc.num_reqs or 0) < (best.num_reqs or 0):
            chosen[desc.num_tokens] = desc
    return list(chosen.values())


def _time_graphs(manager, prepare=None, keep=None) -> tuple[dict[int, float], float]:
    """Seconds per replay of a MRv2 graph manager's FULL graphs, by token
    count (:func:`_profiled_graphs`): the fastest replay of each count's
    graph (a lower bound of a step's cost, whatever else the GPU did
    meanwhile), and the GPU seconds of all replays. ``prepare(desc)`` fills
    the graph's input buffers first. The replays are queued with an event
    pair each and read after one sync at the end."""
    if manager is None:
        return {}, 0.0
    timed = []
    for desc in _profiled_graphs(manager, keep):
        if prepare is not None:
            prepare(desc)
        # The first replay warms up; it is timed only for the GPU total.
        for replay in range(1 + _PROFILE_REPLAYS):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            manager.run_fullgraph(desc)
            end.record()
            timed.append((desc.num_tokens, replay > 0, start, end))
    torch.cuda.synchronize()
    times: dict[int, float] = {}
    gpu_seconds = 0.0
    for num_tokens, counts, start, end in timed:
        seconds = start.elapsed_time(end) / 1000
        gpu_seconds += seconds
        if counts:
            times[num_tokens] = min(times.get(num_tokens, seconds), seconds)
    return times, gpu_seconds


def _slower_than_larger(times: dict[int, float]) -> list[int]:
    """The keys of ``times`` timed at least ``_SLOW_FACTOR`` x some larger
    key's time."""
    bound = _never_faster_when_larger(times)
    return sorted(n for n, t in times.items() if t >= _SLOW_FACTOR * bound[n])


def _never_faster_when_larger(times: dict[int, float]) -> dict[int, float]:
    """``times`` with each value at most every value of a larger key: a
    larger batch never runs faster, so a smaller one timed slower was timed
    over something else (and would keep its shapes from being tried)."""
    out: dict[int, float] = {}
    least = float("inf")
    for key in sorted(times, reverse=True):
        least = min(least, times[key])
        out[key] = least
    return out


def _time_range(times: dict[int, float], unit: str) -> str:
    if not times:
        return "none"
    lo, hi = min(times), max(times)
    return (
        f"{1e3 * times[lo]:.2f} ms at {lo} to {1e3 * times[hi]:.2f} ms at {hi} {unit}"
    )
