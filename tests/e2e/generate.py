# SPDX-License-Identifier: Apache-2.0
"""Run one offline vLLM generation and write the output token ids as JSON.

Used by the end-to-end tests to run each engine configuration in a fresh process
(in-process engine core), several at a time on one GPU:

    python -m tests.e2e.generate CONFIG_JSON OUT_JSON

CONFIG_JSON holds ``llm`` (kwargs of ``vllm.LLM``), ``prompts`` (token id lists)
and ``sampling`` (kwargs of ``SamplingParams``).
"""

import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


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
    prompts = [{"prompt_token_ids": p} for p in config["prompts"]]
    start = time.perf_counter()
    outputs = llm.generate(prompts, SamplingParams(**config["sampling"]))
    elapsed = time.perf_counter() - start
    result = {
        "token_ids": [list(o.outputs[0].token_ids) for o in outputs],
        "seconds": elapsed,
    }
    Path(out_path).write_text(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:3])
