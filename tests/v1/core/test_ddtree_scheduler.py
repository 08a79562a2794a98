# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""vLLM's scheduler and metrics for a DDTree engine (CPU, no engine started):
the lookahead slots are the drafter's block, the spec-decode stats and
Prometheus series count a tree's accepted path per depth, the grammar
bitmask has one row per request, and schedule() gives structured-output
requests no drafts. DDTree's drafter here has a block of 16
(depth 15), so every expectation below differs from what the same sizes give
a DFlash chain of tree_budget tokens."""

import types

import pytest
import torch

from tests.models.tiny_models import make_tiny_dflash, make_tiny_qwen3

DEPTH = 15


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("ddtree_scheduler")
    target = make_tiny_qwen3(root / "target")
    drafter = make_tiny_dflash(root / "drafter", target)
    return str(target), str(drafter)


@pytest.fixture(autouse=True)
def cuda_platform(monkeypatch):
    """EngineArgs asks the platform for a device type; a CPU-only box has none."""
    from vllm.platforms import current_platform

    if current_platform.device_type == "":
        monkeypatch.setattr(
            type(current_platform), "device_type", "cuda", raising=False
        )


def _engine_config(models, budget):
    from vllm.engine.arg_utils import EngineArgs

    target, drafter = models
    spec = {
        "method": "ddtree",
        "model": drafter,
        "tree_budget": budget,
        "adaptive_budget": False,
    }
    return EngineArgs(
        model=target, speculative_config=spec, max_model_len=2048
    ).create_engine_config()


def _scheduler(vllm_config, log_stats=False, num_blocks=64, scheduler_cls=None):
    """vLLM's Scheduler (or ``scheduler_cls``) over a one-group KV cache
    stand-in (no GPU)."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
    )
    from vllm.v1.structured_output import StructuredOutputManager

    spec = FullAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16
    )
    kv = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)],
    )
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    return (scheduler_cls or Scheduler)(
        vllm_config,
        kv,
        StructuredOutputManager(vllm_config),
        block_size=16,
        log_stats=log_stats,
    )


@pytest.mark.parametrize("budget", [4, 64])
def test_lookahead_is_the_drafter_block(models, budget):
    # The drafter writes KV for [bonus, mask x depth] past the committed
    # tokens, whatever the budget: DFlash's budget + 1 would give 5 and 65.
    sched = _scheduler(_engine_config(models, budget))
    assert sched.num_lookahead_tokens == DEPTH + 1


def test_stats_count_a_tree_per_depth(models):
    sched = _scheduler(_engine_config(models, 64), log_stats=True)
    # Two verified trees of 64 and 8 nodes whose accepted paths are 3 and 8
    # nodes deep.
    stats = sched.make_spec_decoding_stats(None, 64, 3, None, "r")
    stats = sched.make_spec_decoding_stats(stats, 8, 8, None, "r")
    assert stats.num_drafts == 2
    assert stats.num_draft_tokens == 64 + 8
    assert stats.num_accepted_tokens == 3 + 8
    # One position per depth, not per node (64 with a chain's sizing).
    assert stats.num_accepted_tokens_per_pos == [2, 2, 2] + [1] * 5 + [0] * 7
    # Position i counts the trees that could reach depth i + 1: a tree of 8
    # nodes reaches depth 8 at most.
    assert stats.num_draft_tokens_per_pos == [2] * 8 + [1] * 7


def test_prometheus_series_per_depth(models):
    from vllm.v1.metrics.loggers import PrometheusStatLogger
    from vllm.v1.metrics.prometheus import unregister_vllm_metrics

    config = _engine_config(models, 64)
    unregister_vllm_metrics()
    try:
        logger = PrometheusStatLogger(config, engine_indexes=[0])
        per_pos = (
            logger.spec_decoding_prom.counter_spec_decode_num_accepted_tokens_per_pos
        )
    finally:
        unregister_vllm_metrics()
    # One engine, with one counter per depth (not 64, one per node).
    assert len(per_pos) == 1
    assert len(per_pos[0]) == DEPTH


class _Allocated(Exception):
    pass


def _grammar_bitmask_rows(sched) -> int:
    """The rows the scheduler's structured-output manager allocates for its
    grammar bitmask (stopped at the allocation, so no grammar backend runs)."""
    rows = []

    def allocate_token_bitmask(n):
        rows.append(n)
        raise _Allocated

    manager = sched.structured_output_manager
    manager.backend = types.SimpleNamespace(
        allocate_token_bitmask=allocate_token_bitmask
    )
    with pytest.raises(_Allocated):
        manager.grammar_bitmask({}, ["g"], {})
    (count,) = rows
    return count


def test_grammar_bitmask_has_one_row_per_request(models):
    """Structured-output requests of a DDTree engine decode without drafts, so
    the bitmask needs max_num_seqs rows, not max_num_seqs x (1 + budget)."""
    config = _engine_config(models, 64)
    sched = _scheduler(config)
    assert _grammar_bitmask_rows(sched) == config.scheduler_config.max_num_seqs


def _stub_grammar():
    """A grammar that accepts every token and every draft (vLLM's scheduler
    checks the type), so only the scheduler's own drop removes drafts."""
    from vllm.v1.structured_output.backend_types import StructuredOutputGrammar

    class StubGrammar(_StubGrammarMethods, StructuredOutputGrammar):
        pass

    return StubGrammar()


class _StubGrammarMethods:
    def accept_tokens(self, request_id, tokens):
        return True

    def validate_tokens(self, tokens):
        return tokens

    def is_terminated(self):
        return False

    def fill_bitmask(self, bitmask, idx):
        bitmask[idx] = idx + 1

    def rollback(self, num_tokens):
        pass

    def reset(self):
        pass


class _StubBackend:
    def __init__(self, vocab_size):
        self.words = -(-vocab_size // 32)
        self.allocated = []

    def allocate_token_bitmask(self, max_num_seqs):
        self.allocated.append(max_num_seqs)
        return torch.zeros(max_num_seqs, self.words, dtype=torch.int32)


def _request(req_id, prompt_token_ids, params, block_hasher=None):
    """A scheduler request as the engine core makes one."""
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.request import Request

    return Request.from_engine_core_request(
        EngineCoreRequest(
            request_id=req_id,
            prompt_token_ids=prompt_token_ids,
            mm_features=None,
            sampling_params=params,
            pooling_params=None,
            arrival_time=0.0,
            lora_request=None,
            cache_salt=None,
            data_parallel_rank=None,
        ),
        block_hasher=block_hasher,
    )


def _sampled(scheduler_output, token=7):
    """A model output that samples one token for every scheduled request."""
    from vllm.v1.outputs import ModelRunnerOutput

    req_ids = list(scheduler_output.num_scheduled_tokens)
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=[[token] for _ in req_ids],
    )


def test_schedule_drops_structured_output_drafts(models):
    """The worker drafts a tree for every request, and a grammar that accepts
    any draft keeps them all; schedule() still gives the structured-output
    requests no draft tokens (one token each), while the plain requests keep
    theirs."""
    from vllm.sampling_params import SamplingParams, StructuredOutputsParams
    from vllm.v1.outputs import DraftTokenIds

    budget = 8
    config = _engine_config(models, budget)
    sched = _scheduler(config)
    sched.structured_output_manager.backend = _StubBackend(
        config.model_config.get_vocab_size()
    )
    kinds = {
        "plain0": None,
        "json": {"json": {}},
        "plain1": None,
        "choice": {"choice": ["a", "b"]},
    }
    for i, (req_id, so) in enumerate(kinds.items()):
        params = SamplingParams(
            max_tokens=20,
            structured_outputs=None if so is None else StructuredOutputsParams(**so),
        )
        request = _request(req_id, [5 + i, 6, 7, 8], params)
        if so is not None:
            request.structured_output_request.grammar = _stub_grammar()
        sched.add_request(request)
    grammar = {"json", "choice"}
    out = sched.schedule()
    assert out.num_scheduled_tokens == dict.fromkeys(kinds, 4)
    sched.update_from_output(out, _sampled(out))
    drafts = [[3] * budget for _ in kinds]
    sched.update_draft_token_ids(DraftTokenIds(list(kinds), drafts))
    for _ in range(3):
        out = sched.schedule()
        assert set(out.scheduled_spec_decode_tokens) == set(kinds) - grammar
        for req_id in kinds:
            want = 1 if req_id in grammar else 1 + budget
            assert out.num_scheduled_tokens[req_id] == want, req_id
        sched.update_from_output(out, _sampled(out))
        sched.update_draft_token_ids(DraftTokenIds(list(kinds), drafts))
