# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""vLLM's spec-decode counters for DDTree's adaptive budget.

vLLM counts a request's draft tokens as the slots the scheduler gave it. An
adaptive step verifies fewer: the worker's budget report
(``ddtree_adaptive.BudgetReport``, ``ModelRunnerOutput.ddtree_budget``) says how
many nodes per request the step verified, and the scheduler counts those.
(The per-position counters are sized by ``SpeculativeConfig.num_draft_positions``,
the drafter's depth for trees.)
"""


def verified_draft_tokens(
    num_draft_tokens: int, num_accepted_tokens: int, step_budget: int
) -> int:
    """The draft tokens to count for a request given ``num_draft_tokens``
    slots in a step that verified ``step_budget`` nodes per request on
    average: that many, or the accepted path's length where the batch-wide
    split gave the request more, never more than the slots. So the
    draft-token counter sums about the nodes verified, every accepted token
    counts, and a step that verified no tree (budget 0, nothing accepted)
    counts no draft."""
    return min(num_draft_tokens, max(step_budget, num_accepted_tokens))
