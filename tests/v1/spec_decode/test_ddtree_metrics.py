# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The draft tokens an adaptive DDTree step counts
(``vllm/v1/spec_decode/ddtree_metrics.py``, CPU). The per-position stats sized
by ``SpeculativeConfig.num_draft_positions`` are vLLM's own code, tested with
the scheduler (tests/v1/core/test_ddtree_scheduler.py)."""

import pytest

from vllm.v1.spec_decode.ddtree_metrics import verified_draft_tokens


@pytest.mark.parametrize(
    "slots, accepted, budget, counted",
    [
        (15, 2, 3, 3),  # the step's budget, not the slots
        (15, 7, 3, 7),  # the split gave the request more: its accepted path
        (2, 2, 3, 2),  # never more than the slots
        (15, 0, 3, 3),  # nothing accepted: still the budget's nodes
        (15, 0, 0, 0),  # a step that verified no tree counts no draft
        (1024, 15, 1023, 1023),
    ],
)
def test_verified_draft_tokens(slots, accepted, budget, counted):
    assert verified_draft_tokens(slots, accepted, budget) == counted


def test_every_accepted_token_counts_and_slots_bound():
    for slots in (1, 3, 15, 64):
        for budget in (0, 1, 3, 15, 63, 127):
            for accepted in range(min(slots, 15) + 1):
                n = verified_draft_tokens(slots, accepted, budget)
                assert accepted <= n <= slots
                assert n == slots or n >= budget
