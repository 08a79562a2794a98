# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""DDTree's structured-output requests lose their drafts before each step is
sized (``vllm/v1/spec_decode/ddtree_grammar.py``), on stand-in requests; the
scheduler's call is tested in tests/v1/core/test_ddtree_scheduler.py."""

import types

from vllm.v1.spec_decode.ddtree_grammar import drop_grammar_drafts


def _request(spec_token_ids, finished=False):
    return types.SimpleNamespace(
        spec_token_ids=spec_token_ids, is_finished=lambda: finished
    )


def test_drop_grammar_drafts_clears_drafts_and_forgets_finished_requests():
    requests = {
        "g": _request([5, 6, 7]),
        "idle": _request([]),
        "done": _request([5], finished=True),
        "plain": _request([5, 6]),
    }
    grammar = {"g", "idle", "done", "gone"}
    drop_grammar_drafts(grammar, requests)
    assert requests["g"].spec_token_ids == []
    assert requests["plain"].spec_token_ids == [5, 6]  # not structured output
    assert requests["done"].spec_token_ids == [5]  # finished: left as it is
    assert grammar == {"g", "idle"}
    drop_grammar_drafts(grammar, requests)
    assert grammar == {"g", "idle"}
