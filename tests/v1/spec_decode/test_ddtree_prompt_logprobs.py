# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Prompt logprobs of a padded join, as without speculation (vllm-ddtree issue
34, item 3).

vLLM's scheduler pads a one-token prompt that joins running decodes to
``1 + num_spec_tokens`` tokens (placeholder drafts; with a fixed integer
``tree_budget``, where it has no per-batch-size schedule); MRv2's
``PromptLogprobsWorker`` then returns the placeholders' rows as prompt
logprobs. These tests run MRv2's own worker (its Triton kernel interpreted on
the CPU) on the padded step and on the step without speculation, and require
DDTree's trim to make the first equal the second: for a one-token prompt, for
a prompt whose tokens but the last were already computed (a KV connector's or
the prefix cache's hit leaves one), and, beyond what vLLM schedules today, for
a chunked prompt's last token. Request-state slots differ from batch order.
The plugin's hook that applies the trim is tested in
tests/plugins/test_ddtree_plugin_hooks.py."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm.sampling_params import SamplingParams
from vllm.v1.spec_decode.ddtree_verify import trim_prompt_logprobs
from vllm.v1.worker.gpu.sample.prompt_logprob import PromptLogprobsWorker

VOCAB = 32
MAX_REQS = 4
MAX_LEN = 64


def _batch(rows):
    """rows: (req_id, slot, computed prefill tokens, scheduled tokens, prefill len)."""
    req_ids = [r[0] for r in rows]
    slots = np.array([r[1] for r in rows], dtype=np.int32)
    scheduled = np.array([r[3] for r in rows], dtype=np.int32)
    qsl = np.zeros(len(rows) + 1, dtype=np.int32)
    np.cumsum(scheduled, out=qsl[1:])
    return SimpleNamespace(
        req_ids=req_ids,
        idx_mapping_np=slots,
        idx_mapping=torch.from_numpy(slots),
        num_computed_prefill_tokens_np=np.array([r[2] for r in rows], dtype=np.int32),
        prefill_len_np=np.array([r[4] for r in rows], dtype=np.int32),
        num_scheduled_tokens=scheduled,
        num_tokens=int(qsl[-1]),
        query_start_loc=torch.from_numpy(qsl),
        query_start_loc_np=qsl,
    )


def _hidden(batch, seed):
    """One hidden row (= logits) per scheduled token, by (request, position): the
    same prompt position gets the same row in every layout."""
    out = []
    for i, req in enumerate(batch.req_ids):
        start = int(batch.num_computed_prefill_tokens_np[i])
        for pos in range(start, start + int(batch.num_scheduled_tokens[i])):
            g = torch.Generator().manual_seed(
                seed * 1000 + sum(map(ord, req)) * 64 + pos
            )
            out.append(torch.randn(VOCAB, generator=g))
    return torch.stack(out)


class Engine:
    """MRv2's prompt-logprobs worker and the request state it reads."""

    def __init__(self, prompts: dict[str, list[int]]):
        self.worker = PromptLogprobsWorker(MAX_REQS)
        self.all_token_ids = torch.zeros(MAX_REQS, MAX_LEN, dtype=torch.int32)
        self.prompt_lens = np.zeros(MAX_REQS, dtype=np.int32)
        self.slots = {}
        for slot, (req, prompt) in enumerate(prompts.items()):
            self.slots[req] = slot
            self.all_token_ids[slot, : len(prompt)] = torch.tensor(prompt)
            self.prompt_lens[slot] = len(prompt)
            params = SamplingParams(prompt_logprobs=2 if req != "running" else None)
            self.worker.add_request(req, slot, params)

    def step(self, rows, trim: bool):
        batch = _batch([(r, self.slots[r], c, n, p) for r, c, n, p in rows])
        computed = torch.zeros(MAX_REQS, dtype=torch.int32)
        for r, c, _, _ in rows:
            computed[self.slots[r]] = c
        # Positionally, as MRv2's runner calls it.
        out = self.worker.compute_prompt_logprobs(
            lambda h: h,
            _hidden(batch, seed=1),
            batch,
            self.all_token_ids,
            computed,
            self.prompt_lens,
        )
        return trim_prompt_logprobs(out, batch, self.prompt_lens) if trim else out


def _rows(tensors):
    return [] if tensors is None else tensors.logprobs.tolist()


@pytest.mark.parametrize("num_spec_tokens", [3, 15])
def test_padded_join_has_the_prompt_logprobs_of_no_speculation(num_spec_tokens):
    # Slots in an order other than the batch's (Engine assigns them in this
    # dict's order; the batch below lists the requests otherwise).
    prompts = {
        "chunked": [3, 9, 4, 11],
        "cached": [2, 6, 8, 1, 5],
        "running": [5] * 10,
        "one": [7],
    }
    compared = 0
    for trim, padded in ((False, False), (True, True), (False, True)):
        engine = Engine(prompts)
        # Step 1: the chunked prompt's first three tokens alone.
        first = engine.step([("chunked", 0, 3, 4)], trim)
        assert first == {}  # chunked: kept until the prompt is done
        # Step 2: its last token, the one-token prompt and the prompt with four
        # of five tokens computed join a running decode (with speculation: each
        # padded with placeholder drafts).
        n = 1 + num_spec_tokens if padded else 1
        out = engine.step(
            [
                ("running", 9, 1 + num_spec_tokens, 10),
                ("one", 0, n, 1),
                ("chunked", 3, n, 4),
                ("cached", 4, n, 5),
            ],
            trim,
        )
        if not padded:
            reference = out
            continue
        if not trim:
            # MRv2 as it is: the placeholders' rows come back.
            assert len(_rows(out.get("one"))) == num_spec_tokens
            assert len(_rows(out["cached"])) == num_spec_tokens
            assert len(_rows(out["chunked"])) == 3 + num_spec_tokens
            continue
        assert out.keys() == reference.keys() == {"chunked"}
        got, want = out["chunked"], reference["chunked"]
        for field in ("logprob_token_ids", "logprobs", "selected_token_ranks"):
            assert torch.equal(getattr(got, field), getattr(want, field)), field
            compared += getattr(want, field).numel()
    # Three prompt rows (tokens 2..4 of the chunked prompt) of 3 ids,
    # 3 logprobs and 1 rank each.
    assert compared == 3 * (3 + 3 + 1)


def test_trim_keeps_rows_of_steps_without_placeholders():
    engine = Engine({"p": [1, 2, 3, 4, 5]})
    out = engine.step([("p", 0, 5, 5)], trim=True)
    assert len(_rows(out["p"])) == 4
    assert trim_prompt_logprobs({}, None, None) == {}
