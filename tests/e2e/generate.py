# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Run offline vLLM generations in a fresh process and write the results as JSON.

Used by the end-to-end tests to run each engine configuration in its own process
(in-process engine core), one process after another on one GPU:

    python -m tests.e2e.generate CONFIG_JSON OUT_JSON

CONFIG_JSON holds ``llm`` (kwargs of ``vllm.LLM``) and either ``prompts`` (token
id lists) and ``sampling`` (kwargs of ``SamplingParams``) for one generation, or
``runs``: a list of such generations, each with a ``name``, run in order by the
same engine. A run may carry ``abort: {"index": i, "after_steps": n}``: request i
is aborted after n engine steps and left out of the results.
``register_tree_attn: true`` registers TREE_ATTN as ``CUSTOM`` before the engine
starts (for an engine that uses it without DDTree).

With ``DDTREE_E2E_PATCHED_VLLM`` set to a folder holding a ``vllm/`` package with
the upstream series applied (``python -m tests.upstream.patched_vllm DEST``), the
engine runs that vLLM with no plugin loaded (``VLLM_PLUGINS=none``) instead of
the installed vLLM with this checkout's plugin: the end-to-end tests of the
patch series.

A run with ``requests`` instead of ``prompts`` is a serving scenario, stepped by
hand (:func:`_run_scenario`): each request has its own ``sampling`` and joins at
engine step ``at_step`` (0: before the first step), so requests arrive while
others decode; ``prompt_plus_output_of: [run, index]`` extends the prompt with
that earlier run's prompt and output (a prefix-cache hit on blocks written by
earlier steps). Its result adds ``finish_reasons`` and the scheduler paths the
run took (:class:`_PathCounter`).

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
PATCHED_VLLM_ENV = "DDTREE_E2E_PATCHED_VLLM"


def patched_vllm() -> Path | None:
    """The patched vLLM's folder (``DDTREE_E2E_PATCHED_VLLM``), or None."""
    value = os.environ.get(PATCHED_VLLM_ENV)
    if not value:
        return None
    path = Path(value).resolve()
    if not (path / "vllm" / "__init__.py").is_file():
        raise ValueError(f"{PATCHED_VLLM_ENV}={value!r} holds no vllm/ package")
    return path


def save_log(name: str, text: str) -> None:
    """Keep an engine process's output under ``$DDTREE_E2E_LOG_DIR`` (GPU runs set
    it to their results folder), if set."""
    log_dir = os.environ.get("DDTREE_E2E_LOG_DIR")
    if log_dir:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        (Path(log_dir) / f"{name}.log").write_text(text)


def report(name: str, line: str) -> None:
    """Print a test's measured line (tokens compared, p-values, counts) and append
    it to ``$DDTREE_E2E_LOG_DIR/<name>.log`` if set, so a GPU run keeps the
    numbers without ``pytest -rP``."""
    print(line)
    log_dir = os.environ.get("DDTREE_E2E_LOG_DIR")
    if log_dir:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        with open(Path(log_dir) / f"{name}.log", "a") as f:
            f.write(line + "\n")


def _free_blocks(llm) -> int:
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    return scheduler.kv_cache_manager.block_pool.get_num_free_blocks()


def _top_logprobs(completion) -> list | None:
    """Per position ``[[token_id, logprob], ...]``, or None without logprobs."""
    if completion.logprobs is None:
        return None
    lps = completion.logprobs
    return [[[tok, lp.logprob] for tok, lp in lps[i].items()] for i in range(len(lps))]


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
                    list(completion.token_ids),
                    _top_logprobs(completion),
                )
        steps += 1
        if steps == after_steps:
            engine.abort_request([f"r{index}"])
    picked = [done.get(f"r{i}", (None, None)) for i in range(len(prompts))]
    return [t for t, _ in picked], [lp for _, lp in picked]


class _PathCounter:
    """Counts the scheduler paths a run takes, read off each SchedulerOutput:
    requests that joined with placeholder drafts (the "pad new decode
    requests" path: a new or resumed request with one token to compute while
    others decode), preemptions, and steps that chunk-prefill a prompt next to
    verified trees."""

    def __init__(self, scheduler):
        self.scheduler = scheduler
        self.counts = {
            "steps": 0,
            "padded_joins": 0,
            "preemptions": 0,
            "chunked_prefill_with_trees": 0,
            "tree_steps": 0,
        }
        self._schedule = scheduler.schedule
        scheduler.schedule = self._counted_schedule

    def _counted_schedule(self, *args, **kwargs):
        out = self._schedule(*args, **kwargs)
        c = self.counts
        c["steps"] += 1
        spec = out.scheduled_spec_decode_tokens
        c["padded_joins"] += sum(r.req_id in spec for r in out.scheduled_new_reqs)
        c["preemptions"] += len(out.preempted_req_ids or ())
        c["tree_steps"] += bool(spec)
        requests = self.scheduler.requests
        partial = any(
            req_id in requests
            and requests[req_id].num_computed_tokens
            < requests[req_id].num_prompt_tokens
            for req_id in out.num_scheduled_tokens
        )
        c["chunked_prefill_with_trees"] += bool(spec) and partial
        return out

    def take(self) -> dict:
        counts = dict(self.counts)
        for key in self.counts:
            self.counts[key] = 0
        return counts

    def close(self) -> None:
        self.scheduler.schedule = self._schedule


def _run_scenario(llm, run, done_runs, counter):
    """Requests join at their ``at_step``; returns the run's result."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    pending = []
    for i, req in enumerate(run["requests"]):
        prompt = list(req.get("prompt", []))
        if "prompt_plus_output_of" in req:
            name, j = req["prompt_plus_output_of"]
            prompt = done_runs[name]["prompts"][j] + done_runs[name]["token_ids"][j]
            prompt += list(req.get("prompt", []))
        pending.append((req.get("at_step", 0), i, prompt, req["sampling"]))
    pending.sort(key=lambda x: (x[0], x[1]))
    aborts = {a["index"]: a["after_steps"] for a in run.get("aborts", [])}
    prompts = [None] * len(pending)
    done: dict[int, tuple] = {}
    added: dict[int, int] = {}
    counter.take()
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            _, i, prompt, sampling = pending.pop(0)
            prompts[i] = prompt
            engine.add_request(
                f"s{i}", {"prompt_token_ids": prompt}, SamplingParams(**sampling)
            )
            added[i] = step
        for out in engine.step():
            i = int(out.request_id.split("-")[0][1:])
            if out.finished and i not in aborts:
                c = out.outputs[0]
                done[i] = (
                    list(c.token_ids),
                    _top_logprobs(c),
                    c.finish_reason,
                    c.stop_reason,
                    c.text,
                )
        step += 1
        for i, after in aborts.items():
            if i in added and step == added[i] + after:
                engine.abort_request([f"s{i}"])
    picked = [done.get(i) for i in range(len(prompts))]
    return {
        "prompts": prompts,
        "token_ids": [p and p[0] for p in picked],
        "logprobs": [p and p[1] for p in picked],
        "finish_reasons": [p and p[2] for p in picked],
        "stop_reasons": [p and p[3] for p in picked],
        "texts": [p and p[4] for p in picked],
        "paths": counter.take(),
        "steps": step,
    }


def _spec_metrics(llm) -> dict:
    metrics = {}
    for m in llm.get_metrics():
        if "spec_decode" in m.name:
            metrics[m.name] = getattr(m, "values", getattr(m, "value", None))
    return metrics


def _engine_facts(llm) -> dict:
    """The settings a serving test must run under, as the engine resolved them."""
    cfg = llm.llm_engine.vllm_config
    return {
        "async_scheduling": bool(cfg.scheduler_config.async_scheduling),
        "enable_prefix_caching": bool(cfg.cache_config.enable_prefix_caching),
        "cudagraph_mode": str(cfg.compilation_config.cudagraph_mode),
        "block_size": cfg.cache_config.block_size,
        "max_num_seqs": cfg.scheduler_config.max_num_seqs,
        "max_num_batched_tokens": cfg.scheduler_config.max_num_batched_tokens,
        "num_gpu_blocks": cfg.cache_config.num_gpu_blocks,
        "max_cudagraph_capture_size": cfg.compilation_config.max_cudagraph_capture_size,
        "num_cudagraph_capture_sizes": len(
            cfg.compilation_config.cudagraph_capture_sizes or ()
        ),
        "num_speculative_tokens": cfg.num_speculative_tokens,
    }


def main(config_path: str, out_path: str) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    sys.path.insert(0, str(ROOT))
    patched = patched_vllm()
    if patched is None:
        import conftest  # noqa: F401  (this working tree's vllm/ modules first)
        import vllm_ddtree

        vllm_ddtree.register()
    else:
        # vLLM's own code path: the series' edits, no plugin.
        os.environ["VLLM_PLUGINS"] = "none"
        sys.path.insert(0, str(patched))
    import vllm
    from vllm import LLM, SamplingParams

    print(f"vllm from {Path(vllm.__file__).parent}", flush=True)
    if patched is not None:
        assert Path(vllm.__file__).is_relative_to(patched), vllm.__file__

    config = json.loads(Path(config_path).read_text())
    if config.get("register_tree_attn"):
        # The plugin registers TREE_ATTN (as CUSTOM) for DDTree engines only; an
        # engine that names it without DDTree needs it here (the engine core and
        # its worker run in this process).
        if patched is None:
            from vllm_ddtree.glue import register_tree_attn_backend
        else:
            from vllm.v1.attention.backends.registry import (
                register_tree_attn_backend,
            )

        register_tree_attn_backend()
    if config.get("verifier") == "biased":
        from tests.v1.sample.biased_verifier import install_biased_verifier

        install_biased_verifier()
    llm = LLM(**config["llm"])
    single = "runs" not in config
    runs = [dict(config, name="default")] if single else config["runs"]
    result: dict = {
        "runs": {},
        "free_blocks": {"start": _free_blocks(llm)},
        "engine": _engine_facts(llm),
    }
    counter = _PathCounter(llm.llm_engine.engine_core.engine_core.scheduler)
    for run in runs:
        start = time.perf_counter()
        if "requests" in run:
            result["runs"][run["name"]] = _run_scenario(
                llm, run, result["runs"], counter
            )
            result["runs"][run["name"]]["seconds"] = time.perf_counter() - start
            continue
        sampling = SamplingParams(**run["sampling"])
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
    counter.close()
    result["free_blocks"]["end"] = _free_blocks(llm)
    if not config["llm"].get("disable_log_stats", True):
        result["metrics"] = _spec_metrics(llm)
    if single:
        result.update(result["runs"]["default"])
    if patched is not None:
        # Nothing of the overlay was imported on the way.
        overlay = sorted(
            name for name in sys.modules if name.split(".")[0] == "vllm_ddtree"
        )
        assert not overlay, overlay
    result["vllm"] = str(Path(vllm.__file__).parent)
    Path(out_path).write_text(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:3])
