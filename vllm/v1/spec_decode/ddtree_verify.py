# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The target's side of DDTree verification on Model Runner V2: tree inputs
for attention.

The target verifies each decoding request's tree ``[root, node_1..node_b]`` in one
forward. :meth:`DDTreeModelState.prepare_attn` runs after MRv2 computed positions
and KV slots (slots follow the flattened index): it writes tree positions and
ancestor masks in place into persistent buffers (:func:`write_tree_verify_inputs`),
which TREE_ATTN's metadata builders were handed once, then builds the usual
metadata. Under CUDA graphs the captured forward reads the same buffers.

The trees, their walk and the accepted path's KV compaction belong to the
speculator (``DDTreeSpeculator`` in ``ddtree.py``), which hands this model state
its trees in ``set_attn``.
"""

import time
from typing import TYPE_CHECKING, Any

import torch

from vllm.config import VllmConfig
from vllm.config.compilation import CUDAGraphMode
from vllm.logger import init_logger
from vllm.triton_utils.parallel_compile import compile_in_parallel
from vllm.v1.attention.backends.tree_attn import (
    TREE_ATTN_NAME,
    TreeAttentionBackend,
    TreeAttentionInputs,
    TreeAttentionMetadataBuilder,
    split_kv_cache,
)
from vllm.v1.attention.ops.triton_tree_attention import (
    num_sms,
    tree_attention_variants,
    warm_up_tree_attention,
)
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.spec_decode.ddtree_config import DDTreeConfig, check_warmup_budget
from vllm.v1.spec_decode.ddtree_inputs import write_tree_verify_inputs
from vllm.v1.worker.gpu.block_table import BlockTables
from vllm.v1.worker.gpu.input_batch import InputBatch
from vllm.v1.worker.gpu.mm.encoder_cache import EncoderCache
from vllm.v1.worker.gpu.model_states.default import DefaultModelState
from vllm.v1.worker.utils import AttentionGroup

if TYPE_CHECKING:
    from vllm.v1.spec_decode.ddtree import DraftTrees

logger = init_logger(__name__)


def tree_attention_groups(
    attn_groups: list[list[AttentionGroup]],
) -> list[AttentionGroup]:
    """The TREE_ATTN groups among the model runner's attention groups."""
    return [
        group
        for groups in attn_groups
        for group in groups
        if issubclass(group.backend, TreeAttentionBackend)
    ]


class DDTreeModelState(DefaultModelState):
    """``DefaultModelState`` plus TREE_ATTN's tree inputs.

    Owns TREE_ATTN's persistent :class:`TreeAttentionInputs`, written each step
    from the speculator's trees (:meth:`set_draft_trees`).
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        model: torch.nn.Module,
        encoder_cache: EncoderCache | None,
        device: torch.device,
    ):
        super().__init__(vllm_config, model, encoder_cache, device)
        cfg = DDTreeConfig.from_vllm_config(vllm_config)
        assert cfg is not None, "DDTreeModelState needs a DDTree engine config"
        self.tree_budget = cfg.tree_budget
        self.tree_inputs = TreeAttentionInputs.allocate(
            self.max_num_reqs, cfg.tree_budget, device
        )
        self._tree_groups: list[AttentionGroup] | None = None
        # Whether is_tree is known to be all zero (only prepare_attn writes it
        # in a step; unknown at first).
        self._is_tree_clear = False
        # The speculator's trees and its drafter's attention layers
        # (set_draft_trees), and the model runner's attention groups without
        # the drafter's, built once.
        self._trees: DraftTrees | None = None
        self._draft_layers: frozenset[str] = frozenset()
        self._target_groups: tuple[list, list[list[AttentionGroup]]] | None = None

    def set_draft_trees(self, trees: "DraftTrees", draft_layer_names: set[str]) -> None:
        """The speculator's per-request trees, which each step's tree inputs
        are written from, and its drafter's attention layers (from the
        speculator's ``set_attn``).

        The model runner's attention groups hold every layer, the drafter's too.
        Under DFlash the drafter shares the target's FLASH_ATTN group, so its
        layers cost nothing extra; under DDTree they form a FLASH_ATTN group of
        their own next to the target's TREE_ATTN group, and building its
        metadata in every target step is wasted: the drafter builds its own in
        ``propose``. ``prepare_attn`` leaves such groups out.
        """
        self._trees = trees
        self._draft_layers = frozenset(draft_layer_names)
        self._target_groups = None

    def prepare_attn(
        self,
        input_batch: InputBatch,
        cudagraph_mode: CUDAGraphMode,
        block_tables: tuple[torch.Tensor, ...],
        slot_mappings: torch.Tensor,
        attn_groups: list[list[AttentionGroup]],
        kv_cache_config: KVCacheConfig,
        for_capture: bool = False,
    ) -> dict[str, Any]:
        self._bind_tree_inputs(attn_groups)
        attn_groups = self._without_draft_groups(attn_groups)
        inputs = self.tree_inputs
        has_trees = not for_capture and input_batch.num_draft_tokens > 0
        if has_trees:
            trees = self._trees
            assert trees is not None, "the speculator's set_attn hands the trees"
            write_tree_verify_inputs(
                input_batch.positions,
                inputs.attn_mask,
                inputs.is_tree,
                trees.token_ids,
                trees.depths,
                trees.attn_mask,
                input_batch.idx_mapping,
                input_batch.query_start_loc,
                input_batch.cu_num_logits,
                input_batch.num_reqs_after_padding,
            )
            self._is_tree_clear = False
        elif not self._is_tree_clear:
            # No tree rows: every row is causal. Cleared once after a tree
            # step, not in every plain step of a run.
            inputs.is_tree.zero_()
            self._is_tree_clear = True
        # A capture or a full-graph replay keeps the tree path whatever this
        # step holds; an eager or piecewise step without drafts may run
        # FlashAttention over the whole batch (TREE_ATTN's builder decides).
        inputs.has_tree_rows = (
            has_trees or for_capture or cudagraph_mode == CUDAGraphMode.FULL
        )
        return super().prepare_attn(
            input_batch,
            cudagraph_mode,
            block_tables,
            slot_mappings,
            attn_groups,
            kv_cache_config,
            for_capture,
        )

    @torch.inference_mode()
    def warm_up_tree_attention(
        self,
        block_tables: BlockTables,
        attn_groups: list[list[AttentionGroup]],
    ) -> int:
        """Compile every TREE_ATTN variant a step of this engine can pick.

        CUDA-graph capture compiles the variants of uniform tree batches only;
        a step run outside the graphs (a prompt next to trees, a prefix-cache
        hit's short remainder, a batch size off the capture ladder) picks its
        tile shape and split count from its own sizes, and a variant met there
        first would compile inside a user's step. Called once the KV caches
        exist (the model runner's ``initialize_kv_cache``, in every CUDA-graph
        mode), with the real KV caches and tree buffers; the variants compile
        on a thread pool first (:func:`compile_in_parallel`). Returns the
        kernel launches."""
        # vLLM's own warm-up runs next; with --max-model-len -1 the length it
        # runs under was fitted to GPU memory after the budget was checked.
        check_warmup_budget(self.tree_budget, self.vllm_config.model_config)
        self._bind_tree_inputs(attn_groups)
        assert self._tree_groups is not None
        start = time.perf_counter()
        launches = compile_in_parallel(
            lambda: self._warm_up_tree_attention(block_tables)
        )
        logger.info(
            "DDTree: TREE_ATTN warmed up over %d kernel variants in %.1f s",
            launches,
            time.perf_counter() - start,
        )
        return launches

    def _warm_up_tree_attention(self, block_tables: BlockTables) -> int:
        """:meth:`warm_up_tree_attention`'s launches; returns their count."""
        assert self._tree_groups is not None
        layers = self.vllm_config.compilation_config.static_forward_context
        sched = self.vllm_config.scheduler_config
        launches, seen = 0, set()
        for group in self._tree_groups:
            for name in group.layer_names:
                layer = layers[name]
                impl = layer.impl
                kv_cache = layer.kv_cache
                table = block_tables.block_tables[group.kv_cache_group_id].gpu
                key = (
                    impl.num_heads,
                    impl.num_kv_heads,
                    impl.head_size,
                    kv_cache.dtype,
                    kv_cache.stride(),
                    table.shape[1],
                )
                if key in seen:
                    continue
                seen.add(key)
                key_cache, value_cache = split_kv_cache(kv_cache, impl.head_size)
                device = kv_cache.device
                variants = tree_attention_variants(
                    impl.num_heads,
                    impl.num_kv_heads,
                    impl.head_size,
                    num_sms(device),
                    sched.max_num_seqs,
                    sched.max_num_batched_tokens,
                    itemsize=key_cache.element_size(),
                )
                # The kernel requires the query in the KV cache's dtype.
                launches += warm_up_tree_attention(
                    variants,
                    torch.empty(
                        (1, impl.num_heads, impl.head_size),
                        dtype=key_cache.dtype,
                        device=device,
                    ),
                    key_cache,
                    value_cache,
                    table.shape[1],
                    self.tree_inputs.attn_mask,
                    self.tree_inputs.is_tree,
                    impl.scale,
                )
        return launches

    def _bind_tree_inputs(self, attn_groups: list[list[AttentionGroup]]) -> None:
        """Hand the tree buffers to every TREE_ATTN metadata builder, once."""
        if self._tree_groups is not None:
            return
        tree_groups = tree_attention_groups(attn_groups)
        if not tree_groups:
            raise ValueError(
                f"DDTree needs TREE_ATTN (attention backend {TREE_ATTN_NAME}) for "
                "the target model's attention layers"
            )
        for group in tree_groups:
            for builder in group.metadata_builders:
                assert isinstance(builder, TreeAttentionMetadataBuilder)
                builder.set_tree_inputs(self.tree_inputs)
        self._tree_groups = tree_groups

    def _without_draft_groups(
        self, attn_groups: list[list[AttentionGroup]]
    ) -> list[list[AttentionGroup]]:
        """``attn_groups`` less the groups of drafter layers only (one list per
        KV-cache group kept, as ``build_attn_metadata`` indexes them)."""
        if not self._draft_layers:
            return attn_groups
        cached = self._target_groups
        if cached is None or cached[0] is not attn_groups:
            kept = [
                [
                    group
                    for group in groups
                    if not set(group.layer_names) <= self._draft_layers
                ]
                for groups in attn_groups
            ]
            cached = self._target_groups = (attn_groups, kept)
        return cached[1]
