# SPDX-License-Identifier: Apache-2.0
"""Batched GPU construction of DDTree draft trees from DFlash per-position logits.

DDTree (Ringel & Romano, "Accelerating Speculative Decoding with Block Diffusion Draft
Trees", 2026) drafts one block with a DFlash block-diffusion drafter, which yields
independent per-position distributions q_1..q_D. The surrogate probability of a prefix
y_1..y_d is prod_i q_i(y_i), and the expected acceptance length of a tree is the sum
of its nodes' probabilities, so the best tree of ``budget`` nodes is the set of the
``budget`` most probable prefixes. The paper pops a heap on the CPU; here the same
node set is found on the GPU with fixed shapes and no host sync.
"""

from dataclasses import dataclass

import torch

# Tree layout (shared with the tree attention backend and the tree sampler):
# tree token 0 is the root (the previous step's bonus token) and tree token i >= 1 is
# node i. Row i of the attention mask has bit (j % 32) of word (j // 32) set iff tree
# token j is an ancestor of tree token i or i itself.
MASK_WORD_BITS = 32


def num_mask_words(budget: int) -> int:
    """int32 words per mask row for a tree of ``budget`` nodes plus the root."""
    return (budget + 1 + MASK_WORD_BITS - 1) // MASK_WORD_BITS


@dataclass
class DDTree:
    """Draft trees of a batch, one per request, nodes in best-first order.

    Node order is canonical: higher surrogate probability first, parents before
    children, so the first b nodes of a tree form the best tree of budget b. A
    request whose drafter offers fewer than ``budget`` prefixes of nonzero
    probability gets padding nodes: token -1, parent 0 (root), depth 0.
    """

    # [num_reqs, budget] int64; -1 on padding nodes.
    token_ids: torch.Tensor
    # [num_reqs, budget] int32; 0 = root, i = node i (1-based), always < own index.
    parent_ids: torch.Tensor
    # [num_reqs, budget] int32; 1..depth, 0 on padding nodes.
    depths: torch.Tensor
    # [num_reqs, budget + 1, num_mask_words(budget)] int32, bit-packed
    # ancestor-or-self mask over [root, node_1, ..., node_budget].
    attn_mask: torch.Tensor
    # [num_reqs] int32; number of real (non-padding) nodes.
    num_nodes: torch.Tensor

    @property
    def budget(self) -> int:
        return self.token_ids.shape[1]
