# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Layout of the bit-packed ancestor masks that TREE_ATTN reads.

A request's tree tokens are ``[root, node_1, ..., node_B]`` flattened
parent-before-child: tree token 0 is the root (the previous step's bonus token)
and tree token ``i >= 1`` is node ``i``. Row ``i`` of a request's mask is
``num_mask_words(B)`` int32 words; bit ``j % 32`` of word ``j // 32`` is set iff
tree token ``j`` is an ancestor of tree token ``i`` or ``i`` itself.

The attention kernel owns this layout; whoever builds trees (the DDTree drafter's
tree builder) and whoever copies masks into TREE_ATTN's buffers write it.
"""

MASK_WORD_BITS = 32


def num_mask_words(budget: int) -> int:
    """int32 words per mask row for a tree of ``budget`` nodes plus the root."""
    return (budget + 1 + MASK_WORD_BITS - 1) // MASK_WORD_BITS
