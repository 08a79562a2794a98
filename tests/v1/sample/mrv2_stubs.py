# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Stand-ins for the parts of vLLM's MRv2 sampler that CPU tests cannot build."""

import contextlib
import os
import types

import numpy as np
import pytest
import torch

from vllm.triton_utils import tl, triton
from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p
from vllm.v1.worker.gpu.sample.gumbel import apply_temperature
from vllm.v1.worker.gpu.sample.min_p import apply_min_p


@triton.jit
def _log1p(x):
    return tl.log(1.0 + x)


@contextlib.contextmanager
def interpreter_shims():
    """Fill two gaps of the CPU test setup: Triton's interpreter has no libdevice
    (vLLM's Gumbel noise calls ``log1p``), and vLLM's Triton top-k/top-p asks an
    unknown platform for its SM count, so use vLLM's PyTorch top-k/top-p."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        yield
        return
    import vllm.v1.sample.ops.topk_topp_sampler as topk_topp
    import vllm.v1.worker.gpu.sample.gumbel as gumbel

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gumbel, "tldevice", types.SimpleNamespace(log1p=_log1p))
        mp.setattr(topk_topp, "HAS_TRITON", False)
        yield


def apply_sampling_params(
    # [num_logits, vocab_size]
    logits: torch.Tensor,
    # [num_logits]
    expanded_idx_mapping: torch.Tensor,
    # [max_num_reqs]
    temperature: torch.Tensor,
    # [max_num_reqs]
    min_p: torch.Tensor | None = None,
    # [max_num_reqs]
    top_k: torch.Tensor | None = None,
    # [max_num_reqs]
    top_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """Temperature, min-p, then top-k/top-p, with vLLM's own MRv2 ops and in
    ``Sampler.apply_sampling_params``'s order, for tests without a ``Sampler``.

    Per-request parameters are indexed by ``expanded_idx_mapping``. ``logits`` is
    modified in place and keeps its dtype (vLLM's ops compute in float32); the
    result may be a new tensor.
    """
    apply_temperature(logits, expanded_idx_mapping, temperature)
    if min_p is not None:
        apply_min_p(logits, expanded_idx_mapping, min_p)
    if top_k is None and top_p is None:
        return logits
    row_top_k = top_k[expanded_idx_mapping] if top_k is not None else None
    row_top_p = top_p[expanded_idx_mapping] if top_p is not None else None
    return apply_top_k_top_p(logits, row_top_k, row_top_p)


class StubSampler:
    """The parts of vLLM's MRv2 ``Sampler`` that ``TreeRejectionSampler`` uses
    (vLLM's own needs UVA memory, which a CPU-only machine lacks): temperature
    only, ``num_logprobs`` logprobs (-1: none), and ``logprob_token_ids``
    ({request state index: token ids}) in the layout of MRv2's
    ``LogprobTokenIdsState``."""

    def __init__(
        self, temperature, seeds, prefill_len, num_logprobs=-1, logprob_token_ids=None
    ):
        self.compute_nans = False
        self.use_fp64_gumbel = False
        self.logprobs_mode = "raw_logprobs"
        self.sampling_states = types.SimpleNamespace(
            temperature=types.SimpleNamespace(gpu=temperature),
            seeds=types.SimpleNamespace(gpu=seeds),
            max_num_logprobs=lambda idx_mapping_np: num_logprobs,
        )
        self.req_states = types.SimpleNamespace(
            prefill_len=types.SimpleNamespace(gpu=prefill_len)
        )
        self.logprob_token_ids_state = _token_ids_state(
            logprob_token_ids or {}, temperature.shape[0], temperature.device
        )

    def returns_logprobs(self, idx_mapping_np) -> bool:
        state = self.logprob_token_ids_state
        return (
            self.sampling_states.max_num_logprobs(idx_mapping_np) != -1
            or state.max_num_token_ids(idx_mapping_np) > 0
        )

    def apply_sampling_params(
        self, logits, expanded_idx_mapping, idx_mapping_np, pos, input_ids, local_pos
    ):
        temperature = self.sampling_states.temperature.gpu
        return apply_sampling_params(logits.clone(), expanded_idx_mapping, temperature)


def _token_ids_state(token_ids: dict[int, list[int]], max_num_reqs: int, device):
    """MRv2's ``LogprobTokenIdsState`` fields, filled at once (no UVA)."""
    from vllm.sampling_params import MAX_LOGPROB_TOKEN_IDS

    num = np.zeros(max_num_reqs, dtype=np.int32)
    ids = torch.zeros(max_num_reqs, MAX_LOGPROB_TOKEN_IDS, dtype=torch.int32)
    for req, tokens in token_ids.items():
        num[req] = len(tokens)
        ids[req, : len(tokens)] = torch.tensor(tokens, dtype=torch.int32)
    return types.SimpleNamespace(
        num_token_ids=types.SimpleNamespace(
            np=num, gpu=torch.from_numpy(num).to(device)
        ),
        token_ids=types.SimpleNamespace(gpu=ids.to(device)),
        max_num_token_ids=lambda idx: int(num[idx].max(initial=0)),
    )
