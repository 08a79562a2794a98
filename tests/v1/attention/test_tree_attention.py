# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Tree attention kernel vs. a float32 torch reference.

The differential check: each tree node's output equals plain causal attention
over the committed prefix plus that node's root-to-node path, where the path is
walked from the tree's parent array (never from the bit-packed mask the kernel
reads). On the CPU the kernel runs in the Triton interpreter at small sizes; the
same tests run the full grid of shapes on a GPU.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.v1.ddtree_reference import build_ddtree_reference, tree_from_parents
from vllm.v1.attention.ops import triton_tree_attention as tta
from vllm.v1.attention.ops.triton_tree_attention import (
    TreeAttentionConfig,
    TreeAttentionVariant,
    plan_tree_attention,
    tree_attention,
    tree_attention_variants,
    warm_up_tree_attention,
)
from vllm.v1.spec_decode.dflash_tree_builder import DDTree

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
TOLERANCE = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.float16: dict(atol=3e-3, rtol=3e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}


# ----------------------------------------------------------------- reference


def tree_visibility(parent_ids: torch.Tensor) -> torch.Tensor:
    """[budget] parents (0 = root, 1-based) -> [budget + 1, budget + 1] bool:
    entry (i, j) is True iff tree token j is on the root-to-i path."""
    parents = [0] + parent_ids.tolist()
    num = len(parents)
    visible = torch.zeros(num, num, dtype=torch.bool)
    for i in range(num):
        node = i
        visible[i, 0] = True
        while node != 0:
            visible[i, node] = True
            node = parents[node]
    return visible


def causal_visibility(q_len: int) -> torch.Tensor:
    return torch.ones(q_len, q_len, dtype=torch.bool).tril()


def reference_attention(
    q,
    key_cache,
    value_cache,
    query_start_loc,
    seq_lens,
    block_table,
    scale,
    new_token_visibility: list[torch.Tensor],
):
    """Float32 attention: row i of request r sees every committed token and the
    new tokens j with new_token_visibility[r][i, j] (a row that sees no key
    gives 0)."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    num_q_heads, block_size = q.shape[1], key_cache.shape[1]
    group = num_q_heads // key_cache.shape[2]
    for r, visible_new in enumerate(new_token_visibility):
        start, end = int(query_start_loc[r]), int(query_start_loc[r + 1])
        q_len, seq_len = end - start, int(seq_lens[r])
        if q_len == 0:
            continue
        ctx_len = seq_len - q_len
        pos = torch.arange(seq_len, device=q.device)
        blocks = block_table[r, pos // block_size].long()
        # [seq_len, num_q_heads, head_size]
        k = key_cache[blocks, pos % block_size].float().repeat_interleave(group, 1)
        v = value_cache[blocks, pos % block_size].float().repeat_interleave(group, 1)
        visible = torch.zeros(q_len, seq_len, dtype=torch.bool)
        visible[:, :ctx_len] = True
        visible[:, ctx_len:] = visible_new
        scores = torch.einsum("qhd,khd->hqk", q[start:end].float(), k) * scale
        scores.masked_fill_(~visible.to(q.device)[None], float("-inf"))
        probs = scores.softmax(-1).nan_to_num(0.0)  # rows that see nothing: 0
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, v)
    return out


# ----------------------------------------------------------------- batches


class Batch:
    """Random paged KV cache (vLLM 0.26 FLASH_ATTN layout) and queries."""

    def __init__(
        self,
        ctx_lens,
        q_lens,
        num_q_heads,
        num_kv_heads,
        head_size,
        block_size,
        dtype,
        seed=0,
    ):
        gen = torch.Generator().manual_seed(seed)
        seq_lens = [c + q for c, q in zip(ctx_lens, q_lens)]
        blocks_per_req = [-(-s // block_size) for s in seq_lens]
        max_blocks = max(blocks_per_req)
        num_blocks = sum(blocks_per_req) + 3
        # Logical [num_blocks, num_kv_heads, block_size, 2 * head_size] over
        # physical [num_blocks, block_size, num_kv_heads, 2 * head_size].
        kv = (
            torch.randn(
                num_blocks, block_size, num_kv_heads, 2 * head_size, generator=gen
            )
            .to(dtype)
            .to(DEVICE)
        )
        self.kv_cache = kv.permute(0, 2, 1, 3)
        self.key_cache, self.value_cache = self.kv_cache.transpose(1, 2).split(
            head_size, -1
        )
        # Scattered pages; unused table entries point at a real block.
        perm = torch.randperm(num_blocks, generator=gen)
        table = torch.zeros(len(q_lens), max_blocks, dtype=torch.int32)
        used = 0
        for r, n in enumerate(blocks_per_req):
            table[r, :n] = perm[used : used + n]
            used += n
        self.block_table = table.to(DEVICE)
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
        self.query_start_loc = torch.tensor(
            [0] + torch.tensor(q_lens).cumsum(0).tolist(),
            dtype=torch.int32,
            device=DEVICE,
        )
        self.q = (
            torch.randn(sum(q_lens), num_q_heads, head_size, generator=gen)
            .to(dtype)
            .to(DEVICE)
        )
        self.scale = head_size**-0.5

    def _operands(self, out):
        """The kernels' leading arguments: query, caches, output, layout, scale."""
        return (
            self.q,
            self.key_cache,
            self.value_cache,
            out,
            self.query_start_loc,
            self.seq_lens,
            self.block_table,
            self.scale,
        )

    def run(
        self,
        tree_mask=None,
        is_tree=None,
        num_splits=None,
        out=None,
        config=None,
    ):
        if out is None:
            out = torch.full_like(self.q, float("nan"))
        return tree_attention(
            *self._operands(out),
            tree_mask=tree_mask,
            is_tree=is_tree,
            num_splits=num_splits,
            config=config,
        )

    def reference(self, visibility, **kwargs):
        return reference_attention(
            self.q,
            self.key_cache,
            self.value_cache,
            self.query_start_loc,
            self.seq_lens,
            self.block_table,
            self.scale,
            visibility,
            **kwargs,
        )


def random_tree(kind: str, budget: int, seed: int) -> DDTree:
    gen = torch.Generator().manual_seed(seed)
    if kind == "heap":
        logits = 3 * torch.randn(1, 15, 40, generator=gen)
        return build_ddtree_reference(logits, budget)
    if kind == "parents":
        parents = [
            int(torch.randint(0, i + 1, (1,), generator=gen)) for i in range(budget)
        ]
        return tree_from_parents(torch.arange(budget)[None], [parents])
    assert kind == "chain"
    return tree_from_parents(torch.arange(budget)[None], [list(range(budget))])


def pack_masks(
    trees: list[DDTree | None], q_lens: list[int], before: list[int] | None = None
):
    """Batch tree masks into one [num_reqs, max_tree_len, num_words] buffer;
    ``before[r]`` causal rows precede request r's root (``is_tree = 1 + s``)."""
    max_len = max([t.budget + 1 for t in trees if t is not None] + [1])
    words = max([t.attn_mask.shape[2] for t in trees if t is not None] + [1])
    mask = torch.zeros(len(trees), max_len, words, dtype=torch.int32)
    is_tree = torch.zeros(len(trees), dtype=torch.int32)
    for r, tree in enumerate(trees):
        if tree is not None:
            m = tree.attn_mask[0]
            mask[r, : m.shape[0], : m.shape[1]] = m
            is_tree[r] = 1 + (before[r] if before else 0)
    return mask.to(DEVICE), is_tree.to(DEVICE)


def visibilities(trees, q_lens, before=None):
    """Row i of a request sees new token j: causally, except among the tree's
    rows (after ``before[r]`` causal rows), which follow the tree's paths."""
    out = []
    for r, (t, q) in enumerate(zip(trees, q_lens)):
        visible = causal_visibility(q)
        if t is not None:
            s = before[r] if before else 0
            visible[s:, s:] = tree_visibility(t.parent_ids[0])[: q - s, : q - s]
        out.append(visible)
    return out


def check_trees(
    ctx_lens,
    trees,
    q_lens,
    num_q_heads,
    num_kv_heads,
    head_size,
    block_size,
    dtype,
    num_splits=None,
    seed=0,
    config=None,
):
    batch = Batch(
        ctx_lens, q_lens, num_q_heads, num_kv_heads, head_size, block_size, dtype, seed
    )
    mask, is_tree = pack_masks(trees, q_lens)
    out = batch.run(mask, is_tree, num_splits=num_splits, config=config)
    ref = batch.reference(visibilities(trees, q_lens))
    torch.testing.assert_close(out.float(), ref, **TOLERANCE[dtype])
    return batch, out


# ----------------------------------------------------------------- tests

# (head_size, block_size, dtype, num_q_heads, num_kv_heads)
CPU_SHAPES = [
    (64, 16, torch.float32, 4, 2),
    (128, 32, torch.float16, 6, 2),
    (256, 64, torch.float16, 2, 1),
    (80, 16, torch.float16, 8, 8),
]
GPU_SHAPES = [
    (hs, bs, dt, 32, 8)
    for hs in (64, 128, 256)
    for bs in (16, 32, 64)
    for dt in (torch.bfloat16, torch.float16)
] + [(128, 16, torch.bfloat16, 28, 4), (128, 16, torch.bfloat16, 16, 16)]


@pytest.mark.parametrize("kind", ["heap", "parents"])
@pytest.mark.parametrize("shape", CPU_SHAPES, ids=str)
def test_tree_nodes_equal_path_attention_cpu(kind, shape):
    """Three requests with different contexts and trees (budgets 1, 15, 63)."""
    head_size, block_size, dtype, hq, hkv = shape
    budgets, ctx_lens = [15, 1, 63], [1000, 17, 1]
    if head_size >= 128:  # keep the interpreter quick
        budgets, ctx_lens = [15, 1, 40], [200, 17, 1]
    trees = [random_tree(kind, b, seed=i) for i, b in enumerate(budgets)]
    q_lens = [b + 1 for b in budgets]
    check_trees(
        ctx_lens, trees, q_lens, hq, hkv, head_size, block_size, dtype, num_splits=4
    )


def test_budget_128_cpu():
    trees = [random_tree("heap", 128, seed=1), random_tree("parents", 128, seed=2)]
    check_trees([300, 17], trees, [129, 129], 4, 2, 64, 32, torch.float16, num_splits=2)


@needs_gpu
@pytest.mark.parametrize("kind", ["heap", "parents"])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
def test_tree_nodes_equal_path_attention_gpu(kind, shape):
    head_size, block_size, dtype, hq, hkv = shape
    budgets = [1, 15, 63, 128, 512]
    ctx_lens = [1000, 17, 1, 4097, 1000]
    trees = [random_tree(kind, b, seed=i) for i, b in enumerate(budgets)]
    q_lens = [b + 1 for b in budgets]
    check_trees(ctx_lens, trees, q_lens, hq, hkv, head_size, block_size, dtype)


@pytest.mark.parametrize("budget", [1, 15, 63])
def test_chain_tree_equals_causal(budget):
    """A chain-shaped tree gives exactly the causal rows, bit for bit."""
    ctx_lens, q_lens = [33, 300], [budget + 1, budget + 1]
    chain = random_tree("chain", budget, seed=0)
    batch = Batch(ctx_lens, q_lens, 4, 2, 64, 16, torch.float16)
    mask, is_tree = pack_masks([chain, chain], q_lens)
    as_tree = batch.run(mask, is_tree, num_splits=4)
    causal = batch.run(num_splits=4)
    flagged_off = batch.run(mask, torch.zeros_like(is_tree), num_splits=4)
    assert torch.equal(as_tree, causal)
    assert torch.equal(flagged_off, causal)
    assert torch.equal(batch.run(mask, is_tree, num_splits=4), as_tree)
    ref = batch.reference([causal_visibility(q) for q in q_lens])
    torch.testing.assert_close(causal.float(), ref, **TOLERANCE[torch.float16])


def test_mixed_batch_cpu():
    """Tree rows, a trimmed tree, plain decodes and (chunked) prefills at once."""
    tree = random_tree("heap", 15, seed=3)
    big = random_tree("parents", 40, seed=4)
    trees = [tree, big, None, None, None, None]
    q_lens = [16, 23, 1, 1, 37, 70]  # big tree trimmed to its first 22 nodes
    ctx_lens = [50, 300, 1, 129, 0, 90]
    check_trees(ctx_lens, trees, q_lens, 4, 2, 64, 16, torch.float32, num_splits=2)


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mixed_batch_gpu(dtype):
    budget = 128
    trees = [random_tree("heap", budget, seed=s) for s in range(3)]
    trees += [None] * 4 + [random_tree("parents", 512, seed=9)]
    q_lens = [129, 129, 60, 1, 1, 2048, 300, 200]
    ctx_lens = [4096, 17, 1000, 1, 8000, 0, 5000, 1000]
    check_trees(ctx_lens, trees, q_lens, 32, 8, 128, 16, dtype)


# Tile shapes of the kind bench_tree_attn.py --configs sweeps; k32 splits a
# 300-key context into 8 chunks of 64, the last three empty, so the tail block
# lands on a split before the last one.
CPU_CONFIGS = [
    TreeAttentionConfig(
        block_m=16, block_n=32, num_warps=4, num_stages=1, min_split_keys=32
    ),
    TreeAttentionConfig(
        block_m=32, block_n=64, num_warps=4, num_stages=5, min_split_keys=32
    ),
    TreeAttentionConfig(
        block_m=64, block_n=128, num_warps=8, num_stages=3, min_split_keys=32
    ),
]


@pytest.mark.parametrize("config", CPU_CONFIGS, ids=str)
def test_explicit_configs_cpu(config):
    """Any tile shape gives the reference attention: trees whose masked blocks
    start mid-word (contexts not multiples of 32), causal rows, empty splits."""
    trees = [random_tree("heap", 70, seed=6), None, random_tree("parents", 9, seed=7)]
    q_lens, ctx_lens = [71, 5, 10], [45, 300, 1]
    check_trees(
        ctx_lens,
        trees,
        q_lens,
        2,
        1,
        32,
        16,
        torch.float32,
        num_splits=8,
        config=config,
    )


@pytest.mark.parametrize(
    "num_tokens,num_reqs,block_m,num_splits",
    [
        (16, 1, 64, 16),
        (129, 1, 128, 3),
        (513, 1, 128, 4),
        (129 * 64, 64, 128, 1),
        (1, 1, 16, 32),
        (64, 64, 16, 1),
    ],
)
def test_plan_fills_the_gpu(num_tokens, num_reqs, block_m, num_splits):
    """Qwen3-8B heads on 132 SMs: a chain at batch 1 splits its context 16 ways
    (the chunks hold >= 256 keys), a budget-128 tree 3 ways, big batches not."""
    plan = plan_tree_attention(num_tokens, num_reqs, 32, 8, 128, num_sms=132)
    assert (plan.config.block_m, plan.num_splits) == (block_m, num_splits)
    assert plan.block_q * plan.heads_padded == block_m


@pytest.mark.parametrize(
    "num_tokens,num_reqs,num_warps",
    # 16-token chains: batch 1 (8 tiles x 16 splits) and batch 8 (64 x 2) fit on
    # 132 SMs one program each -> 8 warps; batch 64 (512 tiles) -> 4 warps, two
    # programs per SM. 128-row tiles always get 8 warps.
    # Single-token decodes (16-row tiles) keep 4.
    [
        (16, 1, 8),
        (16 * 8, 8, 8),
        (16 * 64, 64, 4),
        (129, 1, 8),
        (129 * 64, 64, 8),
        (1, 1, 4),
        (64, 64, 4),
    ],
)
def test_plan_warps(num_tokens, num_reqs, num_warps):
    plan = plan_tree_attention(num_tokens, num_reqs, 32, 8, 128, num_sms=132)
    assert plan.config.num_warps == num_warps
    # An explicit config is launched as given.
    cfg = TreeAttentionConfig(block_m=64, block_n=64, num_warps=4, num_stages=5)
    plan = plan_tree_attention(
        num_tokens, num_reqs, 32, 8, 128, num_sms=132, config=cfg
    )
    assert plan.config.num_warps == 4


@pytest.mark.parametrize(
    "budget,tiles,rows_used",
    # (tree budget, query tiles per request, share of the tiles' rows holding
    # queries). A budget B verifies B + 1 tokens: one past a power of two opens a
    # tile for a single token (or doubles the tile), one below fills them.
    [
        (15, 1, 1.0),
        (16, 1, 17 / 32),
        (31, 1, 1.0),
        (32, 2, 33 / 64),
        (63, 2, 1.0),
        (64, 3, 65 / 96),
        (127, 4, 1.0),
        (128, 5, 129 / 160),
    ],
)
@pytest.mark.parametrize("batch", [1, 64])
def test_plan_tiles_per_tree(budget, tiles, rows_used, batch):
    """Qwen3-8B heads: the work of a tree step's attention is query tiles per
    request; budgets 2^k - 1 (auto's 15 and 31) waste no tile rows."""
    plan = plan_tree_attention(batch * (budget + 1), batch, 32, 8, 128, num_sms=132)
    assert -(-(budget + 1) // plan.block_q) == tiles
    assert (budget + 1) / (tiles * plan.block_q) == pytest.approx(rows_used)


# The tile shapes bench_tree_attn.py sweeps by default, at full size.
GPU_CONFIGS = [
    TreeAttentionConfig(block_m=128, block_n=64, num_warps=8, num_stages=5),
    TreeAttentionConfig(block_m=128, block_n=64, num_warps=8, num_stages=7),
    TreeAttentionConfig(block_m=128, block_n=64, num_warps=8, num_stages=3),
    TreeAttentionConfig(block_m=128, block_n=32, num_warps=8, num_stages=5),
    TreeAttentionConfig(block_m=64, block_n=64, num_warps=4, num_stages=5),
    TreeAttentionConfig(block_m=64, block_n=64, num_warps=8, num_stages=5),
    TreeAttentionConfig(block_m=64, block_n=32, num_warps=4, num_stages=5),
    TreeAttentionConfig(block_m=128, block_n=128, num_warps=8, num_stages=3),
]


@needs_gpu
@pytest.mark.parametrize("config", GPU_CONFIGS, ids=str)
def test_explicit_configs_gpu(config):
    trees = [
        random_tree("heap", 128, seed=0),
        random_tree("parents", 512, seed=1),
        None,
        None,
        random_tree("heap", 15, seed=2),
    ]
    q_lens, ctx_lens = [129, 513, 16, 1, 16], [4097, 1000, 300, 2000, 0]
    cfg = config
    for num_splits in [None, 5]:
        check_trees(
            ctx_lens,
            trees,
            q_lens,
            32,
            8,
            128,
            16,
            torch.bfloat16,
            num_splits=num_splits,
            config=cfg,
        )


# Compiles the tile shape of a budget-128 tree (Qwen3-8B heads) for sm90 without
# a GPU (Triton needs no driver for that) and reports what the KV loop became.
SM90_PROBE = textwrap.dedent("""
    import re, sys, json
    import triton, triton.language as tl
    import vllm.triton_utils as tu
    tu.triton, tu.tl, tu.HAS_TRITON = triton, tl, True
    sys.path.insert(0, sys.argv[1])
    import conftest
    from triton.backends.compiler import GPUTarget
    from vllm.v1.attention.ops import triton_tree_attention as tta
    kernel = tta._tree_attention_kernel
    cfg = tta.plan_tree_attention(129, 1, 32, 8, 128, num_sms=132).config
    names = kernel.arg_names
    sig = {n: "i64" if n.startswith("stride") else "i32" for n in names}
    sig.update({n: "*i32" for n in names if n.endswith("_ptr")})
    sig.update({n: "*bf16" for n in ["out_ptr", "q_ptr", "k_cache_ptr",
                                     "v_cache_ptr"]})
    sig.update(part_out_ptr="*fp32", part_lse_ptr="*fp32", qk_scale="fp32")
    consts = dict(NUM_QUERIES_PER_KV=4, HEADS_PADDED=4, BLOCK_Q=cfg.block_m // 4,
                  BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, HEAD_SIZE=128,
                  HEAD_SIZE_PADDED=128, PAGE_SIZE=16,
                  MIN_SPLIT_KEYS=cfg.min_split_keys, HAS_TREE=True,
                  DOT_PRECISION="tf32")
    sig.update({n: "constexpr" for n in consts})
    # Pointers and static strides are 16-aligned at run time; Triton
    # specialises on that, and cp.async needs it.
    aligned = [n for n in names if n.endswith("_ptr") or n.startswith("stride_")
               and not n.startswith(("stride_bt", "stride_mask"))]
    src = triton.compiler.ASTSource(
        fn=kernel, signature=sig,
        constexprs={(names.index(n),): v for n, v in consts.items()},
        attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=cfg.num_warps,
                                    num_stages=cfg.num_stages))
    print(json.dumps(dict(
        wgmma=k.asm["ptx"].count("wgmma.mma_async"),
        waits=[int(n) for n in re.findall(r"async_wait .*?num = (\\d+)",
                                          k.asm["ttgir"])],
        shared=k.metadata.shared)))
""")


def test_sm90_kernel_uses_wgmma_and_prefetches_kv():
    """The KV loop runs on Hopper tensor cores (wgmma) with K/V blocks still in
    flight while a block is computed: the block-table load in front of them
    takes half of Triton's pipeline stages, so too few stages silently
    serialise loads and math."""
    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    result = subprocess.run(
        [sys.executable, "-c", SM90_PROBE, str(root)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    probe = json.loads(result.stdout.strip().splitlines()[-1])
    assert probe["wgmma"] > 0
    assert max(probe["waits"]) >= 3  # async copy groups left in flight
    assert probe["shared"] <= 227 * 1024


@pytest.mark.parametrize("num_splits", [2, 3, 8])
def test_split_kv_matches_single_pass(num_splits):
    trees = [random_tree("heap", 15, seed=5), None]
    q_lens, ctx_lens = [16, 1], [1000, 777]
    batch, one_pass = check_trees(
        ctx_lens, trees, q_lens, 4, 2, 64, 16, torch.float32, num_splits=1
    )
    mask, is_tree = pack_masks(trees, q_lens)
    split = batch.run(mask, is_tree, num_splits=num_splits)
    torch.testing.assert_close(split, one_pass, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_splits", [2, 5, 32])
def test_splits_cut_through_the_new_keys(num_splits):
    """Splits take runs of whole key blocks over the committed and the new
    keys: a split may start inside a tree (its early rows then see none of its
    keys) or hold only new keys, and a request without context is split too."""
    trees = [random_tree("heap", 63, seed=3), random_tree("parents", 40, seed=4), None]
    q_lens, ctx_lens = [64, 41, 50], [10, 70, 0]
    config = TreeAttentionConfig(
        block_m=32, block_n=32, num_warps=4, num_stages=1, min_split_keys=32
    )
    # The first tree's last tile (rows 48..63 of 16-token tiles) sees keys
    # 0..73: three 32-key blocks, two runs at 2 splits and one block each from
    # 3 on, the last ones over new keys only; rows 48..53 see none of the last
    # split's keys, and the rows 16..31 tile none of its second block's.
    check_trees(
        ctx_lens, trees, q_lens, 4, 2, 64, 16, torch.float32, num_splits, config=config
    )


@pytest.mark.parametrize("mode", ["one pass", "splits"])
def test_tree_after_prompt_rows_in_the_same_step(mode):
    """A request whose step schedules prompt rows before its root (vLLM's
    scheduler builds none today; a ``num_computed_tokens`` rollback could):
    the prompt rows are causal, and tree row t reads mask row t, seeing the
    prompt rows and its own path. Mixed with ordinary trees and prefills."""

    kinds = ["heap", "parents", None, "heap", "parents"]
    nodes = [15, 40, 0, 5, 9]
    before = [5, 37, 0, 70, 0]
    # The 40-node tree verifies its first 22 nodes (an adaptive step's trim).
    rows = [b + 1 if b != 40 else 23 for b in nodes]
    q_lens = [p + (r if k else 30) for p, r, k in zip(before, rows, kinds)]
    ctx_lens = [50, 0, 9, 300, 17]
    trees = [
        None if k is None else random_tree(k, b, seed=i)
        for i, (k, b) in enumerate(zip(kinds, nodes))
    ]
    batch = Batch(ctx_lens, q_lens, 4, 2, 64, 16, torch.float32, seed=7)
    mask, is_tree = pack_masks(trees, q_lens, before)
    visible = visibilities(trees, q_lens, before)
    out = batch.run(mask, is_tree, num_splits=1 if mode == "one pass" else 4)
    ref = batch.reference(visible)
    torch.testing.assert_close(out.float(), ref, **TOLERANCE[torch.float32])
    # The shift matters: read from the request's first row (is_tree = 1), the
    # same masks give other outputs on the tree rows.
    unshifted = batch.run(mask, (is_tree > 0).to(is_tree.dtype)).float()
    num_rows = 0
    start = 0
    for q, p, k in zip(q_lens, before, kinds):
        if k is not None and p:
            assert not torch.allclose(
                unshifted[start + p : start + q], ref[start + p : start + q]
            )
            num_rows += q - p
        start += q
    print(f"{mode}: {num_rows} tree rows after prompt rows compared")
    assert num_rows >= 30


def test_padded_requests_and_tokens_left_alone():
    """CUDA-graph padding: trailing empty requests, tokens of no request."""
    batch = Batch([40, 9], [5, 1], 4, 2, 64, 16, torch.float32)
    qsl = batch.query_start_loc
    batch.query_start_loc = torch.cat([qsl, qsl[-1:], qsl[-1:]])
    batch.seq_lens = torch.cat([batch.seq_lens, batch.seq_lens.new_zeros(2)])
    batch.block_table = torch.cat([batch.block_table, batch.block_table[:2]])
    real = batch.q.shape[0]
    batch.q = torch.cat([batch.q, batch.q[:3]])
    out = batch.run(num_splits=2)
    assert out[real:].isnan().all()
    ref = batch.reference(
        [
            causal_visibility(5),
            causal_visibility(1),
            causal_visibility(0),
            causal_visibility(0),
        ]
    )
    torch.testing.assert_close(out[:real], ref[:real], **TOLERANCE[torch.float32])


def test_input_errors():
    batch = Batch([4], [2], 4, 2, 64, 16, torch.float32)
    out = torch.empty_like(batch.q)
    args = (batch.key_cache, batch.value_cache)
    tail = (batch.query_start_loc, batch.seq_lens, batch.block_table, 1.0)
    with pytest.raises(ValueError, match="KV cache dtype"):
        tree_attention(
            batch.q.half(), *[a.half() for a in args[:1]], args[1], out.half(), *tail
        )
    with pytest.raises(ValueError, match="do not fit"):
        tree_attention(batch.q[:, :3], *args, out[:, :3], *tail)
    with pytest.raises(ValueError, match="must be given together"):
        tree_attention(
            batch.q,
            *args,
            out,
            *tail,
            tree_mask=torch.zeros(1, 3, 1, dtype=torch.int32),
        )
    with pytest.raises(ValueError, match="tree_mask must be int32"):
        tree_attention(
            batch.q,
            *args,
            out,
            *tail,
            tree_mask=torch.zeros(1, 3, 1, dtype=torch.int64),
            is_tree=torch.ones(1, dtype=torch.int32),
        )


@needs_gpu
def test_int64_kv_offsets():
    """Pages past 2**31 elements into the cache are addressed correctly."""
    block_size, hkv, head_size = 16, 8, 128
    per_block = block_size * hkv * 2 * head_size
    num_blocks = (2**31 // per_block) + 64
    kv = torch.randn(
        num_blocks, block_size, hkv, 2 * head_size, device="cuda", dtype=torch.bfloat16
    )
    batch = Batch([100], [16], 32, hkv, head_size, block_size, torch.bfloat16)
    batch.kv_cache = kv.permute(0, 2, 1, 3)
    batch.key_cache, batch.value_cache = kv.split(head_size, -1)
    batch.block_table = torch.arange(
        num_blocks - 8, num_blocks, device="cuda", dtype=torch.int32
    )[None]
    out = batch.run()
    ref = batch.reference([causal_visibility(16)])
    torch.testing.assert_close(out.float(), ref, **TOLERANCE[torch.bfloat16])


@needs_gpu
def test_cuda_graph_replay_with_new_trees():
    """One capture serves later steps whose trees, contexts and pages differ."""
    budget, num_reqs = 63, 4
    q_lens = [budget + 1] * num_reqs
    batch = Batch([2000] * num_reqs, q_lens, 32, 8, 128, 16, torch.bfloat16)
    trees = [random_tree("heap", budget, seed=s) for s in range(num_reqs)]
    mask, is_tree = pack_masks(trees, q_lens)
    out = torch.empty_like(batch.q)
    batch.seq_lens.fill_(64 + 1)
    batch.run(mask, is_tree, out=out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        batch.run(mask, is_tree, out=out)
    for step in range(3):
        new_trees = [
            random_tree("parents", budget, seed=10 * step + s) for s in range(num_reqs)
        ]
        new_mask, new_is_tree = pack_masks(new_trees, q_lens)
        mask.copy_(new_mask)
        is_tree.copy_(new_is_tree)
        is_tree[step] = 0  # one causal chain among the trees
        new_seq = torch.randint(budget + 1, 2000 + budget + 1, (num_reqs,))
        batch.seq_lens.copy_(new_seq.to(torch.int32))
        batch.q.normal_()
        graph.replay()
        vis = visibilities(new_trees, q_lens)
        vis[step] = causal_visibility(budget + 1)
        torch.testing.assert_close(
            out.float(), batch.reference(vis), **TOLERANCE[torch.bfloat16]
        )


# ------------------------------------------------- start-up warm-up (variants)


def _variant_key(plan) -> tuple:
    return (
        plan.config,
        TreeAttentionVariant(plan.config, plan.num_splits).splits_padded,
    )


def _plans_of_every_step(listed, heads, head_size, num_sms, max_reqs, max_tokens):
    """Plan every step of 1..max_reqs requests and up to max_tokens tokens,
    asserting each plan's variant is listed; returns the variants reached and
    the number of steps."""
    reached, steps = set(), 0
    for num_reqs in range(1, max_reqs + 1):
        for num_tokens in range(num_reqs, max_tokens + 1):
            plan = plan_tree_attention.__wrapped__(
                num_tokens, num_reqs, *heads, head_size, num_sms
            )
            key = _variant_key(plan)
            assert key in listed, (num_tokens, num_reqs, key)
            reached.add(key)
            steps += 1
    return reached, steps


@pytest.mark.parametrize(
    "heads,head_size,num_sms,max_reqs,max_tokens",
    [
        ((4, 2), 64, 8, 24, 600),
        ((4, 2), 64, 132, 24, 600),
        ((32, 8), 128, 16, 24, 600),
        ((32, 8), 128, 132, 24, 600),
        # Steps whose average query length needs fewer tokens than
        # requests x average (n = 46 at 185 tokens; n = 27 at 865).
        ((28, 4), 128, 108, 64, 205),
        ((2, 1), 64, 66, 32, 888),
    ],
)
def test_variants_are_exactly_the_plans_of_every_step(
    heads, head_size, num_sms, max_reqs, max_tokens
):
    """Brute force over every step within the limits: each plan's variant is
    listed, and each listed variant is some step's plan."""
    listed = {
        (v.config, v.splits_padded)
        for v in tree_attention_variants(
            *heads, head_size, num_sms, max_reqs, max_tokens
        )
    }
    reached, steps = _plans_of_every_step(
        listed, heads, head_size, num_sms, max_reqs, max_tokens
    )
    print(f"{steps} steps, {len(listed)} variants")
    assert steps >= 8_000
    assert reached == listed
    assert len(listed) >= 4


def test_variants_cover_sampled_large_steps():
    """Qwen3-8B heads on an H200, vLLM's default batch limits: random steps of
    up to 256 requests and 16384 tokens all plan a listed variant."""
    listed = {
        (v.config, v.splits_padded)
        for v in tree_attention_variants(32, 8, 128, 132, 256, 16384)
    }
    gen = torch.Generator().manual_seed(0)
    checked = 0
    for _ in range(4000):
        num_reqs = int(torch.randint(1, 257, (), generator=gen))
        num_tokens = int(torch.randint(num_reqs, 16385, (), generator=gen))
        if torch.rand((), generator=gen) < 0.5:  # trees and short rows
            num_tokens = min(num_tokens, num_reqs * 129)
        plan = plan_tree_attention.__wrapped__(num_tokens, num_reqs, 32, 8, 128, 132)
        assert _variant_key(plan) in listed, (num_tokens, num_reqs)
        checked += 1
    assert checked == 4000


def test_warm_up_launches_every_variant_like_a_step(monkeypatch):
    """Each variant is launched once, with its config and split count, on the
    caller's KV cache, tree buffers and block-table width."""
    calls = []

    def record(q, key_cache, value_cache, out, qsl, seq_lens, bt, scale, **kw):
        calls.append((q.shape, key_cache, value_cache, bt.shape, kw))
        return out

    monkeypatch.setattr(tta, "tree_attention", record)
    cfg = TreeAttentionConfig(block_m=32, block_n=64, num_warps=4)
    other = TreeAttentionConfig(block_m=32, block_n=32, num_warps=4, num_stages=1)
    variants = [
        TreeAttentionVariant(cfg, 1),
        TreeAttentionVariant(cfg, 3),
        TreeAttentionVariant(other, 1),
    ]
    kv = torch.zeros(3, 16, 2, 2 * 64, dtype=torch.float16)
    key_cache, value_cache = kv.split(64, dim=-1)
    mask = torch.zeros(8, 7, 1, dtype=torch.int32)
    is_tree = torch.zeros(8, dtype=torch.int32)
    q_like = torch.empty(1, 4, 64, dtype=torch.float16)
    n = warm_up_tree_attention(
        variants, q_like, key_cache, value_cache, 9, mask, is_tree, 0.125
    )
    assert n == 3 and [c[4]["num_splits"] for c in calls] == [1, 3, 1]
    assert [c[4]["config"] for c in calls] == [cfg, cfg, other]
    for shape, k, v, bt_shape, kw in calls:
        assert shape == (16, 4, 64)
        assert k is key_cache and v is value_cache and bt_shape == (1, 9)
        assert kw["tree_mask"].data_ptr() == mask.data_ptr()
        assert kw["tree_mask"].shape == (1, 7, 1) and kw["is_tree"].shape == (1,)


@needs_gpu
def test_warm_up_leaves_nothing_to_compile_gpu():
    """On the GPU: once the variants of every step within small limits are
    warmed up, steps of all request counts and query lengths within those
    limits add no binary to Triton's kernel caches."""
    from vllm.v1.attention.backends.tree_attn import TreeAttentionInputs

    max_reqs, max_tokens, dtype = 8, 160, torch.bfloat16
    num_q, num_kv, head, block, width = 32, 8, 128, 16, 16
    variants = tree_attention_variants(
        num_q,
        num_kv,
        head,
        tta.num_sms(torch.device(DEVICE)),
        max_reqs,
        max_tokens,
    )
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    kv = torch.randn(
        max_reqs * width, block, num_kv, 2 * head, generator=gen, device=DEVICE
    ).to(dtype)
    key_cache, value_cache = kv.split(head, dim=-1)
    inputs = TreeAttentionInputs.allocate(max_reqs, 31, torch.device(DEVICE))
    q_like = torch.empty(1, num_q, head, dtype=dtype, device=DEVICE)
    warm_up_tree_attention(
        variants,
        q_like,
        key_cache,
        value_cache,
        width,
        inputs.attn_mask,
        inputs.is_tree,
        head**-0.5,
    )
    kernels = (tta._tree_attention_kernel, tta._merge_splits_kernel)

    def binaries() -> int:
        return sum(len(c[0]) for k in kernels for c in k.device_caches.values())

    before, steps = binaries(), 0
    assert before >= len(variants) // 2
    for num_reqs in range(1, max_reqs + 1):
        for q_len in (1, 2, 7, 16, 17, 20):
            num_tokens = num_reqs * q_len
            if num_tokens > max_tokens:
                continue
            q = torch.randn(num_tokens, num_q, head, generator=gen, device=DEVICE)
            q = q.to(dtype)
            qsl = torch.arange(
                0, num_tokens + 1, q_len, dtype=torch.int32, device=DEVICE
            )
            seq_lens = torch.full(
                (num_reqs,), 40 + q_len, dtype=torch.int32, device=DEVICE
            )
            table = torch.arange(
                num_reqs * width, dtype=torch.int32, device=DEVICE
            ).view(num_reqs, width)
            tree_attention(
                q,
                key_cache,
                value_cache,
                torch.empty_like(q),
                qsl,
                seq_lens,
                table,
                head**-0.5,
                inputs.attn_mask[:num_reqs],
                inputs.is_tree[:num_reqs],
            )
            steps += 1
    torch.cuda.synchronize()
    print(f"{steps} launches over {len(variants)} warmed-up variants")
    assert steps >= 40
    assert binaries() == before


def test_split_strides_do_not_select_variants():
    """The only kernel arguments that depend on a step's token count (the
    split buffers' log-sum-exp strides) are left unspecialized, so one warm-up
    token count compiles what every step needs. Checked on Triton's JIT
    function built from the kernels' source (the interpreter keeps no flags)."""
    from triton.runtime.jit import JITFunction

    for kernel, names, want in (
        (
            tta._tree_attention_kernel,
            tta._MAIN_UNSPECIALIZED,
            {"stride_pl_split"},
        ),
        (tta._merge_splits_kernel, tta._MERGE_UNSPECIALIZED, {"stride_pl_split"}),
    ):
        fn = getattr(kernel, "fn", kernel)
        jit = JITFunction(fn, do_not_specialize=names)
        unspecialized = {p.name for p in jit.params if p.do_not_specialize}
        assert want <= unspecialized == set(names), unspecialized


def test_warm_up_runs_the_kernel_and_reads_only():
    """The real kernels (the interpreter on the CPU) on a tiny cache: the warm-up
    runs, split or not, and leaves the KV cache and tree buffers unchanged."""
    gen = torch.Generator().manual_seed(0)
    dtype = torch.float16 if DEVICE == "cpu" else torch.bfloat16
    kv = torch.randn(3, 16, 2, 2 * 32, generator=gen).to(dtype).to(DEVICE)
    before = kv.clone()
    key_cache, value_cache = kv.split(32, dim=-1)
    mask = torch.ones(2, 5, 1, dtype=torch.int32, device=DEVICE)
    is_tree = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    cfg = TreeAttentionConfig(block_m=16, block_n=32, num_warps=4, num_stages=1)
    variants = [
        TreeAttentionVariant(cfg, 1),
        TreeAttentionVariant(cfg, 2),
    ]
    q_like = torch.empty(1, 4, 32, dtype=dtype, device=DEVICE)
    n = warm_up_tree_attention(
        variants, q_like, key_cache, value_cache, 4, mask, is_tree, 32**-0.5
    )
    assert n == 2
    assert torch.equal(kv, before)
    assert int(mask.sum()) == 10 and int(is_tree.sum()) == 0
