# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""DDTree speculator for Model Runner V2: DFlash drafts, a best-first tree is kept.

DDTree (Ringel & Romano, "Accelerating Speculative Decoding with Block Diffusion
Draft Trees", 2026) runs vLLM's DFlash block-diffusion drafter once per step, with
its real block size (``depth = block_size - 1`` draft positions), keeps the
per-position logits ``[num_reqs, depth, vocab]`` instead of collapsing them to a
greedy chain, and builds the ``tree_budget`` most probable prefixes per request
(:func:`build_ddtree`). The tree goes to the scheduler as ``tree_budget`` draft
tokens in node order, parents before children, so any prefix the scheduler keeps
is still a tree.

The speculator owns the per-request trees (:class:`DraftTrees`, reset in
:meth:`DDTreeSpeculator.add_request`) and their verification. One step, as the
model runner drives it:

1. Step N: ``DDTreeModelState.prepare_attn`` (``ddtree_verify.py``) writes tree
   positions and masks from the trees, the target verifies them with TREE_ATTN,
   and the speculator's :class:`TreeRejectionSampler`
   (:meth:`DDTreeSpeculator.init_rejection_sampler`) walks them; its output
   (:class:`TreeSamplerOutput`: the accepted paths) is the step's sampler output.
2. ``propose(..., sampler_output=...)`` (end of step N) takes that output: it
   moves the accepted path's KV into place (:meth:`compact_verified_kv`),
   extends the drafter's context with the rows step N committed (root and
   accepted path, :func:`prepare_draft_inputs`), runs the drafter on ``[bonus,
   mask x depth]`` per request (in a CUDA graph for uniform batches), builds its
   logits into trees inside the same graph and stores them per request for
   step N + 1.

Nothing here reads GPU data on the host.
"""

import copy
from typing import Any

import torch

from vllm.config import SpeculativeConfig, VllmConfig
from vllm.config.compilation import CUDAGraphMode
from vllm.v1.attention.backends.tree_attn import kv_cache_as_kv_first
from vllm.v1.attention.ops.tree_kv_compaction import TreeKVCompactor
from vllm.v1.attention.ops.tree_mask import num_mask_words
from vllm.v1.core.sched.output import NewRequestData
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.sample.tree_rejection_sampler import (
    TreeRejectionSampler,
    TreeSamplerOutput,
)
from vllm.v1.spec_decode.ddtree_adaptive import AdaptiveTreeBudget
from vllm.v1.spec_decode.ddtree_config import DDTreeConfig
from vllm.v1.spec_decode.ddtree_inputs import (
    draft_context_size,
    draft_path_len,
    prepare_draft_inputs,
    store_draft_trees,
)
from vllm.v1.spec_decode.ddtree_verify import DDTreeModelState, tree_attention_groups
from vllm.v1.spec_decode.dflash_tree_builder import DDTree, build_ddtree
from vllm.v1.worker.gpu.block_table import BlockTables
from vllm.v1.worker.gpu.input_batch import InputBatch, InputBuffers
from vllm.v1.worker.gpu.model_states.interface import ModelState
from vllm.v1.worker.gpu.sample.output import SamplerOutput
from vllm.v1.worker.gpu.sample.sampler import Sampler
from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator
from vllm.v1.worker.utils import AttentionGroup


class DraftTrees:
    """Trees of up to ``max_num_reqs`` request slots in :class:`DDTree` layout.

    Per-request state with MRv2's ``RequestState`` life cycle: read through
    ``idx_mapping``, written by the speculator for the requests it drafted for,
    and reset when a request is added to a slot (:meth:`reset_`), so that a slot
    never shows a tree that was not drafted for its request. A reset slot holds
    padding nodes only (token -1), which verify as a root-only tree.
    """

    def __init__(self, max_num_reqs: int, budget: int, device: torch.device):
        trees = DDTree.empty(max_num_reqs, budget, device)
        # [max_num_reqs, budget] int64; -1 on padding nodes.
        self.token_ids = trees.token_ids.fill_(-1)
        # [max_num_reqs, budget] int32; 0 = root.
        self.parent_ids = trees.parent_ids.zero_()
        # [max_num_reqs, budget] int32; 1..depth, 0 on padding nodes.
        self.depths = trees.depths.zero_()
        # [max_num_reqs, budget + 1, num_words] int32 ancestor-or-self masks.
        self.attn_mask = trees.attn_mask.zero_()
        # [max_num_reqs, budget] float32 node log-probs; -inf on padding nodes.
        self.log_probs = trees.log_probs.fill_(float("-inf"))

    def reset_(self, req_index: int) -> None:
        """No tree drafted for the request in slot ``req_index`` yet."""
        self.token_ids[req_index].fill_(-1)
        self.log_probs[req_index].fill_(float("-inf"))

    def scatter_(
        self,
        # [num_reqs] row of each source row
        idx_mapping: torch.Tensor,
        src: DDTree,
        num_reqs: int,
        # [>= num_reqs, budget] int64: also written, src's tokens clamped at 0
        draft_tokens: torch.Tensor,
    ) -> None:
        """``self[idx_mapping[r]] <- src[r]`` for r < num_reqs, and the draft
        tokens MRv2 schedules (:func:`store_draft_trees`, one launch); a tree of
        fewer nodes than the rows hold is padded."""
        store_draft_trees(
            self.token_ids,
            self.parent_ids,
            self.depths,
            self.log_probs,
            self.attn_mask,
            draft_tokens,
            src.token_ids,
            src.parent_ids,
            src.depths,
            src.log_probs,
            src.attn_mask,
            idx_mapping,
            num_reqs,
        )


def fixed_draft_len_config(vllm_config: VllmConfig) -> VllmConfig:
    """``vllm_config`` as the drafter's CUDA graphs must see it.

    With a budget per batch size (``tree_budget_per_batch_size`` or ``"auto"``,
    vLLM's dynamic speculative decoding) vLLM's graph manager plans one decode
    query length per scheduled draft count, ``count + decode_query_len - max
    count``: right for a chain drafter, whose block grows with the count, wrong
    for DDTree's, which runs ``depth + 1`` tokens per request whatever budget the
    scheduler keeps (zero or negative for budgets below ``max budget - depth``,
    which fails the capture). The drafter's graphs are planned from a shallow copy
    without the schedule; the engine's config keeps it.
    """
    spec = vllm_config.speculative_config
    if spec is None or not spec.uses_dynamic_speculative_decoding():
        return vllm_config
    spec = copy.copy(spec)
    spec.num_speculative_tokens_per_batch_size = None
    fixed = copy.copy(vllm_config)
    fixed.speculative_config = spec
    return fixed


# The drafter's context concatenates the target's aux layers over every row of
# the step (one launch fewer per layer) while the rows it then drops cost at most
# this many bytes, a few microseconds of HBM traffic; beyond, per-layer gathers
# first.
_CONCAT_ALL_ROWS_BYTES = 8 << 20


class DDTreeSpeculator(DFlashSpeculator):
    """DFlash's drafter and CUDA graphs, drafting trees instead of chains, and
    the trees' verification.

    vLLM's ``num_speculative_tokens`` is the tree budget B (the scheduler's draft
    slots per request); the drafter runs its own block of ``depth + 1`` tokens per
    request whatever B is. The speculator owns the trees (:attr:`trees`), builds
    the sampler that walks them (:meth:`init_rejection_sampler`) and takes the
    walk's result back in :meth:`propose`.
    """

    _speculator_name = "DDTree"

    def __init__(self, vllm_config: VllmConfig, device: torch.device):
        cfg = DDTreeConfig.from_vllm_config(vllm_config)
        assert cfg is not None, "DDTreeSpeculator needs a DDTree engine config"
        super().__init__(vllm_config, device)
        self.cfg = cfg
        self.tree_budget = cfg.tree_budget
        self.draft_depth = cfg.draft_depth
        # DFlash sized its query block and sampling rows by num_speculative_tokens
        # (= B here); the drafter's block is depth + 1 tokens.
        self.num_query_per_req = cfg.draft_len
        self.sample_indices = torch.zeros(
            self.max_num_reqs * self.draft_depth, dtype=torch.int64, device=device
        )
        # Drafter context entries (prepare_draft_inputs): the step's non-draft
        # rows plus depth path entries per request. DFlash's full-width copy of
        # the target's hidden states is not needed.
        self.max_num_context = (
            self.max_num_tokens + self.draft_depth * self.max_num_reqs
        )
        self.context_rows = torch.zeros(
            self.max_num_context, dtype=torch.int64, device=device
        )
        self.context_positions = torch.zeros_like(self.context_rows)
        self.hidden_states = None
        # The trees the next step verifies, one per request slot (MRv2's
        # RequestState life cycle: add_request resets a slot).
        self.trees = DraftTrees(self.max_num_reqs, cfg.tree_budget, device)
        # Trees of the drafter's last run, batch order (CUDA graph outputs):
        # flat storage, viewed as [num_reqs, width] trees of the width built
        # for the batch (_build_width).
        self._tree_storage = DDTree.empty(self.max_num_reqs, self.tree_budget, device)
        # Adaptive budgets: the batch-wide budget of every step (None: every
        # step verifies the scheduler's draft slots).
        self.adaptive = (
            AdaptiveTreeBudget(cfg, vllm_config, self.max_num_reqs, device)
            if cfg.adaptive
            else None
        )
        # Walk result for steps that verified no tree: k = 0 everywhere.
        self._no_accepted_nodes = torch.zeros(
            self.max_num_reqs, self.draft_depth, dtype=torch.int32, device=device
        )
        self._no_num_accepted = torch.zeros(
            self.max_num_reqs, dtype=torch.int32, device=device
        )
        # The target's TREE_ATTN groups (set_attn) and their KV compactors
        # (_get_compactors).
        self._tree_groups: list[AttentionGroup] = []
        self._compactors: dict[int, tuple[str, TreeKVCompactor]] | None = None

    def add_request(self, req_index: int, new_req_data: NewRequestData) -> None:
        """A request joined slot ``req_index``: no tree drafted for it yet.

        As MRv2's ``RequestState.add_request`` zeroes the slot's draft tokens, so
        a request that joins with placeholder drafts verifies as a root-only
        tree, never the tree a previous request left in the slot."""
        self.trees.reset_(req_index)

    def init_rejection_sampler(
        self,
        sampler: Sampler,
        speculative_config: SpeculativeConfig,
        device: torch.device,
    ) -> TreeRejectionSampler:
        """The verifier of this speculator's drafts, in MRv2's rejection-sampler
        slot: the lossless walk over :attr:`trees`, read in place per request."""
        return TreeRejectionSampler(
            sampler, self.draft_depth, self.trees.token_ids, self.trees.parent_ids
        )

    def init_cudagraph_manager(self, cudagraph_mode: CUDAGraphMode) -> None:
        # DFlash's choice of the drafter's graph mode, with its graphs planned
        # for the one block length (fixed_draft_len_config).
        full_config = self.vllm_config
        self.vllm_config = fixed_draft_len_config(full_config)
        try:
            super().init_cudagraph_manager(cudagraph_mode)
        finally:
            self.vllm_config = full_config

    def set_attn(
        self,
        model_state: ModelState,
        kv_cache_config: KVCacheConfig,
        block_tables: BlockTables,
        target_input_buffers: InputBuffers,
        target_attn_groups: list[list[AttentionGroup]],
    ) -> None:
        super().set_attn(
            model_state,
            kv_cache_config,
            block_tables,
            target_input_buffers,
            target_attn_groups,
        )
        self._context_slot_mappings = torch.zeros(
            len(self.draft_kv_cache_group_ids),
            self.max_num_context,
            dtype=torch.int64,
            device=self.device,
        )
        if not isinstance(model_state, DDTreeModelState):
            raise TypeError(
                "DDTreeSpeculator needs the target's DDTreeModelState, got "
                f"{type(model_state).__name__}"
            )
        # The target step writes tree positions and masks from these trees,
        # and leaves the drafter's own attention groups out.
        model_state.set_draft_trees(self.trees, self.draft_attn_layer_names)
        self._tree_groups = tree_attention_groups(target_attn_groups)
        self._compactors = None

    def _generate_draft(
        self,
        num_reqs: int,
        num_tokens_padded: int,
        attn_metadata: dict[str, Any] | None,
        slot_mappings: dict[str, torch.Tensor] | None,
        num_tokens_across_dp: torch.Tensor | None,
        cudagraph_runtime_mode: CUDAGraphMode = CUDAGraphMode.NONE,
    ) -> None:
        last_hidden_states = self._run_model(
            num_tokens_padded,
            attn_metadata,
            slot_mappings,
            num_tokens_across_dp,
            cudagraph_runtime_mode,
        )
        num_sample = num_reqs * self.draft_depth
        # [num_reqs * depth, vocab_size]
        logits = self.model.compute_logits(
            last_hidden_states[self.sample_indices[:num_sample]]
        )
        width = self._build_width(num_tokens_padded)
        # [num_reqs, depth, vocab_size] (rows may be strided: vocab padding cut)
        build_ddtree(
            logits.unflatten(0, (num_reqs, self.draft_depth)),
            width,
            out=self._batch_trees(num_reqs, width),
        )

    @torch.inference_mode()
    def propose(
        self,
        input_batch: InputBatch,
        attn_metadata: dict[str, Any],
        slot_mappings: dict[str, torch.Tensor],
        # [num_tokens, hidden_size]
        last_hidden_states: torch.Tensor,
        # num_layers x [num_tokens, hidden_size]
        aux_hidden_states: list[torch.Tensor] | None,
        # [num_reqs]
        num_sampled: torch.Tensor,
        # [num_reqs]
        num_rejected: torch.Tensor,
        # [max_num_reqs]
        last_sampled: torch.Tensor,
        # [max_num_reqs]
        next_prefill_tokens: torch.Tensor,
        # [max_num_reqs]
        temperature: torch.Tensor,
        # [max_num_reqs]
        seeds: torch.Tensor,
        num_tokens_across_dp: torch.Tensor | None = None,
        dummy_run: bool = False,
        skip_attn_for_dummy_run: bool = False,
        mm_inputs: tuple[list[torch.Tensor], torch.Tensor] | None = None,
        is_profile: bool = False,
        sampler_output: SamplerOutput | None = None,
    ) -> torch.Tensor:
        """Draft one tree per request; returns ``[num_reqs, tree_budget]`` draft
        tokens in node order (padding nodes as token 0, never accepted).

        ``sampler_output`` is the step's: a :class:`TreeSamplerOutput` when the
        step verified trees (its accepted paths are compacted in the KV cache
        and start the drafter's context), a plain ``SamplerOutput`` or None when
        it verified none (dummy runs, steps without drafts).

        DFlash's steps, with what is DDTree's around them: the walk, the
        drafter's context from it (:meth:`_prepare_draft_context`), DFlash's
        forward (``_run_drafter``; its graph body, :meth:`_generate_draft`,
        builds the trees), and the trees stored per request. DFlash's draft
        sampling inputs (temperature, seeds) are not copied: trees are built
        from the logits, not sampled."""
        walk = sampler_output if isinstance(sampler_output, TreeSamplerOutput) else None
        if walk is not None:
            # First: ``slot_mappings`` are views of the block tables' buffer,
            # which the drafter's inputs overwrite below.
            self.compact_verified_kv(input_batch, slot_mappings, walk)
            if self.adaptive is not None:
                # Before the trees verified are replaced by the next ones.
                self.adaptive.observe_walk(
                    self.trees.log_probs,
                    input_batch,
                    temperature,
                    walk.accepted_nodes,
                    walk.num_accepted,
                )
        num_reqs = input_batch.num_reqs
        # Adaptive budgets: the drafter runs only when the next step is
        # expected to verify a tree (its context is kept up to date anyway).
        draft = (
            dummy_run or self.adaptive is None or self.adaptive.should_draft(num_reqs)
        )
        self._prepare_draft_context(
            input_batch,
            last_hidden_states,
            aux_hidden_states,
            num_sampled,
            num_rejected,
            last_sampled,
            next_prefill_tokens,
            dummy_run,
            skip_attn_for_dummy_run,
            walk=walk,
        )
        if not draft:
            # The next step verifies no tree (the budget's choice).
            return self.draft_tokens[:num_reqs]

        num_tokens_padded = self._run_drafter(
            input_batch,
            num_tokens_across_dp,
            is_profile,
            skip_attn=dummy_run and skip_attn_for_dummy_run,
        )
        trees = self._batch_trees(num_reqs, self._build_width(num_tokens_padded))
        if dummy_run:
            return self._draft_tokens(trees)
        self.trees.scatter_(input_batch.idx_mapping, trees, num_reqs, self.draft_tokens)
        if self.adaptive is not None:
            self.adaptive.observe_trees(
                trees.log_probs, temperature, input_batch.idx_mapping
            )
        return self.draft_tokens[:num_reqs]

    def _prepare_draft_context(
        self,
        input_batch: InputBatch,
        # [num_tokens, hidden_size]
        last_hidden_states: torch.Tensor,
        # num_layers x [num_tokens, hidden_size]
        aux_hidden_states: list[torch.Tensor] | None,
        # [num_reqs]
        num_sampled: torch.Tensor,
        # [num_reqs]
        num_rejected: torch.Tensor,
        # [max_num_reqs]
        last_sampled: torch.Tensor,
        # [max_num_reqs]
        next_prefill_tokens: torch.Tensor,
        dummy_run: bool,
        skip_attn_for_dummy_run: bool,
        walk: TreeSamplerOutput | None = None,
    ) -> None:
        """DFlash's step with DDTree's context: per request the rows the step
        committed, its root and the accepted path of its tree (``walk``; none
        when nothing was verified), plus a prefill chunk's rows
        (:func:`prepare_draft_inputs`), instead of every row of the target's
        step. ``num_rejected`` is not read: the walk says which rows count."""
        if dummy_run and skip_attn_for_dummy_run:
            # Memory profiling: block tables and KV caches do not exist yet.
            num_tokens = input_batch.num_tokens
            context = self._context_hidden_states(
                last_hidden_states, aux_hidden_states, None, num_tokens
            )
            self._store_context_kv(context, dummy_run=True)
            return
        path_len = draft_path_len(self.draft_depth, self._max_tree_nodes(walk))
        num_context = draft_context_size(
            input_batch.num_tokens,
            input_batch.num_draft_tokens,
            input_batch.num_reqs,
            path_len,
        )
        self._prepare_inputs(
            input_batch, num_sampled, last_sampled, next_prefill_tokens, walk, path_len
        )
        context = self._context_hidden_states(
            last_hidden_states, aux_hidden_states, self.context_rows, num_context
        )
        # Dummy runs hold placeholder block tables: compute, but write no KV.
        self._store_context_kv(context, dummy_run)

    def compact_verified_kv(
        self,
        input_batch: InputBatch,
        # layer name -> [num_tokens] the verify step's KV slots (MRv2's
        # slot mappings by layer, as the model runner passes them to propose)
        slot_mappings: dict[str, torch.Tensor],
        walk: TreeSamplerOutput,
    ) -> None:
        """Move each accepted node's KV to slot ``p0 + depth`` in every
        TREE_ATTN layer (one launch per KV-cache group), in the step that
        committed it, before prefix caching can hash those blocks."""
        num_reqs = input_batch.num_reqs
        query_start_loc = input_batch.query_start_loc[: num_reqs + 1]
        cu_num_logits = input_batch.cu_num_logits[: num_reqs + 1]
        for layer_name, compactor in self._get_compactors().values():
            compactor(
                slot_mappings[layer_name],
                query_start_loc,
                walk.accepted_nodes,
                walk.num_accepted,
                cu_num_logits,
            )

    def _get_compactors(self) -> dict[int, tuple[str, TreeKVCompactor]]:
        """Per KV-cache group id: a TREE_ATTN layer of the group (whose slot
        mapping is the group's) and the compactor over the group's TREE_ATTN
        layers. Built on first use: the KV caches exist only after MRv2's KV
        init, which runs after ``set_attn``."""
        if self._compactors is None:
            layers = self.vllm_config.compilation_config.static_forward_context
            groups: dict[int, tuple[str, list[torch.Tensor]]] = {}
            for group in self._tree_groups:
                head_size = group.kv_cache_spec.head_size
                _, caches = groups.setdefault(
                    group.kv_cache_group_id, (group.layer_names[0], [])
                )
                caches.extend(
                    kv_cache_as_kv_first(layers[name].kv_cache, head_size)
                    for name in group.layer_names
                )
            self._compactors = {
                gid: (layer_name, TreeKVCompactor(caches))
                for gid, (layer_name, caches) in groups.items()
            }
        return self._compactors

    def _build_width(self, num_query_tokens: int) -> int:
        """Nodes the drafter builds per request for a drafter batch of
        ``num_query_tokens`` (its CUDA graph's size): with adaptive budgets,
        the most the scheduler lets a request of such a batch verify."""
        if self.adaptive is None:
            return self.tree_budget
        num_reqs = min(num_query_tokens // self.num_query_per_req, self.max_num_reqs)
        return max(1, self.adaptive.slots[max(num_reqs, 1)])

    def _batch_trees(self, num_reqs: int, width: int) -> DDTree:
        """The first ``num_reqs`` trees of ``width`` nodes in the drafter's
        flat output storage (contiguous rows, as the builder writes them)."""
        flat = self._tree_storage
        words = num_mask_words(width)

        def rows(t: torch.Tensor, *shape: int) -> torch.Tensor:
            n = num_reqs
            for d in shape:
                n *= d
            return t.view(-1)[:n].view(num_reqs, *shape)

        return DDTree(
            token_ids=rows(flat.token_ids, width),
            parent_ids=rows(flat.parent_ids, width),
            depths=rows(flat.depths, width),
            attn_mask=rows(flat.attn_mask, width + 1, words),
            num_nodes=flat.num_nodes[:num_reqs],
            log_probs=rows(flat.log_probs, width),
        )

    def _max_tree_nodes(self, walk: TreeSamplerOutput | None) -> int:
        """The most nodes a request's tree had in the step just verified (an
        upper bound known on the host): none without a walk; the adaptive
        budget's bound for its step; else the scheduler's slots."""
        if walk is None:
            return 0
        if self.adaptive is not None:
            return self.adaptive.step_max_nodes
        return self.tree_budget

    def _prepare_inputs(
        self,
        input_batch: InputBatch,
        num_sampled: torch.Tensor,
        last_sampled: torch.Tensor,
        next_prefill_tokens: torch.Tensor,
        walk: TreeSamplerOutput | None,
        path_len: int,
    ) -> None:
        accepted_nodes, num_accepted = self._accepted_paths(input_batch, walk)
        for i, gid in enumerate(self.draft_kv_cache_group_ids):
            prepare_draft_inputs(
                self.input_buffers.input_ids,
                self.input_buffers.positions,
                self.input_buffers.query_start_loc,
                self.input_buffers.seq_lens,
                self.block_tables.slot_mappings[gid],
                self.context_rows,
                self.context_positions,
                self._context_slot_mappings[i],
                self.sample_indices,
                input_batch.positions,
                input_batch.query_start_loc,
                input_batch.cu_num_logits,
                input_batch.idx_mapping,
                num_sampled,
                last_sampled,
                next_prefill_tokens,
                accepted_nodes,
                num_accepted,
                self.block_tables.input_block_tables[gid],
                self.block_tables.kernel_block_sizes[gid],
                self.parallel_drafting_token_id,
                self.draft_depth,
                self.max_num_reqs,
                self.max_num_tokens,
                self.max_model_len,
                path_len=path_len,
            )

    def _accepted_paths(
        self, input_batch: InputBatch, walk: TreeSamplerOutput | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This step's walk result; zeros when nothing was verified (the writer
        reads it only for requests that verified a tree)."""
        if walk is not None:
            return walk.accepted_nodes, walk.num_accepted
        num_reqs = input_batch.num_reqs
        return self._no_accepted_nodes[:num_reqs], self._no_num_accepted[:num_reqs]

    def _context_hidden_states(
        self,
        # [num_tokens, hidden_size]
        last_hidden_states: torch.Tensor,
        # num_layers x [num_tokens, hidden_size]
        aux_hidden_states: list[torch.Tensor] | None,
        # [>= num_context] target rows, or None for the first num_context rows
        rows: torch.Tensor | None,
        num_context: int,
    ) -> torch.Tensor:
        """The drafter's context features of the selected target rows."""
        if rows is not None:
            rows = rows[:num_context]
            pick = lambda x: x[rows]  # noqa: E731
        else:
            pick = lambda x: x[:num_context]  # noqa: E731
        if not aux_hidden_states:
            return pick(last_hidden_states)
        extra_rows = aux_hidden_states[0].shape[0] - num_context
        row_bytes = sum(x.shape[-1] * x.element_size() for x in aux_hidden_states)
        if extra_rows * row_bytes <= _CONCAT_ALL_ROWS_BYTES:
            # Small steps are host-bound: one concatenation and one gather (two
            # launches) instead of a gather per layer and a concatenation.
            features = pick(torch.cat(aux_hidden_states, dim=-1))
        else:
            # Large trees: the tree rows that are not context would dominate.
            features = torch.cat([pick(x) for x in aux_hidden_states], dim=-1)
        return self.model.combine_hidden_states(features)

    def _draft_tokens(self, trees: DDTree) -> torch.Tensor:
        # Padding nodes (-1) still enter the target batch; any valid id will do.
        num_reqs, width = trees.token_ids.shape
        out = self.draft_tokens[:num_reqs]
        out[:, width:].zero_()
        torch.clamp(trees.token_ids, min=0, out=out[:, :width])
        return out
