# SPDX-License-Identifier: Apache-2.0
"""Run offline vLLM generations in a fresh process and write the results as JSON.

Used by the end-to-end tests to run each engine configuration in its own process
(in-process engine core), one process after another on one GPU:

    python -m tests.e2e.generate CONFIG_JSON OUT_JSON

CONFIG_JSON holds ``llm`` (kwargs of ``vllm.LLM``) and either ``prompts`` (token
id lists) and ``sampling`` (kwargs of ``SamplingParams``) for one generation, or
``runs``: a list of such generations, each with a ``name``, run in order by the
same engine. A run may carry ``abort: {"index": i, "after_steps": n}``: request i
is aborted after n engine steps and left out of the results.

OUT_JSON holds ``token_ids``, ``logprobs`` (per request and position the top
``[[token_id, logprob], ...]``, or None unless the sampling asks for logprobs) and
``seconds`` (single generation) or ``runs: {name: {"token_ids", "logprobs",
"seconds"}}``, plus ``free_blocks: {"start", "end"}`` (free KV
blocks of the scheduler before the first run and after the last) and
``metrics`` (every ``vllm:spec_decode*`` metric, when stats are on).
"""

import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def save_log(name: str, text: str) -> None:
    """Keep an engine process's output under ``$DDTREE_E2E_LOG_DIR`` (GPU runs set
    it to their results folder), if set."""
    log_dir = os.environ.get("DDTREE_E2E_LOG_DIR")
    if log_dir:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        (Path(log_dir) / f"{name}.log").write_text(text)


def _free_blocks(llm) -> int:
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    return scheduler.kv_cache_manager.block_pool.get_num_free_blocks()


def _top_logprobs(completion) -> list | None:
    """Per position ``[[token_id, logprob], ...]``, or None without logprobs."""
    if completion.logprobs is None:
        return None
    lps = completion.logprobs
    return [
        [[tok, lp.logprob] for tok, lp in lps[i].items()] for i in range(len(lps))
    ]


def _generate(llm, prompts, sampling) -> tuple[list, list]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], sampling)
    return (
        [list(o.outputs[0].token_ids) for o in outputs],
        [_top_logprobs(o.outputs[0]) for o in outputs],
    )


def _generate_with_abort(llm, prompts, sampling, index, after_steps):
    """Step the engine by hand and abort request ``index`` mid-generation; its
    entry in the result is None."""
    engine = llm.llm_engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, sampling)
    done: dict[str, tuple] = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            # Internal ids carry a random "-suffix".
            request_id = out.request_id.split("-")[0]
            if out.finished and request_id != f"r{index}":
                completion = out.outputs[0]
                done[request_id] = (
                    list(completion.token_ids), _top_logprobs(completion)
                )
        steps += 1
        if steps == after_steps:
            engine.abort_request([f"r{index}"])
    picked = [done.get(f"r{i}", (None, None)) for i in range(len(prompts))]
    return [t for t, _ in picked], [lp for _, lp in picked]


def _spec_metrics(llm) -> dict:
    metrics = {}
    for m in llm.get_metrics():
        if "spec_decode" in m.name:
            metrics[m.name] = getattr(m, "values", getattr(m, "value", None))
    return metrics


def main(config_path: str, out_path: str) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    sys.path.insert(0, str(ROOT))
    import conftest  # noqa: F401  (this working tree's vllm/ modules first)
    import vllm_ddtree

    vllm_ddtree.register()
    from vllm import LLM, SamplingParams

    config = json.loads(Path(config_path).read_text())
    llm = LLM(**config["llm"])
    single = "runs" not in config
    runs = [dict(config, name="default")] if single else config["runs"]
    result: dict = {"runs": {}, "free_blocks": {"start": _free_blocks(llm)}}
    for run in runs:
        sampling = SamplingParams(**run["sampling"])
        start = time.perf_counter()
        if "abort" in run:
            token_ids, logprobs = _generate_with_abort(
                llm, run["prompts"], sampling, **run["abort"]
            )
        else:
            token_ids, logprobs = _generate(llm, run["prompts"], sampling)
        result["runs"][run["name"]] = {
            "token_ids": token_ids,
            "logprobs": logprobs,
            "seconds": time.perf_counter() - start,
        }
    result["free_blocks"]["end"] = _free_blocks(llm)
    if not config["llm"].get("disable_log_stats", True):
        result["metrics"] = _spec_metrics(llm)
    if single:
        result.update(result["runs"]["default"])
    Path(out_path).write_text(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:3])
