# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The pieces DDTree under tensor parallelism relies on, on one device.

Under TP every rank builds the tree from its own copy of the drafter's logits
and verifies it with its own heads, so the ranks agree only if (1) every rank's
builder sees the full-vocabulary logits, (2) the builder is deterministic: equal
logits give equal trees, bit for bit, ties and crowded rows included, and (3)
TREE_ATTN and the KV compaction on a rank's subset of the heads compute exactly
that subset of the full computation. The 2-GPU end-to-end check lives with the
issue (it needs two GPUs). CPU: the kernels in the Triton interpreter at small
sizes; a GPU adds the full vocabulary.
"""

import ast
from pathlib import Path

import pytest
import torch

from tests.v1.attention.test_tree_attention import Batch, pack_masks, random_tree
from tests.v1.attention.test_tree_kv_compaction import _batch, _kv_caches
from tests.v1.spec_decode.test_dflash_tree_builder import (
    _assert_same_tree,
    _crowded_logits,
    _random_logits,
    _tied_logits,
)
from vllm.v1.attention.ops.tree_kv_compaction import TreeKVCompactor
from vllm.v1.attention.ops.triton_tree_attention import tree_attention
from vllm.v1.spec_decode.dflash_tree_builder import build_ddtree

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
TP = 2


def test_drafter_logits_are_all_gathered_on_every_platform():
    """vLLM's LogitsProcessor all-gathers the vocabulary shards when the
    platform says ``use_all_gather()`` (else it gathers to rank 0 only and the
    other ranks get None). In vLLM 0.26 only the base Platform defines it, as
    True; a platform module overriding it would break DDTree under TP."""
    import vllm.platforms
    from vllm.model_executor.layers import logits_processor
    from vllm.platforms import current_platform
    from vllm.platforms.interface import Platform

    assert Platform.use_all_gather() is True
    assert current_platform.use_all_gather() is True
    # ... and the processor reads that flag to choose all-gather.
    source = Path(logits_processor.__file__).read_text()
    assert "self.use_all_gather = current_platform.use_all_gather()" in source
    folder = Path(vllm.platforms.__file__).parent
    overriding = []
    for path in sorted(folder.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name == "use_all_gather":
                overriding.append(path.name)
    assert overriding == ["interface.py"], overriding


def _logits(kind: str, shape: tuple[int, int, int]) -> torch.Tensor:
    if kind == "random":
        return _random_logits(*shape, seed=3, device="cpu")
    if kind == "tied":
        return _tied_logits(shape[0] * shape[1], shape[2]).reshape(shape)
    return _crowded_logits(shape, min(16, shape[2] // 8), seed=5)


BUILD_CASES = [((2, 15, 50), 16), ((2, 4, 1000), 32)]
if ON_GPU:
    BUILD_CASES += [((4, 15, 151936), 128), ((1, 15, 151936), 1024)]


@pytest.mark.parametrize("kind", ["random", "tied", "crowded"])
@pytest.mark.parametrize("shape,budget", BUILD_CASES, ids=str)
def test_builder_is_deterministic(kind, shape, budget):
    """Two builds on equal logits (two copies, as two ranks hold) agree bit for
    bit, and so does a third into reused output buffers. The interpreter runs
    programs one after another, so on the CPU this checks the code paths; on a
    GPU, where programs race, it checks that no result depends on their order."""
    logits = _logits(kind, shape).to(DEVICE)
    first = build_ddtree(logits.clone(), budget)
    second = build_ddtree(logits.clone(), budget)
    again = build_ddtree(logits.clone(), budget, out=second)
    for tree in (second, again):
        _assert_same_tree(tree, _cpu(first))
    nodes = int(first.num_nodes.sum())
    print(f"{kind} {shape} budget {budget}: {nodes} nodes compared")
    assert nodes >= shape[0]  # every request has at least one node


def _cpu(tree):
    return type(tree)(*(getattr(tree, f).cpu() for f in tree.__dataclass_fields__))


def _rank_cache(batch: Batch, heads: slice):
    """A rank's own KV cache: its KV heads in a cache allocated for them."""
    physical = batch.kv_cache.permute(0, 2, 1, 3)[:, :, heads].contiguous()
    kv_cache = physical.permute(0, 2, 1, 3)
    return kv_cache.transpose(1, 2).split(batch.q.shape[-1], -1)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_tree_attention_on_a_ranks_heads(num_splits):
    """Qwen3-8B's head ratio (4 query heads per KV head) over 2 ranks: each
    rank's output equals its heads' slice of the full output, exactly."""
    hq, hkv, head_size, block_size = 8, 4, 64, 16
    budgets, ctx_lens = [15, 1, 31], [300, 17, 1]
    trees = [random_tree("heap", b, seed=i) for i, b in enumerate(budgets)]
    q_lens = [b + 1 for b in budgets]
    batch = Batch(ctx_lens, q_lens, hq, hkv, head_size, block_size, torch.float16)
    mask, is_tree = pack_masks(trees, q_lens)
    full = batch.run(mask, is_tree, num_splits=num_splits)
    for rank in range(TP):
        q_heads = slice(rank * hq // TP, (rank + 1) * hq // TP)
        kv_heads = slice(rank * hkv // TP, (rank + 1) * hkv // TP)
        key_cache, value_cache = _rank_cache(batch, kv_heads)
        q = batch.q[:, q_heads].contiguous()
        out = torch.full_like(q, float("nan"))
        tree_attention(
            q,
            key_cache,
            value_cache,
            out,
            batch.query_start_loc,
            batch.seq_lens,
            batch.block_table,
            batch.scale,
            tree_mask=mask,
            is_tree=is_tree,
            num_splits=num_splits,
        )
        assert torch.equal(out, full[:, q_heads]), f"rank {rank}"


def test_kv_compaction_on_a_ranks_heads():
    """Compacting a rank's cache (its KV heads only) gives that slice of the
    full cache compacted, bit for bit."""
    gen = torch.Generator().manual_seed(0)
    block_size, heads, head_size = 16, 8, 64
    caches = _kv_caches(2, 16, block_size, heads, head_size, torch.float16, "nhd")
    slots, qsl, accepted, num_accepted = _batch(
        [9, 20, 1], [3, 5, 1], block_size, 16, [0, block_size - 3, 4], gen
    )
    per_rank = heads // TP
    ranks = [
        [c[:, :, :, r * per_rank : (r + 1) * per_rank].clone() for c in caches]
        for r in range(TP)
    ]
    args = (
        slots.to(DEVICE),
        qsl.to(DEVICE),
        accepted.to(DEVICE),
        num_accepted.to(DEVICE),
    )
    TreeKVCompactor(caches)(*args)
    for r, rank_caches in enumerate(ranks):
        TreeKVCompactor(rank_caches)(*args)
        for full, part in zip(caches, rank_caches):
            want = full[:, :, :, r * per_rank : (r + 1) * per_rank]
            assert torch.equal(part, want), f"rank {r}"
    assert int(num_accepted.sum()) == 9  # slots moved per layer and rank
