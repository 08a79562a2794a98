# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Which of a step's tokens are prompt tokens, for MRv2's prompt logprobs.

Under speculative decoding (EAGLE, DFlash, DDTree) the scheduler pads a
one-token prompt that joins running decodes to ``1 + num_spec_tokens`` tokens
(placeholder drafts, so the step keeps its uniform-decode CUDA graph); the
same holds for a prompt whose tokens but the last were already computed (a
prefix-cache or KV-connector hit). The placeholders are scheduled tokens but
not prompt tokens: they have no prompt logprobs, as the same prompt scheduled
without speculation has none.
"""

import numpy as np


def num_prompt_tokens_scheduled(
    # [num_reqs] tokens each request runs this step
    num_scheduled_tokens: np.ndarray,
    # [num_reqs] prompt tokens computed before this step
    num_computed_prefill_tokens: np.ndarray,
    # [num_reqs] prompt lengths, in batch order
    prompt_lens: np.ndarray,
) -> np.ndarray:
    """[num_reqs] the prompt tokens among each request's scheduled tokens: the
    step's tokens up to the prompt's end, never the placeholder drafts past it.
    Host arrays the prompt-logprobs worker already holds; no device work."""
    return np.minimum(num_scheduled_tokens, prompt_lens - num_computed_prefill_tokens)
