# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Prompt logprobs of a padded join, as without speculation.

With speculative decoding (EAGLE, DFlash, DDTree: any ``num_spec_tokens > 0``
without a per-batch-size schedule) vLLM's scheduler pads a one-token prompt
that joins running decodes to ``1 + num_spec_tokens`` tokens (placeholder
drafts). These tests run MRv2's own ``PromptLogprobsWorker`` (its Triton
kernel interpreted on the CPU) on the padded step and on the step without
speculation and require the same prompt logprobs: for a one-token prompt, for
a prompt whose tokens but the last were already computed (a KV connector's or
the prefix cache's hit leaves one), and, beyond what vLLM schedules today, for
a chunked prompt's last token. Request-state slots differ from batch order.

vLLM 0.26.0 as released returns the placeholders' rows; the worker that
counts a step's prompt tokens with ``num_prompt_tokens_scheduled`` does not.
"""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vllm.sampling_params import SamplingParams
from vllm.v1.worker.gpu.sample.prompt_logprob import PromptLogprobsWorker

from vllm.v1.worker.gpu.sample import prompt_logprob
from vllm.v1.worker.gpu.sample.prompt_logprob_rows import num_prompt_tokens_scheduled

VOCAB = 32
MAX_REQS = 4
MAX_LEN = 64

# The worker as released (no prompt-token count) returns the placeholders'
# rows: the test must fail there, and pass once the worker counts them.
WORKER_COUNTS_PROMPT_TOKENS = (
    getattr(prompt_logprob, "num_prompt_tokens_scheduled", None)
    is num_prompt_tokens_scheduled
)
on_released_worker = pytest.mark.xfail(
    not WORKER_COUNTS_PROMPT_TOKENS,
    reason="vLLM 0.26.0's PromptLogprobsWorker returns a padded join's "
    "placeholder rows as prompt logprobs",
    raises=AssertionError,
    strict=True,
)


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

    def batch(self, rows):
        """rows: (req_id, computed prefill tokens, scheduled tokens, prefill len)."""
        return _batch([(r, self.slots[r], c, n, p) for r, c, n, p in rows])

    def step(self, rows, compute=None):
        """The worker's prompt logprobs for a step of ``rows`` (through
        ``compute``, the worker's method or a wrapper of it, if given)."""
        batch = self.batch(rows)
        computed = torch.zeros(MAX_REQS, dtype=torch.int32)
        for r, c, _, _ in rows:
            computed[self.slots[r]] = c
        # Positionally, as MRv2's runner calls it.
        return (compute or self.worker.compute_prompt_logprobs)(
            lambda h: h,
            _hidden(batch, seed=1),
            batch,
            self.all_token_ids,
            computed,
            self.prompt_lens,
        )


PROMPTS = {
    "chunked": [3, 9, 4, 11],
    "cached": [2, 6, 8, 1, 5],
    "running": [5] * 10,
    "one": [7],
}


def join_step(engine, num_spec_tokens, padded, compute=None):
    """A chunked prompt's first three tokens alone, then its last token, a
    one-token prompt and a prompt with four of five tokens computed join a
    running decode (with speculation: each padded with placeholder drafts).
    Returns the second step's prompt logprobs."""
    first = engine.step([("chunked", 0, 3, 4)], compute)
    assert first == {}  # chunked: kept until the prompt is done
    n = 1 + num_spec_tokens if padded else 1
    rows = [
        ("running", 9, 1 + num_spec_tokens, 10),
        ("one", 0, n, 1),
        ("chunked", 3, n, 4),
        ("cached", 4, n, 5),
    ]
    return engine.step(rows, compute)


def rows_of(tensors):
    return [] if tensors is None else tensors.logprobs.tolist()


def assert_no_speculation(out, num_spec_tokens):
    """``out`` (a padded step's prompt logprobs) equals the step without
    speculation, compared field by field."""
    reference = join_step(Engine(PROMPTS), num_spec_tokens, padded=False)
    assert reference.keys() == {"chunked"}
    assert out.keys() == reference.keys()
    compared = 0
    got, want = out["chunked"], reference["chunked"]
    for field in ("logprob_token_ids", "logprobs", "selected_token_ranks"):
        assert torch.equal(getattr(got, field), getattr(want, field)), field
        compared += getattr(want, field).numel()
    # Three prompt rows (tokens 2..4 of the chunked prompt) of 3 ids,
    # 3 logprobs and 1 rank each.
    assert compared == 3 * (3 + 3 + 1)


@on_released_worker
@pytest.mark.parametrize("num_spec_tokens", [1, 3, 15])
def test_padded_join_has_the_prompt_logprobs_of_no_speculation(num_spec_tokens):
    out = join_step(Engine(PROMPTS), num_spec_tokens, padded=True)
    assert_no_speculation(out, num_spec_tokens)


def test_steps_without_placeholders_keep_their_rows():
    engine = Engine({"p": [1, 2, 3, 4, 5]})
    out = engine.step([("p", 0, 5, 5)])
    assert len(rows_of(out["p"])) == 4
    engine = Engine({"p": [1, 2, 3, 4, 5]})
    assert engine.step([("p", 0, 3, 5)]) == {}
    out = engine.step([("p", 3, 2, 5)])
    assert len(rows_of(out["p"])) == 4


def test_prompt_tokens_scheduled():
    # A padded one-token prompt, the last token of a cached prompt padded, a
    # chunk, a prompt's last chunk, a decode past its prompt.
    scheduled = np.array([4, 16, 3, 2, 4], dtype=np.int32)
    computed = np.array([0, 4, 0, 3, 9], dtype=np.int32)
    prompt_lens = np.array([1, 5, 5, 5, 9], dtype=np.int32)
    got = num_prompt_tokens_scheduled(scheduled, computed, prompt_lens)
    assert got.tolist() == [1, 1, 3, 2, 0]
