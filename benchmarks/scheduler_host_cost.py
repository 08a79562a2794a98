# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What vLLM's scheduler costs the host per decode step of a DDTree engine
that verifies no tree, next to no speculation's (CPU, no model run).

While the adaptive budget verifies nothing, the scheduler still gives every
running request draft slots (``ddtree_slots.slots_for_budget(0)``: 3, so
that a probe's trees can be verified when the drafter next runs). Each such
step schedules and allocates those slots and takes back their rejection in
``update_from_output``. This times vLLM's own scheduler at N running
decode requests over the same steps for three engine configs: no
speculation; DDTree's default as a plain step leaves it (the worker reports
a budget of 0, the slots follow); and the same with the slots forced to 0
(what a plain step would cost the scheduler without them). Async scheduling
and prefix caching on, as vLLM's defaults; tiny checkpoints made on the spot
(the scheduler's work does not depend on the model's size); a KV cache
stand-in. Each round runs the configs in turn, the order reversed every
other round::

    python benchmarks/scheduler_host_cost.py --requests 64,32 --rounds 2
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.checkout import use_checkout  # noqa: E402

use_checkout()

CONFIGS = ("none", "ddtree", "ddtree-no-slots")
WARM_STEPS = 20
PROMPT_LEN = 64
# The KV cache stand-in's block size (tests/v1/core/test_ddtree_scheduler.py).
BLOCK_SIZE = 16


def _engine_config(target: str, drafter: str, config: str):
    from vllm.engine.arg_utils import EngineArgs

    spec = None
    if config != "none":
        spec = {
            "method": "ddtree",
            "model": drafter,
            "tree_budget": "auto",
            "adaptive_budget": True,
        }
    return EngineArgs(
        model=target, speculative_config=spec, max_model_len=2048
    ).create_engine_config()


class _NoSlots:
    """A scheduler's draft-slot lookup that gives every batch size none."""

    def __init__(self, lookup):
        self._len = len(lookup)

    def __getitem__(self, num_reqs: int) -> int:
        return 0

    def __len__(self) -> int:
        return self._len

    def advise(self, num_reqs: int, budget: int) -> None:
        pass


def _scheduler(vllm_config, num_blocks: int):
    """The engine's scheduler class (the async one under async scheduling)
    over the scheduler tests' KV cache stand-in."""
    from tests.v1.core.test_ddtree_scheduler import _scheduler as stand_in

    return stand_in(
        vllm_config,
        log_stats=True,
        num_blocks=num_blocks,
        scheduler_cls=vllm_config.scheduler_config.get_scheduler_cls(),
    )


def _block_hasher(vllm_config):
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
    init_none_hash(fn)
    return get_request_block_hasher(BLOCK_SIZE, fn)


def _request(i: int, params, hasher):
    """Request ``i`` as the engine core makes one; a first token of its own,
    so that no prefix-cache block matches another request's."""
    from tests.v1.core.test_ddtree_scheduler import _request as scheduler_request

    return scheduler_request(f"r{i}", [5 + i] + [6] * (PROMPT_LEN - 1), params, hasher)


def _output(scheduler_output, report):
    """The worker's output: one token sampled per request, every draft slot
    rejected; a DDTree worker's budget report (a plain step's)."""
    from vllm.v1.outputs import ModelRunnerOutput

    req_ids = list(scheduler_output.num_scheduled_tokens)
    out = ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=[[7] for _ in req_ids],
    )
    if report is not None:
        out.ddtree_budget = report
    return out


def measure(target: str, drafter: str, config: str, num_reqs: int, steps: int) -> dict:
    """Median microseconds of ``schedule()`` and ``update_from_output()`` per
    decode step at ``num_reqs`` running requests, and the step's tokens."""
    from vllm.sampling_params import SamplingParams

    vllm_config = _engine_config(target, drafter, config)
    sched = _scheduler(vllm_config, num_blocks=num_reqs * 64 + 64)
    if config == "ddtree-no-slots":
        sched.dynamic_sd_lookup = _NoSlots(sched.dynamic_sd_lookup)
    report = None
    if config != "none":
        from vllm.v1.spec_decode.ddtree_adaptive import BudgetReport

        report = BudgetReport(0, num_reqs, 0)
    hasher = _block_hasher(vllm_config)
    params = SamplingParams(max_tokens=1 << 20, ignore_eos=True, temperature=1.0)
    for i in range(num_reqs):
        sched.add_request(_request(i, params, hasher))
    # Async scheduling: a step is scheduled before the one before it returns.
    lag = 1 if vllm_config.scheduler_config.async_scheduling else 0
    pending = []
    scheduled, updated, tokens = [], [], []
    for k in range(WARM_STEPS + steps):
        t0 = time.perf_counter()
        out = sched.schedule()
        t1 = time.perf_counter()
        pending.append(out)
        t2 = t3 = 0.0
        if len(pending) > lag:
            done = pending.pop(0)
            model_output = _output(done, report)
            t2 = time.perf_counter()
            sched.update_from_output(done, model_output)
            t3 = time.perf_counter()
        if k >= WARM_STEPS:
            scheduled.append(t1 - t0)
            updated.append(t3 - t2)
            tokens.append(out.total_num_scheduled_tokens)
    return {
        "config": config,
        "requests": num_reqs,
        "schedule_us": round(1e6 * statistics.median(scheduled), 1),
        "update_us": round(1e6 * statistics.median(updated), 1),
        "tokens_per_step": statistics.median(tokens),
        "async_scheduling": bool(lag),
    }


def summarize(rows: list[dict]) -> list[str]:
    """Per batch: each config's median schedule + update microseconds over
    the rounds, and over no speculation's."""
    lines = [
        "| requests | config | tokens per step | schedule us | update us "
        "| both us | x none |",
        "|---|---|---|---|---|---|---|",
    ]
    for n in sorted({r["requests"] for r in rows}, reverse=True):
        both = {}
        for c in CONFIGS:
            rs = [r for r in rows if r["requests"] == n and r["config"] == c]
            if rs:
                both[c] = (
                    statistics.median(r["schedule_us"] for r in rs),
                    statistics.median(r["update_us"] for r in rs),
                    statistics.median(r["tokens_per_step"] for r in rs),
                )
        ref = both.get("none")
        for c, (s, u, t) in both.items():
            vs = f"{(s + u) / sum(ref[:2]):.2f}" if ref else "-"
            lines.append(
                f"| {n} | {c} | {t:g} | {s:.0f} | {u:.0f} | {s + u:.0f} | {vs} |"
            )
    return lines


def tiny_pair(root: str) -> tuple[str, str]:
    from tests.models.tiny_models import make_tiny_dflash, make_tiny_qwen3

    target = make_tiny_qwen3(os.path.join(root, "target"))
    drafter = make_tiny_dflash(os.path.join(root, "drafter"), target)
    return str(target), str(drafter)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", default="64,32")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=None, help="a JSONL file for the rows")
    args = p.parse_args(argv)
    from vllm.platforms import current_platform

    if not current_platform.device_type:
        # EngineArgs asks the platform for a device; no model runs here.
        type(current_platform).device_type = "cuda"
    import vllm_ddtree

    vllm_ddtree.register()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        target, drafter = tiny_pair(tmp)
        for k in range(args.rounds):
            order = CONFIGS if k % 2 == 0 else tuple(reversed(CONFIGS))
            for n in (int(x) for x in args.requests.split(",")):
                for c in order:
                    rows.append(
                        {**measure(target, drafter, c, n, args.steps), "round": k}
                    )
                    print(json.dumps(rows[-1]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    print("\n".join(summarize(rows)))


if __name__ == "__main__":
    main()
