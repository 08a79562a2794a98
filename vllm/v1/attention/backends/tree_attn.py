# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""TREE_ATTN: causal paged attention with per-request token-tree masks.

The target model of tree speculative decoding (DDTree) verifies a whole draft tree
per request in one forward: the request's new tokens are ``[root, node_1, ...,
node_B]`` flattened parent-before-child, and node i must see the committed
context plus its own ancestors only. This backend serves every attention layer of
such a target:

* tree rows: requests whose entry in ``TreeAttentionInputs.is_tree`` is set use
  the ancestor bitmask of ``TreeAttentionInputs.attn_mask`` (layout in
  ``vllm/v1/attention/ops/tree_mask.py``);
* every other row is causal (plain decodes, chains, chunked prefills), so without
  tree inputs the backend is a plain causal backend and matches FLASH_ATTN.

Rows run the Triton kernel of ``vllm/v1/attention/ops/triton_tree_attention.py``.
Where vLLM's FlashAttention is available and mixed batches are not captured in
full CUDA graphs, a batch without tree rows (every query a single token, or a
step the speculator marked draft-free) is handed whole to FLASH_ATTN's own
metadata builder and impl, so that a step verifying no tree costs what a step
without speculation does; and long causal rows at the end of a mixed batch
(prefills) go to FlashAttention too. The KV cache has FLASH_ATTN's layout, so
every path (and the KV compaction of the tree sampler) reads the same pages.

The backend is causal-only: ``supports_non_causal()`` is false and ``build``
rejects non-causal metadata, so it can never serve the DFlash drafter, whose
block-diffusion attention is bidirectional; the drafter keeps its own backend.

A backend is named by an ``AttentionBackendEnum`` member, and the attention
layer maps ``get_name()`` back to one. Where the enum has a ``TREE_ATTN`` member
(:data:`TREE_ATTN_NAME` says which), that member is this backend; where it has
none (vLLM 0.26 as released), the backend takes the ``CUSTOM`` slot, which must
be registered to :data:`TREE_ATTN_BACKEND_PATH` before use (the DDTree plugin
does so for DDTree engines only).
"""

from dataclasses import dataclass
from typing import ClassVar

import torch

from vllm.config import VllmConfig
from vllm.config.cache import CacheDType
from vllm.config.compilation import CUDAGraphMode
from vllm.platforms import current_platform
from vllm.platforms.interface import DeviceCapability
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionLayer,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.attention.backends.flash_attn import (
    FlashAttentionBackend,
    FlashAttentionImpl,
    FlashAttentionMetadata,
    FlashAttentionMetadataBuilder,
)
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.attention.backends.utils import split_decodes_and_prefills
from vllm.v1.attention.ops.tree_mask import num_mask_words
from vllm.v1.attention.ops.triton_tree_attention import tree_attention
from vllm.v1.kv_cache_interface import AttentionSpec

TREE_ATTN_BACKEND_PATH = "vllm.v1.attention.backends.tree_attn.TreeAttentionBackend"
# The AttentionBackendEnum member that names this backend: its own where vLLM
# lists one, else the CUSTOM slot (get_name() must name an existing member).
TREE_ATTN_NAME = (
    "TREE_ATTN" if "TREE_ATTN" in AttentionBackendEnum.__members__ else "CUSTOM"
)


def split_kv_cache(
    kv_cache: torch.Tensor, head_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """FLASH_ATTN's logical [num_blocks, num_kv_heads, block_size, 2 * head_size]
    layer cache -> key and value views [num_blocks, block_size, num_kv_heads,
    head_size]."""
    key_cache, value_cache = kv_cache.transpose(1, 2).split(head_size, -1)
    return key_cache, value_cache


def kv_cache_as_kv_first(kv_cache: torch.Tensor, head_size: int) -> torch.Tensor:
    """The same layer cache as a [2, num_blocks, block_size, num_kv_heads,
    head_size] view (K then V), the layout ops such as the tree KV compaction
    take."""
    return kv_cache.transpose(1, 2).unflatten(-1, (2, head_size)).permute(3, 0, 1, 2, 4)


@dataclass
class TreeAttentionInputs:
    """Persistent per-request tree masks, shared by the speculator and TREE_ATTN.

    The speculator allocates these once, hands them to the metadata builder with
    ``TreeAttentionMetadataBuilder.set_tree_inputs`` and rewrites them in place
    every step before attention metadata is built. Entry r belongs to the r-th
    request of the current batch; rows of requests with ``is_tree[r] == 0`` are
    causal.
    """

    # [max_num_reqs, max_tree_len, num_words] int32: bit (j % 32) of word
    # (j // 32) in row i is set iff tree token j is an ancestor-or-self of tree
    # token i; a request with fewer tree rows uses the first of them.
    attn_mask: torch.Tensor
    # [max_num_reqs] int32: 0 for a causal request, 1 + s where the request's
    # tree root is its query row s (rows before it are causal prompt rows).
    is_tree: torch.Tensor
    # Host side, written with the buffers: False when the step verifies no
    # drafts, so that every row is causal and the builder may hand the batch to
    # FlashAttention. Never False for a batch replayed from a full CUDA graph
    # (the graph runs the path it was captured with).
    has_tree_rows: bool = True

    def __post_init__(self) -> None:
        mask, is_tree = self.attn_mask, self.is_tree
        if mask.dim() != 3 or mask.dtype != torch.int32 or mask.stride(2) != 1:
            raise ValueError(
                "attn_mask must be an int32 [max_num_reqs, max_tree_len, num_words] "
                f"tensor with contiguous words, got {tuple(mask.shape)} {mask.dtype}"
            )
        if mask.shape[2] < num_mask_words(mask.shape[1] - 1):
            raise ValueError(
                f"attn_mask rows of {mask.shape[2]} words cannot hold "
                f"{mask.shape[1]} tree tokens"
            )
        if is_tree.shape != (mask.shape[0],) or is_tree.dtype != torch.int32:
            raise ValueError(
                f"is_tree must be int32 [{mask.shape[0]}], got "
                f"{tuple(is_tree.shape)} {is_tree.dtype}"
            )
        if is_tree.device != mask.device:
            raise ValueError("attn_mask and is_tree must be on the same device")

    @classmethod
    def allocate(
        cls, max_num_reqs: int, max_tree_budget: int, device: torch.device
    ) -> "TreeAttentionInputs":
        """Zeroed buffers (every row causal) for trees of up to this many nodes."""
        max_tree_len = max_tree_budget + 1
        return cls(
            attn_mask=torch.zeros(
                max_num_reqs,
                max_tree_len,
                num_mask_words(max_tree_budget),
                dtype=torch.int32,
                device=device,
            ),
            is_tree=torch.zeros(max_num_reqs, dtype=torch.int32, device=device),
        )

    @property
    def max_tree_len(self) -> int:
        return self.attn_mask.shape[1]


@dataclass
class TreeKernelRows:
    """The requests served by the Triton tree kernel: the batch's first ones."""

    num_tokens: int
    # [num_kernel_reqs + 1]
    query_start_loc: torch.Tensor
    # [num_kernel_reqs]
    seq_lens: torch.Tensor
    # [num_kernel_reqs, max_num_blocks]
    block_table: torch.Tensor
    # [num_kernel_reqs, max_tree_len, num_words], or None: all rows causal.
    tree_mask: torch.Tensor | None
    # [num_kernel_reqs]
    is_tree: torch.Tensor | None


@dataclass
class FlashPrefillRows:
    """Causal prefill requests delegated to FlashAttention: the batch's last ones."""

    token_start: int
    token_end: int
    # [num_prefills + 1], starting at 0
    query_start_loc: torch.Tensor
    # [num_prefills]
    seq_lens: torch.Tensor
    # [num_prefills, max_num_blocks]
    block_table: torch.Tensor
    max_query_len: int
    max_seq_len: int


@dataclass
class TreeAttentionMetadata:
    num_actual_tokens: int
    max_query_len: int
    # [num_reqs + 1]
    query_start_loc: torch.Tensor
    max_seq_len: int
    # [num_reqs]
    seq_lens: torch.Tensor
    # [num_reqs, max_num_blocks]
    block_table: torch.Tensor
    # [num_actual_tokens]
    slot_mapping: torch.Tensor
    kernel_rows: TreeKernelRows
    prefill_rows: FlashPrefillRows | None


class TreeAttentionBackend(AttentionBackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16]
    supported_kv_cache_dtypes: ClassVar[list[CacheDType]] = [
        "auto",
        "float16",
        "bfloat16",
    ]
    forward_includes_kv_cache_update: bool = False

    @staticmethod
    def get_name() -> str:
        return TREE_ATTN_NAME

    @staticmethod
    def get_impl_cls() -> type["TreeAttentionImpl"]:
        return TreeAttentionImpl

    @staticmethod
    def get_builder_cls() -> type["TreeAttentionMetadataBuilder"]:
        return TreeAttentionMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes() -> list[int | MultipleOf]:
        return [MultipleOf(16)]

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        cache_dtype_str: str = "auto",
    ) -> tuple[int, ...]:
        # FLASH_ATTN's layout, so prefills can run FlashAttention on the same pages.
        return FlashAttentionBackend.get_kv_cache_shape(
            num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str
        )

    @staticmethod
    def get_kv_cache_stride_order(
        include_num_layers_dimension: bool = False,
    ) -> tuple[int, ...]:
        return FlashAttentionBackend.get_kv_cache_stride_order(
            include_num_layers_dimension
        )

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        return head_size % 16 == 0 and 32 <= head_size <= 256

    @classmethod
    def supports_compute_capability(cls, capability: DeviceCapability) -> bool:
        return capability is None or capability >= DeviceCapability(8, 0)

    @classmethod
    def supports_non_causal(cls) -> bool:
        # Tree rows are causal over their ancestors; the bidirectional DFlash
        # drafter must keep its own backend.
        return False


def _flash_attn_version(head_size: int) -> int | None:
    """FlashAttention version for causal prefills, or None where unavailable."""
    if not current_platform.is_cuda():
        return None
    from vllm.v1.attention.backends.fa_utils import get_flash_attn_version

    return get_flash_attn_version(head_size=head_size)


class TreeAttentionMetadataBuilder(AttentionMetadataBuilder[TreeAttentionMetadata]):
    # The Triton kernel serves any batch with a launch shape fixed by the token
    # and request counts. FlashAttention serves prefills only where mixed batches
    # run eagerly (see _flash_prefills_allowed).
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.ALWAYS

    def __init__(
        self,
        kv_cache_spec: AttentionSpec,
        layer_names: list[str],
        vllm_config: VllmConfig,
        device: torch.device,
    ):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        # Decodes, chains and trees (q_len <= 1 + num_speculative_tokens) lead
        # the batch and run the tree kernel. Not vLLM's spec-as-decode bound,
        # which doubles num_speculative_tokens under parallel drafting (set for
        # DDTree's DFlash drafter): its mask tokens never reach this batch.
        spec = vllm_config.speculative_config
        num_spec = spec.num_speculative_tokens if spec is not None else None
        self._init_reorder_batch_threshold(1 + (num_spec or 0))
        self._tree_inputs: TreeAttentionInputs | None = None
        self._fa_version = _flash_attn_version(kv_cache_spec.head_size)
        # FLASH_ATTN's builder for batches without tree rows: its metadata (and
        # under full CUDA graphs its persistent scheduler buffer) as a target
        # without speculation builds them.
        self._flash: FlashAttentionMetadataBuilder | None = None
        if self._fa_version is not None:
            self._flash = FlashAttentionMetadataBuilder(
                kv_cache_spec, layer_names, vllm_config, device
            )

    def set_tree_inputs(self, inputs: TreeAttentionInputs) -> None:
        """Give the builder the speculator's persistent tree buffers (once)."""
        max_num_reqs = self.vllm_config.scheduler_config.max_num_seqs
        if inputs.attn_mask.shape[0] < max_num_reqs:
            raise ValueError(
                f"tree inputs hold {inputs.attn_mask.shape[0]} requests, the "
                f"scheduler runs up to {max_num_reqs}"
            )
        mask_device, device = inputs.attn_mask.device, torch.device(self.device)
        if mask_device.type != device.type or (
            None not in (mask_device.index, device.index)
            and mask_device.index != device.index
        ):
            raise ValueError(
                f"tree inputs are on {inputs.attn_mask.device}, attention runs on "
                f"{self.device}"
            )
        self._tree_inputs = inputs
        self.reorder_batch_threshold = max(
            self.reorder_batch_threshold or 1, inputs.max_tree_len
        )

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> "TreeAttentionMetadata | FlashAttentionMetadata":
        cm = common_attn_metadata
        if cm.causal is not True:
            raise ValueError(
                "TREE_ATTN is causal-only; non-causal attention (e.g. the DFlash "
                "drafter) needs another backend"
            )
        if self._flash is not None and self._without_tree_rows(cm):
            return self._flash.build(common_prefix_len, cm, fast_build)
        num_decodes, num_decode_tokens = self._split_point(cm)
        if num_decodes == cm.num_reqs:
            kernel_rows = self._kernel_rows(cm, cm.num_reqs, cm.num_actual_tokens)
            prefill_rows = None
        else:
            kernel_rows = self._kernel_rows(cm, num_decodes, num_decode_tokens)
            prefill_rows = FlashPrefillRows(
                token_start=num_decode_tokens,
                token_end=cm.num_actual_tokens,
                query_start_loc=cm.query_start_loc[num_decodes:] - num_decode_tokens,
                seq_lens=cm.seq_lens[num_decodes:],
                block_table=cm.block_table_tensor[num_decodes:],
                max_query_len=cm.max_query_len,
                max_seq_len=cm.max_seq_len,
            )
        return TreeAttentionMetadata(
            num_actual_tokens=cm.num_actual_tokens,
            max_query_len=cm.max_query_len,
            query_start_loc=cm.query_start_loc,
            max_seq_len=cm.max_seq_len,
            seq_lens=cm.seq_lens,
            block_table=cm.block_table_tensor,
            slot_mapping=cm.slot_mapping,
            kernel_rows=kernel_rows,
            prefill_rows=prefill_rows,
        )

    def _kernel_rows(
        self, cm: CommonAttentionMetadata, num_reqs: int, num_tokens: int
    ) -> TreeKernelRows:
        tree_mask = is_tree = None
        if self._tree_inputs is not None:
            tree_mask = self._tree_inputs.attn_mask[:num_reqs]
            is_tree = self._tree_inputs.is_tree[:num_reqs]
        return TreeKernelRows(
            num_tokens=num_tokens,
            query_start_loc=cm.query_start_loc[: num_reqs + 1],
            seq_lens=cm.seq_lens[:num_reqs],
            block_table=cm.block_table_tensor[:num_reqs],
            tree_mask=tree_mask,
            is_tree=is_tree,
        )

    def _without_tree_rows(self, cm: CommonAttentionMetadata) -> bool:
        """Whether the whole batch goes to FlashAttention: no row can be a tree
        row. A batch of single-token queries never holds one (a tree has its
        root and at least one node), and under full CUDA graphs is replayed
        from a graph captured with single-token queries only; any other batch
        needs the speculator's word (``has_tree_rows``), and runs eagerly or
        piecewise (_flash_prefills_allowed)."""
        if not self._flash_prefills_allowed():
            return False
        inputs = self._tree_inputs
        return cm.max_query_len == 1 or (
            inputs is not None and not inputs.has_tree_rows
        )

    def _split_point(self, cm: CommonAttentionMetadata) -> tuple[int, int]:
        """(requests, tokens) served by the tree kernel; FlashAttention the rest."""
        everything = (cm.num_reqs, cm.num_actual_tokens)
        if not self._flash_prefills_allowed() or cm.max_query_len <= (
            self.reorder_batch_threshold
        ):
            return everything
        num_decodes, num_prefills, num_decode_tokens, _ = split_decodes_and_prefills(
            cm, decode_threshold=self.reorder_batch_threshold
        )
        # Tree rows must never reach FlashAttention: delegate only if every
        # request after the split point is long (reads CPU tensors only).
        qsl = cm.query_start_loc_cpu[num_decodes : cm.num_reqs + 1]
        tail_lens = qsl[1:] - qsl[:-1]
        if num_prefills == 0 or not bool(
            (tail_lens > self.reorder_batch_threshold).all()
        ):
            return everything
        return num_decodes, num_decode_tokens

    def _flash_prefills_allowed(self) -> bool:
        # Mixed batches captured in full CUDA graphs need a launch shape fixed by
        # the token and request counts: there the tree kernel serves every row.
        cudagraph_mode = self.vllm_config.compilation_config.cudagraph_mode
        return self._fa_version is not None and (
            cudagraph_mode is None or cudagraph_mode.mixed_mode() != CUDAGraphMode.FULL
        )


class TreeAttentionImpl(AttentionImpl[TreeAttentionMetadata]):
    supports_dcp: bool = False

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes: list[float] | None,
        sliding_window: int | None,
        kv_cache_dtype: str,
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        _check_impl_features(
            alibi_slopes,
            sliding_window,
            kv_cache_dtype,
            logits_soft_cap,
            attn_type,
            sinks,
        )
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.attn_type = attn_type
        self._fa_version = _flash_attn_version(head_size)
        # FLASH_ATTN's impl, for batches the builder handed to its metadata.
        self._flash: FlashAttentionImpl | None = None
        if self._fa_version is not None:
            from vllm.v1.attention.backends.fa_utils import (
                flash_attn_varlen_func,
                reshape_and_cache_flash,
            )

            self._flash_attn_varlen_func = flash_attn_varlen_func
            self._write_kv = reshape_and_cache_flash
            self._flash = FlashAttentionImpl(
                num_heads,
                head_size,
                scale,
                num_kv_heads,
                alibi_slopes,
                sliding_window,
                kv_cache_dtype,
                logits_soft_cap,
                attn_type,
                kv_sharing_target_layer_name,
                sinks,
            )
        else:
            self._write_kv = _reshape_and_cache_torch

    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: "TreeAttentionMetadata | FlashAttentionMetadata",
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """query, output: [num_tokens, num_heads, head_size]; kv_cache: FLASH_ATTN's
        [num_blocks, num_kv_heads, block_size, 2 * head_size] (logical order).
        The new tokens' K/V are already in the cache (do_kv_cache_update)."""
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("TREE_ATTN does not fuse output quantization")
        if attn_metadata is None:  # profiling run
            return output.fill_(0)
        if isinstance(attn_metadata, FlashAttentionMetadata):
            # No tree rows (the builder's choice): FLASH_ATTN's own forward.
            assert self._flash is not None
            return self._flash.forward(
                layer, query, key, value, kv_cache, attn_metadata, output
            )
        key_cache, value_cache = split_kv_cache(kv_cache, self.head_size)
        rows = attn_metadata.kernel_rows
        if rows.num_tokens > 0:
            tree_attention(
                query[: rows.num_tokens],
                key_cache,
                value_cache,
                output[: rows.num_tokens],
                rows.query_start_loc,
                rows.seq_lens,
                rows.block_table,
                self.scale,
                rows.tree_mask,
                rows.is_tree,
            )
        prefill = attn_metadata.prefill_rows
        if prefill is not None:
            self._flash_attn_varlen_func(
                q=query[prefill.token_start : prefill.token_end],
                k=key_cache,
                v=value_cache,
                out=output[prefill.token_start : prefill.token_end],
                cu_seqlens_q=prefill.query_start_loc,
                max_seqlen_q=prefill.max_query_len,
                seqused_k=prefill.seq_lens,
                max_seqlen_k=prefill.max_seq_len,
                softmax_scale=self.scale,
                causal=True,
                block_table=prefill.block_table,
                fa_version=self._fa_version,
            )
        return output

    def do_kv_cache_update(
        self,
        layer: AttentionLayer,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        key_cache, value_cache = split_kv_cache(kv_cache, self.head_size)
        self._write_kv(
            key,
            value,
            key_cache,
            value_cache,
            slot_mapping,
            self.kv_cache_dtype,
            layer._k_scale,
            layer._v_scale,
        )


def _check_impl_features(
    alibi_slopes, sliding_window, kv_cache_dtype, logits_soft_cap, attn_type, sinks
) -> None:
    """Raise ValueError for layer features TREE_ATTN does not implement."""
    unsupported = {
        "ALiBi": alibi_slopes is not None,
        "sliding window": sliding_window is not None,
        "logits soft-cap": bool(logits_soft_cap),
        "attention sinks": sinks is not None,
        f"KV cache dtype {kv_cache_dtype}": kv_cache_dtype
        not in TreeAttentionBackend.supported_kv_cache_dtypes,
        f"attention type {attn_type}": attn_type != AttentionType.DECODER,
    }
    missing = [name for name, used in unsupported.items() if used]
    if missing:
        raise ValueError(f"TREE_ATTN does not support {', '.join(missing)}")


def _reshape_and_cache_torch(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
) -> None:
    """KV write where vLLM's CUDA op is unavailable (CPU runs); -1 slots skip."""
    num_tokens = slot_mapping.shape[0]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    block_size = key_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    key_cache[blocks, offsets] = key[:num_tokens][keep]
    value_cache[blocks, offsets] = value[:num_tokens][keep]
