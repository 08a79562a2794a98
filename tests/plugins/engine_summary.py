# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What ``EngineArgs`` builds for some configurations, as JSON, in a fresh process.

    VLLM_PLUGINS=ddtree|"" python -m tests.plugins.engine_summary IN_JSON OUT_JSON

IN_JSON holds ``configs`` (name -> kwargs of ``EngineArgs``) and optionally
``custom_backend`` (a class path registered as ``AttentionBackendEnum.CUSTOM``
first, as another out-of-tree backend would be). With ``VLLM_PLUGINS=""`` vLLM
loads no general plugin, so comparing two runs shows what installing vllm-ddtree
changes for each engine. OUT_JSON gets, per name: the speculative config,
scheduler limits, CUDA-graph capture sizes, the scheduler's lookahead slots, the
attention backend (and what CUSTOM resolves to), or the error it raised.
"""

import json
import sys
from pathlib import Path


def build_scheduler(
    vllm_config, log_stats: bool = False, scheduler_cls=None, num_blocks: int = 64
):
    """vLLM's ``Scheduler`` (or ``scheduler_cls``) for this config over a
    one-group KV cache stand-in of ``num_blocks`` 16-token blocks (no GPU
    needed)."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
    )
    from vllm.v1.structured_output import StructuredOutputManager

    spec = FullAttentionSpec(
        block_size=16,
        num_kv_heads=2,
        head_size=64,
        dtype=vllm_config.model_config.dtype,
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


def _scheduler_lookahead(vllm_config) -> int:
    """``Scheduler.num_lookahead_tokens`` for this config (the value depends on
    the speculative config only)."""
    return build_scheduler(vllm_config).num_lookahead_tokens


def summarize(engine_args: dict) -> dict:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    try:
        vllm_config = EngineArgs(**engine_args).create_engine_config()
    except Exception as e:  # noqa: BLE001  (the error is part of the summary)
        return {"error": f"{type(e).__name__}: {e}"}
    spec = vllm_config.speculative_config
    sched = vllm_config.scheduler_config
    comp = vllm_config.compilation_config
    custom = AttentionBackendEnum.CUSTOM
    return {
        "speculative": None
        if spec is None
        else {
            "method": spec.method,
            "num_speculative_tokens": spec.num_speculative_tokens,
            "parallel_drafting": getattr(spec, "parallel_drafting", None),
            "model": spec.model,
            "max_num_new_slots_for_drafting": spec.max_num_new_slots_for_drafting,
        },
        "max_num_seqs": sched.max_num_seqs,
        "max_num_batched_tokens": sched.max_num_batched_tokens,
        "max_num_scheduled_tokens": sched.max_num_scheduled_tokens,
        "async_scheduling": sched.async_scheduling,
        "cudagraph_capture_sizes": comp.cudagraph_capture_sizes,
        "max_cudagraph_capture_size": comp.max_cudagraph_capture_size,
        "attention_backend": str(vllm_config.attention_config.backend),
        "custom_backend": custom.get_path() if custom.is_overridden() else None,
        "additional_config": vllm_config.additional_config,
        "lookahead_tokens": _scheduler_lookahead(vllm_config),
    }


def main(in_path: str, out_path: str) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    import conftest  # noqa: F401  (Triton in the interpreter without a GPU)
    from vllm.platforms import current_platform

    if current_platform.device_type == "":
        # EngineArgs asks the platform for a device type; a CPU box has none.
        type(current_platform).device_type = "cuda"
    from vllm.v1.attention.backends.registry import (
        AttentionBackendEnum,
        register_backend,
    )

    config = json.loads(Path(in_path).read_text())
    if config.get("custom_backend"):
        register_backend(AttentionBackendEnum.CUSTOM, config["custom_backend"])
    out = {name: summarize(args) for name, args in config["configs"].items()}
    Path(out_path).write_text(json.dumps(out, default=str, indent=1))


if __name__ == "__main__":
    main(*sys.argv[1:3])
