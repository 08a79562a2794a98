# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""TREE_ATTN backend: its AttentionBackendEnum member, declared capabilities,
metadata builder and impl forward through vLLM's own metadata objects (CPU:
Triton interpreter)."""

import json
from types import SimpleNamespace

import pytest
import torch

from tests.v1.attention.test_tree_attention import (
    DEVICE,
    ON_GPU,
    TOLERANCE,
    causal_visibility,
    needs_gpu,
    random_tree,
    reference_attention,
    tree_visibility,
)
from vllm.config import DeviceConfig, ModelConfig, VllmConfig, set_current_vllm_config
from vllm.config.compilation import CUDAGraphMode
from vllm.platforms.interface import DeviceCapability
from vllm.v1.attention.backend import (
    AttentionCGSupport,
    AttentionType,
    CommonAttentionMetadata,
)
from vllm.v1.attention.backends.flash_attn import (
    FlashAttentionBackend,
    FlashAttentionMetadata,
)
from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
from vllm.v1.attention.backends.tree_attn import (
    TREE_ATTN_BACKEND_PATH,
    TREE_ATTN_NAME,
    TreeAttentionBackend,
    TreeAttentionImpl,
    TreeAttentionInputs,
    TreeAttentionMetadata,
    TreeAttentionMetadataBuilder,
    kv_cache_as_kv_first,
    split_kv_cache,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 4, 2, 64, 16
DTYPE = torch.bfloat16 if ON_GPU else torch.float16


@pytest.fixture(scope="module")
def vllm_config(tmp_path_factory):
    """A real VllmConfig for a tiny Qwen3-shaped model (no weights needed)."""
    model_dir = tmp_path_factory.mktemp("tiny_qwen3")
    (model_dir / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["Qwen3ForCausalLM"],
                "model_type": "qwen3",
                "hidden_size": NUM_Q_HEADS * HEAD_SIZE,
                "intermediate_size": 512,
                "num_attention_heads": NUM_Q_HEADS,
                "num_key_value_heads": NUM_KV_HEADS,
                "head_dim": HEAD_SIZE,
                "num_hidden_layers": 2,
                "vocab_size": 1000,
                "max_position_embeddings": 4096,
                "rms_norm_eps": 1e-6,
                "torch_dtype": "float16",
                "tie_word_embeddings": False,
            }
        )
    )
    model_config = ModelConfig(
        model=str(model_dir), skip_tokenizer_init=True, dtype=DTYPE
    )
    return VllmConfig(
        model_config=model_config, device_config=DeviceConfig(device=DEVICE)
    )


@pytest.fixture
def tree_attn_member():
    """TREE_ATTN's enum member, ready to load: its own member where vLLM lists
    one; where it does not (vLLM 0.26 as released), the CUSTOM slot, registered
    to the backend for the test and restored after."""
    member = AttentionBackendEnum[TREE_ATTN_NAME]
    if member is not AttentionBackendEnum.CUSTOM:
        yield member
        return
    before = member.get_path() if member.is_overridden() else None
    member.clear_override()
    register_backend(member, TREE_ATTN_BACKEND_PATH)
    yield member
    member.clear_override()
    if before is not None:
        register_backend(member, before)


# ----------------------------------------------------------------- enum member


def test_name_is_the_tree_attn_member_where_vllm_has_one():
    has_member = "TREE_ATTN" in AttentionBackendEnum.__members__
    assert TREE_ATTN_NAME == ("TREE_ATTN" if has_member else "CUSTOM")
    assert TreeAttentionBackend.get_name() == TREE_ATTN_NAME
    assert TREE_ATTN_BACKEND_PATH == (
        f"{TreeAttentionBackend.__module__}.{TreeAttentionBackend.__qualname__}"
    )


def test_layer_maps_the_name_back_to_the_backend(tree_attn_member):
    # The attention layer looks its backend up by get_name().
    member = AttentionBackendEnum[TreeAttentionBackend.get_name()]
    assert member is tree_attn_member
    assert member.get_path() == TREE_ATTN_BACKEND_PATH
    assert member.get_class() is TreeAttentionBackend


# ----------------------------------------------------------------- capabilities


def validate(**overrides):
    config = dict(
        head_size=128,
        dtype=torch.bfloat16,
        kv_cache_dtype="auto",
        block_size=16,
        use_mla=False,
        has_sink=False,
        use_sparse=False,
        use_mm_prefix=False,
        use_per_head_quant_scales=False,
        device_capability=DeviceCapability(9, 0),
        attn_type=AttentionType.DECODER,
    )
    config.update(overrides)
    return TreeAttentionBackend.validate_configuration(**config)


@pytest.mark.parametrize("head_size", [64, 80, 128, 256])
@pytest.mark.parametrize("block_size", [16, 32, 64])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_supported_configurations(head_size, block_size, dtype):
    assert validate(head_size=head_size, block_size=block_size, dtype=dtype) == []


@pytest.mark.parametrize(
    "overrides, reason",
    [
        (dict(has_sliding_window=True), "sliding window not supported"),
        (dict(has_sink=True), "attention sinks not supported"),
        (dict(kv_cache_dtype="fp8"), "kv_cache_dtype not supported"),
        (dict(kv_cache_dtype="fp8_e4m3"), "kv_cache_dtype not supported"),
        (dict(use_mla=True), "MLA not supported"),
        (dict(use_sparse=True), "sparse not supported"),
        (dict(use_non_causal=True), "non-causal attention not supported"),
        (dict(attn_type=AttentionType.ENCODER_DECODER), "ENCODER_DECODER not supp"),
        (dict(attn_type=AttentionType.ENCODER_ONLY), "ENCODER_ONLY not supported"),
        (dict(use_mm_prefix=True), "multimodal token full attention not supported"),
        (dict(use_batch_invariant=True), "batch invariance not supported"),
        (dict(use_per_head_quant_scales=True), "per-head quant scales not supp"),
        (dict(head_size=72), "head_size not supported"),
        (dict(head_size=512), "head_size not supported"),
        (dict(block_size=8), "block_size not supported"),
        (dict(dtype=torch.float32), "dtype not supported"),
        (dict(device_capability=DeviceCapability(7, 5)), "compute capability"),
    ],
)
def test_unsupported_configurations_give_reasons(overrides, reason):
    reasons = validate(**overrides)
    assert any(reason in r for r in reasons), reasons


@needs_gpu
def test_selecting_tree_attn_for_unsupported_layer_fails(tree_attn_member):
    from vllm.platforms import current_platform
    from vllm.v1.attention.selector import AttentionSelectorConfig

    config = AttentionSelectorConfig(
        head_size=128, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=16
    )
    assert (
        current_platform.get_attn_backend_cls(tree_attn_member, config)
        == TREE_ATTN_BACKEND_PATH
    )
    with pytest.raises(ValueError, match="sliding window not supported"):
        current_platform.get_attn_backend_cls(
            tree_attn_member, config._replace(has_sliding_window=True)
        )
    with pytest.raises(ValueError, match="non-causal attention not supported"):
        current_platform.get_attn_backend_cls(
            tree_attn_member, config._replace(use_non_causal=True)
        )


def test_never_serves_the_non_causal_drafter():
    assert not TreeAttentionBackend.supports_non_causal()


def test_kv_cache_layout_is_flash_attn(vllm_config):
    args = (100, 32, NUM_KV_HEADS, HEAD_SIZE)
    assert TreeAttentionBackend.get_kv_cache_shape(*args) == (
        FlashAttentionBackend.get_kv_cache_shape(*args)
    )
    with set_current_vllm_config(vllm_config):
        for layered in (False, True):
            assert TreeAttentionBackend.get_kv_cache_stride_order(layered) == (
                FlashAttentionBackend.get_kv_cache_stride_order(layered)
            )


def test_kv_cache_views_share_the_pages():
    kv_cache = torch.zeros(5, 16, NUM_KV_HEADS, 2 * HEAD_SIZE).permute(0, 2, 1, 3)
    key_cache, value_cache = split_kv_cache(kv_cache, HEAD_SIZE)
    kv_first = kv_cache_as_kv_first(kv_cache, HEAD_SIZE)
    assert kv_first.shape == (2, 5, 16, NUM_KV_HEADS, HEAD_SIZE)
    kv_first[0, 3, 7, 1].fill_(1.0)
    kv_first[1, 2, 5, 0].fill_(2.0)
    assert (key_cache[3, 7, 1] == 1).all() and key_cache.sum() == HEAD_SIZE
    assert (value_cache[2, 5, 0] == 2).all() and value_cache.sum() == 2 * HEAD_SIZE


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(alibi_slopes=[1.0] * NUM_Q_HEADS), "ALiBi"),
        (dict(sliding_window=128), "sliding window"),
        (dict(logits_soft_cap=30.0), "logits soft-cap"),
        (dict(kv_cache_dtype="fp8"), "KV cache dtype fp8"),
        (dict(attn_type=AttentionType.ENCODER_DECODER), "attention type"),
        (dict(sinks=torch.zeros(NUM_Q_HEADS)), "attention sinks"),
    ],
)
def test_impl_rejects_unsupported_layers(kwargs, message):
    args = dict(
        num_heads=NUM_Q_HEADS,
        head_size=HEAD_SIZE,
        scale=0.125,
        num_kv_heads=NUM_KV_HEADS,
        alibi_slopes=None,
        sliding_window=None,
        kv_cache_dtype="auto",
    )
    args.update(kwargs)
    with pytest.raises(ValueError, match=f"TREE_ATTN does not support {message}"):
        TreeAttentionImpl(**args)


# ----------------------------------------------------------------- tree inputs


def test_tree_inputs_validation():
    with pytest.raises(ValueError, match="attn_mask must be an int32"):
        TreeAttentionInputs(torch.zeros(4, 16, 1), torch.zeros(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="cannot hold 40 tree tokens"):
        TreeAttentionInputs(
            torch.zeros(4, 40, 1, dtype=torch.int32), torch.zeros(4, dtype=torch.int32)
        )
    with pytest.raises(ValueError, match=r"is_tree must be int32 \[4\]"):
        TreeAttentionInputs(
            torch.zeros(4, 16, 1, dtype=torch.int32), torch.zeros(3, dtype=torch.int32)
        )
    inputs = TreeAttentionInputs.allocate(8, 1024, torch.device("cpu"))
    assert inputs.attn_mask.shape == (8, 1025, 33) and inputs.max_tree_len == 1025


# ----------------------------------------------------------------- builder + impl


class Step:
    """One step of a batch through vLLM's metadata objects: KV pages, slot
    mapping, CommonAttentionMetadata, new tokens' q/k/v."""

    def __init__(self, ctx_lens, q_lens, seed=0):
        gen = torch.Generator().manual_seed(seed)
        num_reqs = len(q_lens)
        seq_lens = [c + q for c, q in zip(ctx_lens, q_lens)]
        blocks = [-(-s // BLOCK_SIZE) for s in seq_lens]
        num_blocks = sum(blocks) + 2
        kv = torch.randn(
            num_blocks, BLOCK_SIZE, NUM_KV_HEADS, 2 * HEAD_SIZE, generator=gen
        ).to(DTYPE)
        self.kv_cache = kv.permute(0, 2, 1, 3).to(DEVICE)  # FLASH_ATTN, logical
        perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
        table = torch.zeros(num_reqs, max(blocks), dtype=torch.int32)
        slots, used = [], 0
        for r in range(num_reqs):
            table[r, : blocks[r]] = perm[used : used + blocks[r]]
            used += blocks[r]
            pos = torch.arange(ctx_lens[r], seq_lens[r])
            slots.append(table[r, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
        qsl = torch.tensor(
            [0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32
        )
        num_tokens = int(qsl[-1])
        self.metadata = CommonAttentionMetadata(
            query_start_loc=qsl.to(DEVICE),
            query_start_loc_cpu=qsl,
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
            num_reqs=num_reqs,
            num_actual_tokens=num_tokens,
            max_query_len=max(q_lens),
            max_seq_len=max(seq_lens),
            block_table_tensor=table.to(DEVICE),
            slot_mapping=torch.cat(slots).to(DEVICE, torch.int64),
        )

        def rand(heads):
            return torch.randn(num_tokens, heads, HEAD_SIZE, generator=gen).to(
                DEVICE, DTYPE
            )

        self.q, self.k, self.v = (
            rand(NUM_Q_HEADS),
            rand(NUM_KV_HEADS),
            rand(NUM_KV_HEADS),
        )

    def forward(self, builder, impl):
        """Write the new tokens' K/V, build the metadata, run the layer."""
        layer = SimpleNamespace(
            _k_scale=torch.ones((), device=DEVICE),
            _v_scale=torch.ones((), device=DEVICE),
        )
        impl.do_kv_cache_update(
            layer, self.k, self.v, self.kv_cache, self.metadata.slot_mapping
        )
        attn_metadata = builder.build(0, self.metadata)
        out = torch.full_like(self.q, float("nan"))
        impl.forward(layer, self.q, self.k, self.v, self.kv_cache, attn_metadata, out)
        return attn_metadata, out

    def reference(self, visibility):
        key_cache, value_cache = self.kv_cache.transpose(1, 2).split(HEAD_SIZE, -1)
        cm = self.metadata
        return reference_attention(
            self.q,
            key_cache,
            value_cache,
            cm.query_start_loc,
            cm.seq_lens,
            cm.block_table_tensor,
            HEAD_SIZE**-0.5,
            visibility,
        )


def make_builder(vllm_config):
    spec = FullAttentionSpec(
        block_size=BLOCK_SIZE,
        num_kv_heads=NUM_KV_HEADS,
        head_size=HEAD_SIZE,
        dtype=DTYPE,
    )
    return TreeAttentionMetadataBuilder(
        spec, ["model.layers.0.self_attn.attn"], vllm_config, torch.device(DEVICE)
    )


def make_impl():
    return TreeAttentionImpl(
        NUM_Q_HEADS,
        HEAD_SIZE,
        HEAD_SIZE**-0.5,
        NUM_KV_HEADS,
        alibi_slopes=None,
        sliding_window=None,
        kv_cache_dtype="auto",
    )


def write_trees(inputs, trees):
    """What the speculator does each step: rewrite the buffers in place."""
    inputs.attn_mask.zero_()
    inputs.is_tree.zero_()
    for r, tree in enumerate(trees):
        if tree is not None:
            mask = tree.attn_mask[0]
            inputs.attn_mask[r, : mask.shape[0], : mask.shape[1]] = mask
            inputs.is_tree[r] = 1


def test_cudagraph_support_declared(vllm_config):
    builder = make_builder(vllm_config)
    assert builder.get_cudagraph_support(vllm_config, builder.kv_cache_spec) == (
        AttentionCGSupport.ALWAYS
    )


def test_without_tree_inputs_every_row_is_causal(vllm_config):
    q_lens, ctx_lens = [16, 1, 40], [100, 33, 0]
    step = Step(ctx_lens, q_lens)
    _, out = step.forward(make_builder(vllm_config), make_impl())
    ref = step.reference([causal_visibility(q) for q in q_lens])
    torch.testing.assert_close(out.float(), ref, **TOLERANCE[DTYPE])


def test_tree_batch_through_builder_and_impl(vllm_config):
    budget = 31
    builder = make_builder(vllm_config)
    inputs = TreeAttentionInputs.allocate(
        vllm_config.scheduler_config.max_num_seqs, budget, torch.device(DEVICE)
    )
    builder.set_tree_inputs(inputs)
    assert builder.reorder_batch_threshold == budget + 1
    trees = [
        random_tree("heap", budget, seed=1),
        None,
        random_tree("parents", budget, seed=2),
    ]
    q_lens, ctx_lens = [budget + 1, 1, 20], [70, 300, 5]  # last tree trimmed
    write_trees(inputs, trees)
    step = Step(ctx_lens, q_lens, seed=3)
    attn_metadata, out = step.forward(builder, make_impl())
    # The builder hands out views of the persistent buffers, never copies.
    rows = attn_metadata.kernel_rows
    assert rows.tree_mask.data_ptr() == inputs.attn_mask.data_ptr()
    assert rows.is_tree.data_ptr() == inputs.is_tree.data_ptr()
    assert rows.tree_mask.shape[0] == 3 and attn_metadata.prefill_rows is None
    visibility = [
        tree_visibility(trees[0].parent_ids[0]),
        causal_visibility(1),
        tree_visibility(trees[2].parent_ids[0])[:20, :20],
    ]
    torch.testing.assert_close(
        out.float(), step.reference(visibility), **TOLERANCE[DTYPE]
    )

    # Next step: new trees written in place, same builder.
    trees = [None, random_tree("parents", budget, seed=4), None]
    write_trees(inputs, trees)
    step = Step([9, 400, 1], [3, budget + 1, 1], seed=5)
    _, out = step.forward(builder, make_impl())
    visibility = [
        causal_visibility(3),
        tree_visibility(trees[1].parent_ids[0]),
        causal_visibility(1),
    ]
    torch.testing.assert_close(
        out.float(), step.reference(visibility), **TOLERANCE[DTYPE]
    )


def test_set_tree_inputs_checks_capacity(vllm_config):
    builder = make_builder(vllm_config)
    with pytest.raises(ValueError, match="tree inputs hold 2 requests"):
        builder.set_tree_inputs(TreeAttentionInputs.allocate(2, 15, DEVICE))


def test_non_causal_metadata_is_rejected(vllm_config):
    step = Step([5], [4])
    with pytest.raises(ValueError, match="TREE_ATTN is causal-only"):
        make_builder(vllm_config).build(0, step.metadata.replace(causal=False))


def prefill_split(vllm_config, q_lens, monkeypatch, cudagraph_mode=None):
    builder = make_builder(vllm_config)
    builder.set_tree_inputs(
        TreeAttentionInputs.allocate(
            vllm_config.scheduler_config.max_num_seqs, 15, torch.device(DEVICE)
        )
    )
    monkeypatch.setattr(builder, "_fa_version", 3)  # as on a Hopper GPU
    if cudagraph_mode is not None:
        monkeypatch.setattr(
            vllm_config.compilation_config, "cudagraph_mode", cudagraph_mode
        )
    step = Step([10] * len(q_lens), q_lens)
    return builder.build(0, step.metadata)


def test_prefills_after_the_decodes_go_to_flash_attn(vllm_config, monkeypatch):
    md = prefill_split(vllm_config, [16, 16, 1, 40, 70], monkeypatch)
    assert md.kernel_rows.num_tokens == 33 and md.kernel_rows.seq_lens.shape == (3,)
    assert md.kernel_rows.tree_mask.shape[0] == 3
    prefill = md.prefill_rows
    assert (prefill.token_start, prefill.token_end) == (33, 143)
    assert prefill.query_start_loc.tolist() == [0, 40, 110]
    assert prefill.seq_lens.tolist() == [50, 80]


def test_tree_rows_never_reach_flash_attn(vllm_config, monkeypatch):
    # Unsorted batch: a tree-sized row after a prefill keeps everything in the
    # tree kernel.
    md = prefill_split(vllm_config, [16, 40, 16], monkeypatch)
    assert md.prefill_rows is None and md.kernel_rows.num_tokens == 72


def test_full_cudagraph_mixed_batches_stay_in_the_kernel(vllm_config, monkeypatch):
    md = prefill_split(vllm_config, [16, 40], monkeypatch, CUDAGraphMode.FULL)
    assert md.prefill_rows is None and md.kernel_rows.num_tokens == 56
    md = prefill_split(
        vllm_config, [16, 40], monkeypatch, CUDAGraphMode.FULL_AND_PIECEWISE
    )
    assert md.prefill_rows is not None


@needs_gpu
def test_mixed_batch_with_flash_attn_prefills(vllm_config):
    budget = 15
    builder = make_builder(vllm_config)
    inputs = TreeAttentionInputs.allocate(
        vllm_config.scheduler_config.max_num_seqs, budget, torch.device(DEVICE)
    )
    builder.set_tree_inputs(inputs)
    trees = [random_tree("heap", budget, seed=1), None, None, None]
    write_trees(inputs, trees)
    q_lens, ctx_lens = [16, 1, 300, 1000], [500, 1000, 0, 64]
    step = Step(ctx_lens, q_lens)
    attn_metadata, out = step.forward(builder, make_impl())
    if builder._fa_version is not None:
        assert attn_metadata.prefill_rows.token_start == 17
    visibility = [tree_visibility(trees[0].parent_ids[0])] + [
        causal_visibility(q) for q in q_lens[1:]
    ]
    torch.testing.assert_close(
        out.float(), step.reference(visibility), **TOLERANCE[DTYPE]
    )


# ----------------------------------------------------------------- plain steps


class FlashBuilderStub:
    """FLASH_ATTN's builder where a GPU has one: records the batches it builds."""

    def __init__(self):
        self.built = []

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        self.built.append(common_attn_metadata)
        cm = common_attn_metadata
        return FlashAttentionMetadata(
            num_actual_tokens=cm.num_actual_tokens,
            max_query_len=cm.max_query_len,
            query_start_loc=cm.query_start_loc,
            max_seq_len=cm.max_seq_len,
            seq_lens=cm.seq_lens,
            block_table=cm.block_table_tensor,
            slot_mapping=cm.slot_mapping,
            use_cascade=False,
            common_prefix_len=0,
            cu_prefix_query_lens=None,
            prefix_kv_lens=None,
            suffix_kv_lens=None,
        )


def flash_builder(vllm_config, monkeypatch, cudagraph_mode=None):
    """A builder as on a Hopper GPU (FlashAttention 3 available), tree inputs
    bound, FLASH_ATTN's builder stubbed."""
    builder = make_builder(vllm_config)
    inputs = TreeAttentionInputs.allocate(
        vllm_config.scheduler_config.max_num_seqs, 15, torch.device(DEVICE)
    )
    builder.set_tree_inputs(inputs)
    monkeypatch.setattr(builder, "_fa_version", 3)
    monkeypatch.setattr(builder, "_flash", FlashBuilderStub())
    if cudagraph_mode is not None:
        monkeypatch.setattr(
            vllm_config.compilation_config, "cudagraph_mode", cudagraph_mode
        )
    return builder, inputs


@pytest.mark.parametrize(
    "cudagraph_mode",
    [None, CUDAGraphMode.FULL_AND_PIECEWISE, CUDAGraphMode.FULL_DECODE_ONLY],
)
def test_single_token_batches_go_whole_to_flash_attn(
    vllm_config, monkeypatch, cudagraph_mode
):
    """A plain decode step (every query one token) holds no tree row: its
    metadata and kernel are FLASH_ATTN's, as without speculation, even where
    the speculator left trees in the buffers (a single-token decode graph is
    only ever replayed by single-token batches)."""
    builder, inputs = flash_builder(vllm_config, monkeypatch, cudagraph_mode)
    inputs.is_tree.fill_(1)
    step = Step([100, 33, 7, 2000], [1, 1, 1, 1])
    md = builder.build(0, step.metadata)
    assert isinstance(md, FlashAttentionMetadata)
    assert builder._flash.built == [step.metadata]
    # Tree-sized rows stay in the kernel while the step may hold trees.
    md = builder.build(0, Step([100, 33], [16, 1]).metadata)
    assert isinstance(md, TreeAttentionMetadata) and len(builder._flash.built) == 1


def test_draft_free_steps_go_whole_to_flash_attn(vllm_config, monkeypatch):
    """A step the speculator marks draft-free (prompts next to plain decodes)
    is one FlashAttention call, prompts included."""
    builder, inputs = flash_builder(vllm_config, monkeypatch)
    step = Step([10, 10, 10], [1, 16, 300])
    assert isinstance(builder.build(0, step.metadata), TreeAttentionMetadata)
    inputs.has_tree_rows = False
    md = builder.build(0, step.metadata)
    assert isinstance(md, FlashAttentionMetadata) and md.max_query_len == 300


def test_full_cudagraph_mixed_batches_never_go_to_flash_attn(vllm_config, monkeypatch):
    """Where mixed batches are captured in full graphs, a single-token batch
    and a tree batch of as many tokens replay the same graph: the kernel serves
    every batch there."""
    builder, inputs = flash_builder(vllm_config, monkeypatch, CUDAGraphMode.FULL)
    inputs.has_tree_rows = False
    for q_lens in ([1, 1, 1], [1, 16]):
        md = builder.build(0, Step([10] * len(q_lens), q_lens).metadata)
        assert isinstance(md, TreeAttentionMetadata)
    assert builder._flash.built == []


def test_without_flash_attn_the_kernel_serves_plain_steps(vllm_config):
    # CPU (and GPUs without FlashAttention): no FLASH_ATTN builder at all.
    builder = make_builder(vllm_config)
    assert builder._flash is None
    q_lens, ctx_lens = [1, 1, 1], [100, 33, 7]
    step = Step(ctx_lens, q_lens)
    attn_metadata, out = step.forward(builder, make_impl())
    assert isinstance(attn_metadata, TreeAttentionMetadata)
    ref = step.reference([causal_visibility(q) for q in q_lens])
    torch.testing.assert_close(out.float(), ref, **TOLERANCE[DTYPE])


def test_impl_runs_flash_attn_metadata_through_flash_attn(vllm_config, monkeypatch):
    """FLASH_ATTN's metadata goes to FLASH_ATTN's impl, and no tree kernel
    is launched for it."""
    from vllm.v1.attention.backends import tree_attn

    builder, _ = flash_builder(vllm_config, monkeypatch)
    impl = make_impl()
    calls = []

    class FlashImplStub:
        def forward(self, layer, q, k, v, kv_cache, attn_metadata, output):
            calls.append(attn_metadata)
            return output.fill_(2.0)

    def no_tree_kernel(*args, **kwargs):
        raise AssertionError("tree kernel launched for a plain step")

    monkeypatch.setattr(impl, "_flash", FlashImplStub())
    monkeypatch.setattr(tree_attn, "tree_attention", no_tree_kernel)
    step = Step([100, 33], [1, 1])
    md, out = step.forward(builder, impl)
    assert calls == [md] and bool((out == 2.0).all())
