# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Every point where the DDTree plugin touches vLLM 0.26.0.

:func:`apply` wraps a few vLLM functions in place. Each wrapper calls the original
and adds DDTree's part only for an engine that asked for ``method="ddtree"``, so
other engines run unchanged; applying twice changes nothing (wrapped functions
are marked). docs/upstream.md lists these points with what the upstream PR would
write instead.

Engine side (the process that parses arguments and builds the ``VllmConfig``):

1. ``EngineArgs.create_speculative_config``: ``{"method": "ddtree", ...}`` is
   checked and mapped onto a DFlash ``SpeculativeConfig`` with ``tree_budget``
   draft slots; the DDTree settings go to ``additional_config["vllm_ddtree"]`` and the
   target's attention backend becomes TREE_ATTN (``AttentionBackendEnum.CUSTOM``).
2. ``EngineArgs._set_default_max_num_seqs_and_batched_tokens_args``: batch and
   token limits that fit ``max_num_seqs`` trees of ``tree_budget + 1`` tokens,
   and CUDA-graph sizes in multiples of ``tree_budget + 1`` within vLLM's
   default (or the user's) maximum capture size.
3. ``EngineArgs.create_engine_config``: the finished config must run on Model
   Runner V2, where DDTree lives.

Engine-core and worker side:

4. ``Scheduler.__init__``: lookahead KV slots = the drafter's block,
   spec-decode stats with per-position counts sized by the drafter's depth
   (the scheduler's own ``make_spec_decoding_stats``, per instance), the
   grammar bitmask sized for one row per request, and with an adaptive budget
   the draft slots per batch size (``dynamic_sd_lookup``);
   ``Scheduler.add_request`` / ``schedule``: structured-output requests are
   scheduled without drafts, and with an adaptive budget a request's blocks
   past its next tree go back to the pool when its slots drop;
   ``Scheduler.update_from_output``: the worker's budget report (the slots
   follow it, the spec-decode counters count its nodes).
5. ``GPUModelRunner.__init__`` (MRv2): registers TREE_ATTN in the worker before
   the model is built; ``GPUModelRunner.initialize_kv_cache``: then compiles every
   TREE_ATTN kernel variant a step can pick
   (``DDTreeModelState.warm_up_tree_attention``); ``init_speculator`` (as the
   runner imported it): ``DDTreeSpeculator``; ``DFlashSpeculator``: the
   ``propose`` steps DDTree inherits (:class:`_DFlashSteps`, the series'
   first patch), added only where vLLM lacks them. Stock DFlash's ``propose``
   never calls them, so no other engine runs them.
6. ``init_model_state`` (as the runner imported it): ``DDTreeModelState`` (tree
   positions and masks for attention). Tree verification is the speculator's:
   ``GPUModelRunner.load_model`` installs its tree sampler
   (``DDTreeSpeculator.init_rejection_sampler``) in the rejection-sampler slot,
   ``GPUModelRunner.add_requests`` resets a joining request's tree
   (``DDTreeSpeculator.add_request``), and ``GPUModelRunner.sample_tokens``
   hands the step's sampler output (the walk) to ``DDTreeSpeculator.propose``.
7. ``GPUModelRunner.execute_model`` / ``prepare_inputs`` (adaptive budgets: the
   block table rows the scheduler cut, the step's budget, and the batch-wide
   split of its nodes), ``sample_tokens`` (the budget report on the step's
   output), ``load_model`` (the
   structured-output bitmask sized by the step's token limit; prompt logprobs
   without a padded join's placeholder rows, where vLLM's worker returns them:
   DDTree runners only; the budget's kernels compiled for every tree width and
   cap, before vLLM's profile run) and
   ``capture_model`` (the budget's step-cost prior from the captured graphs).

Front end:

8. ``PrometheusStatLogger.__init__``: per-position acceptance counters sized by
   the drafter's depth, not by ``tree_budget``.

TREE_ATTN is registered as ``AttentionBackendEnum.CUSTOM`` only in the processes
of a DDTree engine (points 1 and 5), so another backend in that slot is an error
for DDTree engines only. Each point is patched when its vLLM module is imported.

Everything the wrappers put into the config is a plain int, string or enum, so
spawned engine-core and worker processes unpickle it before this plugin loads.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib.abc
import sys
import types
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, get_args

from vllm.logger import init_logger

if TYPE_CHECKING:
    # Names in _DFlashSteps' code, which runs with the globals of DFlash's
    # module (_add_missing_methods): that module imports them at run time.
    import torch
    from vllm.config.compilation import CUDAGraphMode  # noqa: TC004
    from vllm.v1.worker.gpu.attn_utils import build_slot_mappings_by_layer  # noqa: TC004
    from vllm.v1.worker.gpu.dp_utils import dispatch_cg_and_sync_dp  # noqa: TC004
    from vllm.v1.worker.gpu.input_batch import InputBatch

# Under vLLM's logger tree ("vllm."), so that its format and level apply.
logger = init_logger("vllm.ddtree.glue")

_PATCHED = "__ddtree_patched__"
TREE_ATTN_BACKEND_PATH = "vllm.v1.attention.backends.tree_attn.TreeAttentionBackend"


def apply() -> None:
    """Install every wrapper; safe to call any number of times.

    Each vLLM module is patched when it is imported (at once if it already is),
    so loading the plugin imports nothing of vLLM's and none of DDTree's heavy
    modules: a process that never builds the scheduler or a GPU model runner
    never loads them for the plugin's sake."""
    for module, patch in _PATCHES.items():
        _when_imported(module, _unless_vllm_has_ddtree(patch))


def _unless_vllm_has_ddtree(patch: Callable[[Any], None]) -> Callable[[Any], None]:
    """``patch``, skipped on a vLLM that takes method "ddtree" itself (the
    upstream series applied): there the wrappers would turn a ddtree config
    into DFlash and the plugin's key, which that vLLM's reader ignores, so
    the engine would run DFlash."""

    def patch_unless_native(module: Any) -> None:
        if _vllm_has_ddtree_method():
            global _stood_aside
            if not _stood_aside:
                _stood_aside = True
                logger.info(
                    "DDTree: this vLLM has method 'ddtree' of its own; the "
                    "plugin leaves it alone"
                )
            return
        patch(module)

    return patch_unless_native


_stood_aside = False


def _vllm_has_ddtree_method() -> bool:
    """``ddtree_config.vllm_has_ddtree_method``, read from vLLM's own config
    module: importing ddtree_config here would load DDTree's modules while the
    plugin installs itself, which must import none of them."""
    from vllm.config.speculative import SpeculativeMethod

    return "ddtree" in get_args(SpeculativeMethod)


def _patch_engine_args(module) -> None:
    args = module.EngineArgs
    _wrap(args, "add_cli_args", _add_cli_args)
    # A static method: reached through an instance too, it takes no self.
    args.add_cli_args = staticmethod(args.add_cli_args)
    _wrap(args, "create_speculative_config", _create_speculative_config)
    _wrap(
        args,
        "_set_default_max_num_seqs_and_batched_tokens_args",
        _set_batch_defaults,
    )
    _wrap(args, "create_engine_config", _create_engine_config)


def _patch_scheduler(module) -> None:
    _wrap(module.Scheduler, "__init__", _scheduler_init)
    _wrap(module.Scheduler, "add_request", _scheduler_add_request)
    _wrap(module.Scheduler, "schedule", _scheduler_schedule)
    _wrap(module.Scheduler, "update_from_output", _scheduler_update_from_output)


def _patch_model_runner(module) -> None:
    # The runner calls these two by the names it imported.
    _wrap(module, "init_speculator", _init_speculator)
    _wrap(module, "init_model_state", _init_model_state)
    _wrap(module.GPUModelRunner, "__init__", _model_runner_init)
    _wrap(module.GPUModelRunner, "load_model", _load_model)
    _wrap(module.GPUModelRunner, "add_requests", _add_requests)
    _wrap(module.GPUModelRunner, "initialize_kv_cache", _initialize_kv_cache)
    _wrap(module.GPUModelRunner, "capture_model", _capture_model)
    _wrap(module.GPUModelRunner, "execute_model", _execute_model)
    _wrap(module.GPUModelRunner, "prepare_inputs", _prepare_inputs)
    _wrap(module.GPUModelRunner, "sample_tokens", _sample_tokens)


def _patch_stat_loggers(module) -> None:
    _wrap(module.PrometheusStatLogger, "__init__", _prometheus_init)


def _patch_dflash(module) -> None:
    _add_missing_methods(module.DFlashSpeculator, _DFlashSteps, module)


_PATCHES: dict[str, Callable[[Any], None]] = {
    "vllm.engine.arg_utils": _patch_engine_args,
    "vllm.v1.core.sched.scheduler": _patch_scheduler,
    "vllm.v1.worker.gpu.model_runner": _patch_model_runner,
    "vllm.v1.worker.gpu.spec_decode.dflash.speculator": _patch_dflash,
    "vllm.v1.metrics.loggers": _patch_stat_loggers,
}


class _PatchingLoader(importlib.abc.Loader):
    """Runs a module's own loader, then ``patch(module)``; anything else is
    the wrapped loader's."""

    def __init__(self, loader, patch: Callable[[Any], None]):
        self._loader = loader
        self._patch = patch

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        self._patch(module)

    def __getattr__(self, name: str):
        return getattr(self._loader, name)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a watched module it asks the other finders and
    hands back their spec with a :class:`_PatchingLoader`."""

    def __init__(self):
        self.patches: dict[str, Callable[[Any], None]] = {}
        # Watched names being looked up by this finder right now.
        self._finding: set[str] = set()

    def find_spec(self, name, path, target=None):
        patch = self.patches.get(name)
        if patch is None or name in self._finding:
            # Asked again from inside the lookup below: another import hook
            # (one that finds the module anew to wrap its loader, as profilers
            # and tracers do) gets the plain spec. Wrapped here as well, the
            # module would be patched twice, the second time over that hook's
            # wrappers, which hide the first patch's mark: a wrapped method
            # would then run DDTree's step twice.
            return None
        self._finding.add(name)
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    if spec.loader is not None:
                        spec.loader = _PatchingLoader(spec.loader, patch)
                    return spec
            return None
        finally:
            self._finding.discard(name)


def _post_import_finder() -> _PostImportFinder:
    for finder in sys.meta_path:
        if isinstance(finder, _PostImportFinder):
            return finder
    finder = _PostImportFinder()
    sys.meta_path.insert(0, finder)
    return finder


def _when_imported(name: str, patch: Callable[[Any], None]) -> None:
    module = sys.modules.get(name)
    if module is not None:
        patch(module)
    else:
        _post_import_finder().patches[name] = patch


def _wrap(owner: Any, name: str, wrapper: Callable[..., Any]) -> None:
    """``owner.name = wrapper(original, *args, **kwargs)``, once."""
    original = getattr(owner, name)
    if getattr(original, _PATCHED, False):
        return

    @functools.wraps(original)
    def patched(*args: Any, **kwargs: Any) -> Any:
        return wrapper(original, *args, **kwargs)

    setattr(patched, _PATCHED, True)
    setattr(owner, name, patched)


def _add_missing_methods(cls: type, methods: type, module: Any) -> None:
    """``cls.<name> = methods.<name>`` for each function of ``methods`` that
    ``cls`` lacks (a vLLM that has it keeps its own), with ``module``'s
    globals: the code runs as if it were written in ``cls``'s module."""
    for name, fn in vars(methods).items():
        if not isinstance(fn, types.FunctionType) or hasattr(cls, name):
            continue
        method = types.FunctionType(
            fn.__code__, vars(module), name, fn.__defaults__, fn.__closure__
        )
        method.__kwdefaults__ = fn.__kwdefaults__
        method.__doc__ = fn.__doc__
        method.__annotations__ = fn.__annotations__
        method.__module__ = fn.__module__
        method.__qualname__ = f"{cls.__qualname__}.{name}"
        setattr(method, _PATCHED, True)
        setattr(cls, name, method)


def _ddtree_of(vllm_config: Any):
    from vllm.v1.spec_decode.ddtree_config import DDTreeConfig

    return DDTreeConfig.from_vllm_config(vllm_config)


def _num_draft_positions(vllm_config: Any, cfg) -> int:
    """What ``SpeculativeConfig.num_draft_positions`` gives where vLLM has
    method "ddtree": the same function, fed the DFlash config's draft count
    and the plugin's drafter depth."""
    from vllm.v1.spec_decode.ddtree_config import num_draft_positions

    return num_draft_positions(
        vllm_config.speculative_config.num_speculative_tokens, cfg.draft_depth
    )


def register_tree_attn_backend() -> None:
    """Register TREE_ATTN as ``AttentionBackendEnum.CUSTOM`` (vLLM 0.26's slot
    for an out-of-tree backend), for a DDTree engine only; safe to call again.
    Another backend in that slot is an error for DDTree, never for other
    engines."""
    from vllm.v1.attention.backends.registry import (
        AttentionBackendEnum,
        register_backend,
    )

    custom = AttentionBackendEnum.CUSTOM
    if custom.is_overridden() and custom.get_path() != TREE_ATTN_BACKEND_PATH:
        raise ValueError(
            "method 'ddtree' verifies trees with TREE_ATTN, which vLLM 0.26 loads "
            "as AttentionBackendEnum.CUSTOM, but CUSTOM is already registered to "
            f"{custom.get_path()}; run DDTree where nothing else registers the "
            "CUSTOM backend (e.g. VLLM_PLUGINS=ddtree to load only this plugin), "
            f"or use that backend without DDTree ({TREE_ATTN_BACKEND_PATH} "
            "cannot share the slot)"
        )
    register_backend(custom, TREE_ATTN_BACKEND_PATH)


# ---------------------------------------------------------------------------
# 1-3. EngineArgs
# ---------------------------------------------------------------------------


def _create_speculative_config(
    original, self, target_model_config, target_parallel_config
):
    from vllm.v1.spec_decode import ddtree_config as ddt

    _fold_spec_flags(self)
    raw = self.speculative_config
    if not ddt.is_ddtree_method(raw):
        return original(self, target_model_config, target_parallel_config)

    parsed = ddt.parse_speculative_config(raw, target_model_config)
    budget, dflash = parsed.tree_budget, parsed.dflash
    ddt.check_engine_args(self, target_model_config)
    if target_parallel_config.tensor_parallel_size > 1:
        logger.warning(
            "DDTree has not been tested with tensor_parallel_size=%d; greedy "
            "output equal to no speculation is shown for tensor_parallel_size=1 "
            "only (docs/ddtree.md)",
            target_parallel_config.tensor_parallel_size,
        )
    _check_model_runner_env()
    self.speculative_config = dflash
    try:
        spec = original(self, target_model_config, target_parallel_config)
    except ValueError as e:
        raise ValueError(
            f"method 'ddtree' could not load {dflash['model']!r} as a DFlash "
            f"drafter for {target_model_config.model!r}: {e}"
        ) from e
    finally:
        self.speculative_config = raw
    cfg = ddt.DDTreeConfig.from_tree_budget(
        ddt.TreeBudget(budget, parsed.adaptive, parsed.schedule),
        ddt.draft_depth_of(spec.draft_model_config),
    )
    # The drafter's mask tokens run in its own batch, never in the target's:
    # no step slots to reserve (vLLM 0.26 reserves B - 1 per request for DFlash).
    spec.parallel_drafting = False
    self.additional_config = {
        **(self.additional_config or {}),
        ddt.ADDITIONAL_CONFIG_KEY: cfg.to_dict(),
    }
    _use_tree_attention(self)
    register_tree_attn_backend()
    # vLLM's own config line prints the DFlash config DDTree runs on
    # (method='dflash', num_spec_tokens = the draft slots): say so.
    logger.info(
        "DDTree: %s tree_budget=%d%s, drafter %s drafts %d positions per step "
        "(vLLM's engine config line shows it as SpeculativeConfig(method='dflash', "
        "model=%r, num_spec_tokens=%d): the draft slots DDTree's trees use)",
        "adaptive (a per-request cap; each step's trees sized by measured cost "
        "and acceptance)"
        if cfg.adaptive
        else "fixed",
        cfg.tree_budget,
        f" (per batch size: {[list(r) for r in parsed.schedule]})"
        if parsed.schedule
        else "",
        dflash["model"],
        cfg.draft_depth,
        spec.draft_model_config.model,
        spec.num_speculative_tokens,
    )
    return spec


def _fold_spec_flags(args) -> None:
    """``--spec-method ddtree [--spec-model M]`` -> the speculative-config dict."""
    from vllm.v1.spec_decode.ddtree_config import DDTREE_METHOD

    if args.spec_method != DDTREE_METHOD:
        return
    if args.spec_tokens is not None:
        raise ValueError(
            "method 'ddtree' sizes its trees with 'tree_budget'; drop --spec-tokens "
            "and pass --speculative-config '{\"tree_budget\": ...}'"
        )
    raw = dict(args.speculative_config or {})
    for key, value in (("method", args.spec_method), ("model", args.spec_model)):
        if value is None:
            continue
        if key in raw:
            raise ValueError(
                f"--spec-{key} and --speculative-config['{key}'] are mutually exclusive"
            )
        raw[key] = value
    args.speculative_config = raw
    args.spec_method = args.spec_model = None


def _add_cli_args(original, parser, *args, **kwargs):
    """vLLM infers the device while it builds the CLI's parser and, finding
    none, stops with "Failed to infer device type", before any speculative
    config is read: say first what DDTree needs (an engine built in code gets
    DDTree's own error, ``_check_cuda_platform``)."""
    from vllm.platforms import current_platform

    if not current_platform.device_type:
        logger.error(
            "DDTree: vLLM finds no GPU on this machine and stops below "
            '("Failed to infer device type"). Method "ddtree" needs an NVIDIA '
            "GPU with CUDA (Troubleshooting in DDTree's guide, docs/ddtree.md)"
        )
    return original(parser, *args, **kwargs)


def _check_cuda_platform() -> None:
    """DDTree's kernels and its MRv2 wiring need a CUDA GPU; without one vLLM
    would fail later with a message that does not say so."""
    from vllm.platforms import current_platform

    if current_platform.device_type != "cuda":
        raise ValueError(
            "method 'ddtree' needs a CUDA GPU (its kernels are Triton kernels "
            "for NVIDIA GPUs, tested on Hopper), but vLLM's platform here is "
            f"{current_platform.device_type or 'none'}. Run on a machine with an "
            "NVIDIA GPU, or leave out speculative_config (or pick a method "
            "this platform supports)."
        )


def _check_model_runner_env() -> None:
    import vllm.envs as envs

    if envs.VLLM_USE_V2_MODEL_RUNNER is False:
        raise ValueError(
            "DDTree runs on vLLM's Model Runner V2; unset VLLM_USE_V2_MODEL_RUNNER=0"
        )


def _use_tree_attention(args) -> None:
    """The target verifies trees with TREE_ATTN (``AttentionBackendEnum.CUSTOM``)."""
    from vllm.config import replace
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.spec_decode.ddtree_config import target_attention_backend

    chosen = args.attention_backend
    if chosen is None:
        chosen = args.attention_config.backend
    target_attention_backend(chosen)
    if args.attention_backend is None:
        args.attention_config = replace(
            args.attention_config, backend=AttentionBackendEnum.CUSTOM
        )


def _set_batch_defaults(original, self, usage_context, model_config, parallel_config):
    from vllm.v1.spec_decode.ddtree_config import (
        ADDITIONAL_CONFIG_KEY,
        DDTreeConfig,
        batch_limits,
        cudagraph_capture_sizes,
        is_ddtree_method,
    )

    seqs_from_user = self.max_num_seqs is not None
    tokens_from_user = self.max_num_batched_tokens is not None
    original(self, usage_context, model_config, parallel_config)
    # The user's own speculative config (create_speculative_config keeps it as
    # given) says whether this is a DDTree engine, not any additional_config key.
    if not is_ddtree_method(self.speculative_config):
        return
    raw = self.additional_config[ADDITIONAL_CONFIG_KEY]
    cfg = DDTreeConfig.from_dict(raw)
    seqs, tokens = batch_limits(
        cfg,
        self.max_num_seqs,
        self.max_num_batched_tokens,
        seqs_from_user,
        tokens_from_user,
    )
    if not cfg.adaptive and seqs * cfg.verify_len > tokens:
        logger.warning(
            "DDTree: max_num_batched_tokens=%d holds full trees for %d of "
            "max_num_seqs=%d requests; the scheduler trims the others' trees",
            tokens,
            tokens // cfg.verify_len,
            seqs,
        )
    self.max_num_seqs, self.max_num_batched_tokens = seqs, tokens
    cc = self.compilation_config
    if (
        self.cudagraph_capture_sizes is not None
        or cc.cudagraph_capture_sizes is not None
    ):
        return  # the user's sizes
    if (
        self.max_cudagraph_capture_size is not None
        and cc.max_cudagraph_capture_size is not None
    ):
        return  # vLLM refuses both settings together
    # Sizes in DDTree's shapes up to the user's maximum or vLLM's default one.
    max_size = self.max_cudagraph_capture_size
    if max_size is None:
        max_size = cc.max_cudagraph_capture_size
    if max_size is not None and max_size < 1:
        return  # vLLM's own check of the setting applies
    cc = copy.copy(cc)
    cc.cudagraph_capture_sizes = cudagraph_capture_sizes(
        cfg,
        seqs,
        tokens,
        max_size,
        interactivity=self.performance_mode == "interactivity",
    )
    # vLLM requires a user's maximum to equal the largest size, and the sizes
    # stop at max_num_batched_tokens (vLLM's own would too): the user's field
    # gets the largest size.
    if self.max_cudagraph_capture_size is not None:
        self.max_cudagraph_capture_size = cc.cudagraph_capture_sizes[-1]
    elif cc.max_cudagraph_capture_size is not None:
        cc.max_cudagraph_capture_size = cc.cudagraph_capture_sizes[-1]
    self.compilation_config = cc


def _warn_ungraphed_trees(vllm_config, cfg) -> None:
    """From the finished config: vLLM settles the graph mode and drops capture
    sizes above the step's token limit after the engine arguments."""
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.spec_decode.ddtree_config import first_ungraphed_batch

    cc = vllm_config.compilation_config
    if cc.cudagraph_mode in (None, CUDAGraphMode.NONE):
        return
    sched = vllm_config.scheduler_config
    largest = cc.max_cudagraph_capture_size or 0
    first = first_ungraphed_batch(
        cfg, sched.max_num_seqs, sched.max_num_batched_tokens, largest
    )
    if first is None:
        return
    logger.warning(
        "DDTree: tree_budget=%d verifies %d tokens per request and step, so "
        "steps of %d or more running requests (up to max_num_seqs=%d) exceed "
        "the largest CUDA graph (%d tokens) and run without graphs, where a "
        "DFlash chain still has one; large trees pay off at small batches. "
        "Serving many concurrent requests, use tree_budget 'auto' or "
        "tree_budget_per_batch_size (docs/ddtree.md, Budgets)",
        cfg.tree_budget,
        cfg.verify_len,
        first,
        sched.max_num_seqs,
        largest,
    )


def _create_engine_config(original, self, *args, **kwargs):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from vllm.v1.spec_decode.ddtree_config import DDTREE_METHOD, is_ddtree_method

    if is_ddtree_method(getattr(self, "speculative_config", None)) or (
        getattr(self, "spec_method", None) == DDTREE_METHOD
    ):
        # Before vLLM infers the device, which fails without a word of DDTree.
        _check_cuda_platform()
    custom = AttentionBackendEnum.CUSTOM
    was_registered = custom.is_overridden()
    try:
        return _finish_engine_config(original, self, *args, **kwargs)
    except BaseException:
        # A DDTree engine that fails to build leaves no TREE_ATTN registration
        # behind in this process (point 1 registered it for this engine only).
        if not was_registered and custom.is_overridden():
            if custom.get_path() == TREE_ATTN_BACKEND_PATH:
                custom.clear_override()
        raise


def _finish_engine_config(original, self, *args, **kwargs):
    vllm_config = original(self, *args, **kwargs)
    cfg = _ddtree_of(vllm_config)
    if cfg is not None and not vllm_config.use_v2_model_runner:
        raise ValueError(
            "DDTree runs on vLLM's Model Runner V2, which vLLM 0.26 does not pick "
            f"for {vllm_config.model_config.model!r} with these settings (see the "
            "'Model Runner V2 does not yet support' warning above); DDTree serves "
            "dense decoder models such as Qwen3"
        )
    if (
        cfg is not None
        and cfg.step_budgets
        and vllm_config.speculative_config.uses_dynamic_speculative_decoding()
        and not vllm_config.scheduler_config.async_scheduling
    ):
        # vLLM 0.26 applies a per-batch-size draft count only through the async
        # scheduler's draft placeholders.
        if cfg.adaptive:
            logger.warning(
                "DDTree: the adaptive budget's draft slots per batch size take "
                "effect with async scheduling only; without it the scheduler "
                "gives every request tree_budget=%d slots (their KV and step "
                "tokens, so fewer requests run at once) whatever budget a step "
                "then verifies (use async scheduling, or a smaller tree_budget)",
                cfg.tree_budget,
            )
        else:
            logger.warning(
                "DDTree: a budget per batch size (tree_budget_per_batch_size or "
                "tree_budget 'auto') takes effect with async scheduling only; "
                "without it every step verifies tree_budget=%d nodes (set an "
                "integer tree_budget to choose one for every batch size)",
                cfg.tree_budget,
            )
    if cfg is not None:
        _warn_ungraphed_trees(vllm_config, cfg)
    return vllm_config


# ---------------------------------------------------------------------------
# 4-7. Engine core and workers
# ---------------------------------------------------------------------------


def _scheduler_init(original, self, *args, **kwargs):
    original(self, *args, **kwargs)
    cfg = _ddtree_of(self.vllm_config)
    if cfg is None:
        return
    # The drafter writes KV for [bonus, mask x depth] past the committed
    # tokens; DFlash's default (num_speculative_tokens + 1 = B + 1) is too
    # small for B < depth and wastes KV for larger B.
    self.num_lookahead_tokens = cfg.draft_len
    # vLLM sizes per-position stats by num_speculative_tokens (tree_budget),
    # and indexes them by draft token; a tree's path is draft_depth long at most.
    from vllm_ddtree.spec_stats import make_tree_spec_decoding_stats

    self.make_spec_decoding_stats = functools.partial(
        make_tree_spec_decoding_stats, self, _num_draft_positions(self.vllm_config, cfg)
    )
    # Structured-output requests decode without drafts (their grammar would
    # have to follow every tree path): the ids of those not finished yet, and
    # the drop schedule() calls (imported here, not at plugin load nor on
    # every step).
    from vllm.v1.spec_decode.ddtree_grammar import drop_grammar_drafts

    self._ddtree_grammar_reqs = set()
    self._ddtree_drop_grammar_drafts = drop_grammar_drafts
    _size_grammar_bitmask(self.structured_output_manager, self.max_num_running_reqs)
    if cfg.adaptive:
        from vllm.v1.spec_decode.ddtree_config import engine_tree_slots, slot_ladder
        from vllm.v1.spec_decode.ddtree_slots import TreeSlots, trim_dropped_slots

        # Draft slots per request by batch size: a cap that keeps the step's
        # tokens and KV within the trees the budget can choose, lowered to
        # what the worker's budget uses; vLLM's lookup would read the ladder
        # listed in the speculative config.
        self.dynamic_sd_lookup = TreeSlots(
            engine_tree_slots(cfg, self.vllm_config), slot_ladder(cfg)
        )
        # The slots the last schedule gave (async scheduling's placeholders),
        # the schedules left that free blocks past each request's next tree,
        # and the budget of the step whose output is being processed.
        self._ddtree_slots_given: int | None = None
        self._ddtree_trims_left = 0
        self._ddtree_step_budget: int | None = None
        # The trim schedule() runs on every step (kept here so that no import
        # runs per step).
        self._ddtree_trim_dropped_slots = trim_dropped_slots


def _size_grammar_bitmask(manager, max_num_reqs: int) -> None:
    """vLLM allocates the grammar bitmask for ``1 + num_speculative_tokens``
    rows per request (``tree_budget``: gigabytes of host memory for a large
    vocabulary); a DDTree engine's structured-output requests verify no
    drafts, one row each."""
    fill = manager.grammar_bitmask

    @functools.wraps(fill)
    def grammar_bitmask(requests, request_ids, *args, **kwargs):
        if request_ids and manager._grammar_bitmask is None:
            manager._grammar_bitmask = manager.backend.allocate_token_bitmask(
                max_num_reqs
            )
        return fill(requests, request_ids, *args, **kwargs)

    manager.grammar_bitmask = grammar_bitmask


def _scheduler_add_request(original, self, request, *args, **kwargs):
    original(self, request, *args, **kwargs)
    grammar = getattr(self, "_ddtree_grammar_reqs", None)
    if grammar is not None and request.use_structured_output:
        grammar.add(request.request_id)


def _scheduler_schedule(original, self, *args, **kwargs):
    grammar = getattr(self, "_ddtree_grammar_reqs", None)
    if grammar:
        # Before the step is sized.
        self._ddtree_drop_grammar_drafts(grammar, self.requests)
    kept = None
    trim = getattr(self, "_ddtree_trim_dropped_slots", None)
    if trim is not None:  # an adaptive budget
        kept = trim(self)
    out = original(self, *args, **kwargs)
    if kept:
        # The worker cuts the same rows before it appends this step's blocks.
        out.ddtree_kept_blocks = kept
    return out


def _scheduler_update_from_output(original, self, scheduler_output, output, *a, **k):
    report = getattr(output, "ddtree_budget", None)
    if report is None or not hasattr(self, "_ddtree_step_budget"):
        return original(self, scheduler_output, output, *a, **k)
    # The step's nodes per request, for the spec-decode counters; the next
    # budget, for the slots.
    self._ddtree_step_budget = report.step_budget
    self.dynamic_sd_lookup.advise(report.num_reqs, report.next_budget)
    try:
        return original(self, scheduler_output, output, *a, **k)
    finally:
        self._ddtree_step_budget = None


def _model_runner_init(original, self, vllm_config, *args, **kwargs):
    if _ddtree_of(vllm_config) is not None:
        # Before the model (and its attention layers) is built in this worker.
        register_tree_attn_backend()
    original(self, vllm_config, *args, **kwargs)


def _load_model(original, self, *args, **kwargs):
    if _ddtree_of(self.vllm_config) is None:
        return original(self, *args, **kwargs)
    # MRv2 sizes the structured-output bitmask by max_num_reqs x (1 +
    # tree_budget) logit rows (vocab / 32 words each: ~10 GiB for 512
    # requests, budget 1024 and a 152K vocabulary); a step never has more
    # logit rows than tokens.
    module = sys.modules[type(self).__module__]
    worker_cls = module.StructuredOutputsWorker
    max_rows = self.vllm_config.scheduler_config.max_num_batched_tokens

    def sized(max_num_logits: int, **kw):
        return worker_cls(max_num_logits=min(max_num_logits, max_rows), **kw)

    module.StructuredOutputsWorker = sized
    try:
        out = original(self, *args, **kwargs)
    finally:
        module.StructuredOutputsWorker = worker_cls
    _trim_prompt_logprobs_of(self)
    speculator = _ddtree_speculator(self)
    if speculator is not None and getattr(self, "sampler", None) is not None:
        # The speculator verifies its own drafts: its tree sampler takes the
        # rejection-sampler slot, where vLLM built its chain sampler.
        self.rejection_sampler = speculator.init_rejection_sampler(
            self.sampler, self.speculative_config, self.device
        )
    adaptive = _adaptive_of(self)
    if adaptive is not None:
        # The budget's kernels, for every tree width and step cap, compiled
        # side by side before vLLM's profile run, whose dummy step would
        # otherwise meet its batch's variants first and compile them one by
        # one (they need the drafter, not the KV cache).
        adaptive.warm_up(self)
    return out


def _ddtree_speculator(runner):
    """The runner's ``DDTreeSpeculator``, or None. A runner whose process never
    loaded DDTree's speculator module has none (checked without importing it)."""
    module = sys.modules.get("vllm.v1.spec_decode.ddtree")
    speculator = getattr(runner, "speculator", None)
    if module is None or not isinstance(speculator, module.DDTreeSpeculator):
        return None
    return speculator


def _add_requests(original, self, scheduler_output, *args, **kwargs):
    original(self, scheduler_output, *args, **kwargs)
    speculator = _ddtree_speculator(self)
    if speculator is None:
        return
    # vLLM's loop over the joining requests, after it: each one's slot holds
    # no tree until the speculator drafts one (MRv2's RequestState life cycle).
    index = self.req_states.req_id_to_index
    for new_req_data in scheduler_output.scheduled_new_reqs:
        speculator.add_request(index[new_req_data.req_id], new_req_data)


def _trim_prompt_logprobs_of(runner) -> None:
    """A DDTree runner's prompt logprobs without the rows of a padded join's
    placeholder drafts, where vLLM's worker still returns them (vLLM 0.26.0;
    the upstream series fixes ``compute_prompt_logprobs`` itself for every
    speculator). Called for DDTree runners only: DFlash and EAGLE engines keep
    vLLM's behaviour."""
    worker = getattr(runner, "prompt_logprobs_worker", None)
    if worker is None or getattr(worker.compute_prompt_logprobs, _PATCHED, False):
        return
    from vllm.v1.worker.gpu.sample import prompt_logprob
    from vllm.v1.worker.gpu.sample.prompt_logprob_rows import (
        num_prompt_tokens_scheduled,
    )

    if getattr(prompt_logprob, "num_prompt_tokens_scheduled", None) is not None:
        return  # vLLM's worker counts the prompt tokens itself.
    compute = worker.compute_prompt_logprobs

    @functools.wraps(compute)
    def trimmed(logits_fn, hidden_states, input_batch, *args, **kwargs):
        out = compute(logits_fn, hidden_states, input_batch, *args, **kwargs)
        if not out:
            return out
        # The prompt lengths from the runner's request state (what MRv2 passes
        # in), not from the call's argument positions.
        prompt_lens = runner.req_states.prompt_len.np[input_batch.idx_mapping_np]
        num_prompt_tokens = num_prompt_tokens_scheduled(
            input_batch.num_scheduled_tokens,
            input_batch.num_computed_prefill_tokens_np,
            prompt_lens,
        )
        excess = input_batch.num_scheduled_tokens - num_prompt_tokens
        return _without_last_rows(out, input_batch.req_ids, excess)

    setattr(trimmed, _PATCHED, True)
    worker.compute_prompt_logprobs = trimmed


def _without_last_rows(prompt_logprobs: dict, req_ids: list[str], excess) -> dict:
    """``prompt_logprobs`` less each request's last ``excess`` rows (batch
    order), dropping a request left with none. vLLM 0.26's rows end at the
    step's last scheduled token; the ones past the prompt are placeholders'.
    The dict holds only requests that asked for prompt logprobs."""
    index = {req_id: i for i, req_id in enumerate(req_ids)}
    out = {}
    for req_id, tensors in prompt_logprobs.items():
        extra = int(excess[index[req_id]])
        keep = tensors.logprobs.shape[0] - extra
        if extra <= 0:
            out[req_id] = tensors
        elif keep > 0:
            out[req_id] = tensors._replace(
                logprob_token_ids=tensors.logprob_token_ids[:keep],
                logprobs=tensors.logprobs[:keep],
                selected_token_ranks=tensors.selected_token_ranks[:keep],
            )
    return out


def _adaptive_of(runner):
    return getattr(getattr(runner, "speculator", None), "adaptive", None)


def _capture_model(original, self, *args, **kwargs):
    out = original(self, *args, **kwargs)
    adaptive = _adaptive_of(self)
    if adaptive is not None:
        # Every step shape is captured now: time them for the cost model.
        adaptive.profile(self)
    return out


def _execute_model(original, self, scheduler_output, *args, **kwargs):
    adaptive = _adaptive_of(self)
    if adaptive is not None and not kwargs.get("dummy_run", False):
        kept = getattr(scheduler_output, "ddtree_kept_blocks", None)
        if kept:
            from vllm.v1.spec_decode.ddtree_slots import truncate_block_tables

            # Blocks the scheduler freed, before vLLM appends the new ones.
            truncate_block_tables(
                self.block_tables, self.req_states.req_id_to_index, kept
            )
        # The step's budget, before MRv2 pads and dispatches the batch.
        scheduler_output = adaptive.plan(scheduler_output)
    return original(self, scheduler_output, *args, **kwargs)


def _sample_tokens(original, self, *args, **kwargs):
    speculator = _ddtree_speculator(self)
    if speculator is None:
        out = original(self, *args, **kwargs)
    else:
        out = _with_sampler_output_to_propose(
            original, self, speculator, *args, **kwargs
        )
    adaptive = _adaptive_of(self)
    # MRv2's last rank returns its step's own output object (async or not).
    target = getattr(out, "model_runner_output", None)
    if adaptive is not None and target is not None:
        target.ddtree_budget = adaptive.report()
    return out


def _with_sampler_output_to_propose(original, runner, speculator, *args, **kwargs):
    """``original(runner, ...)`` (vLLM's ``sample_tokens``), whose
    ``speculator.propose`` call gets the step's sampler output (the tree walk)
    as ``sampler_output``: vLLM 0.26 keeps it from the speculator. For this call
    only, ``runner.sample`` passes its output on to ``speculator.propose``."""
    sample, propose = runner.sample, speculator.propose
    outputs = []

    def sample_and_keep(*a, **k):
        result = sample(*a, **k)
        outputs.append(result[0])
        return result

    def propose_with_output(*a, **k):
        return propose(*a, sampler_output=outputs[-1] if outputs else None, **k)

    with (
        _on_instance(runner, "sample", sample_and_keep),
        _on_instance(speculator, "propose", propose_with_output),
    ):
        return original(runner, *args, **kwargs)


@contextlib.contextmanager
def _on_instance(obj, name: str, value):
    """``obj.name = value`` on the instance for the ``with`` block, then what
    it was (the class's attribute, or an earlier instance attribute)."""
    own = vars(obj)
    had, old = name in own, own.get(name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if had:
            setattr(obj, name, old)
        else:
            delattr(obj, name)


def _prepare_inputs(original, self, *args, **kwargs):
    input_batch = original(self, *args, **kwargs)
    adaptive = _adaptive_of(self)
    if adaptive is not None:
        # The batch-wide split of the step's nodes, on the GPU.
        input_batch = adaptive.reallocate(self, input_batch)
    return input_batch


def _initialize_kv_cache(original, self, *args, **kwargs):
    out = original(self, *args, **kwargs)
    warm_up = getattr(self.model_state, "warm_up_tree_attention", None)
    if warm_up is not None:  # DDTree's model state (point 6)
        # KV caches, block tables and attention groups exist now, whatever the
        # CUDA-graph mode; capture then finds TREE_ATTN compiled.
        warm_up(self.block_tables, self.attn_groups)
    return out


def _init_speculator(original, vllm_config, device):
    if _ddtree_of(vllm_config) is None:
        return original(vllm_config, device)
    from vllm.v1.spec_decode.ddtree import DDTreeSpeculator

    return DDTreeSpeculator(vllm_config, device)


def _init_model_state(original, vllm_config, model, encoder_cache, device):
    state = original(vllm_config, model, encoder_cache, device)
    if _ddtree_of(vllm_config) is None:
        return state
    from vllm.v1.spec_decode.ddtree_verify import DDTreeModelState
    from vllm.v1.worker.gpu.model_states.default import DefaultModelState

    if type(state) is not DefaultModelState:
        raise ValueError(
            f"DDTree supports models on MRv2's DefaultModelState, but "
            f"{type(model).__name__} uses {type(state).__name__}"
        )
    return DDTreeModelState(vllm_config, model, encoder_cache, device)


class _DFlashSteps:
    """The steps of DFlash's ``propose`` that ``DDTreeSpeculator`` runs, as the
    series' first patch (``upstream/edits/0001-dflash-propose-steps.diff``)
    writes them in ``DFlashSpeculator``; :func:`_patch_dflash` adds them to
    vLLM 0.26's, whose ``propose`` is one body. A copy of the patch's methods:
    each must keep the syntax tree of the patched vLLM's method of its name."""

    def _store_context_kv(
        self,
        # [num_context, hidden_size]
        context_states: torch.Tensor,
        dummy_run: bool,
    ) -> None:
        """Pre-inserts the context K/V into the cache, at the context positions
        and slots the input preparation wrote. Runs eagerly outside the captured
        graph because the context shape varies per step."""
        num_context = context_states.shape[0]
        # During dummy runs the block tables are placeholders, so we skip the
        # cache write to avoid clobbering real entries. Each layer uses the
        # context slots of its own kv-cache group.
        if dummy_run:
            context_slots: torch.Tensor | list[torch.Tensor | None] | None = None
        elif self._layer_group_idx is not None:
            context_slots = [
                self._context_slot_mappings[gidx][:num_context]
                for gidx in self._layer_group_idx
            ]
        else:
            context_slots = self._context_slot_mappings[0][:num_context]
        self.model.precompute_and_store_context_kv(
            context_states,
            self.context_positions[:num_context],
            context_slots,
        )

    def _run_drafter(
        self,
        input_batch: InputBatch,
        num_tokens_across_dp: torch.Tensor | None,
        is_profile: bool,
        skip_attn: bool,
    ) -> int:
        """Runs the drafter over the prepared query block: replays the FULL
        CUDA graph of _generate_draft where one is captured, else calls it.
        Returns the padded number of query tokens it ran."""
        num_reqs = input_batch.num_reqs
        num_query_tokens = num_reqs * self.num_query_per_req
        max_seq_len = input_batch.seq_lens_cpu_upper_bound[:num_reqs].max().item()
        self.draft_max_seq_len = min(
            max_seq_len + self.num_query_per_req, self.max_model_len
        )

        if skip_attn:
            # Memory profiling path: no attention metadata, a minimal forward
            # pass. DFlash processes all speculative tokens in one forward pass,
            # so the real token count is num_query_tokens.
            self._prepare_eplb_forward(num_query_tokens)
            self._generate_draft(
                num_reqs,
                num_query_tokens,
                attn_metadata=None,
                slot_mappings=None,
                num_tokens_across_dp=num_tokens_across_dp,
                cudagraph_runtime_mode=CUDAGraphMode.NONE,
            )
            return num_query_tokens

        # Every DFlash step has exactly num_query_per_req tokens, so we can use FULL CGs
        batch_desc, num_tokens_across_dp = dispatch_cg_and_sync_dp(
            self.query_cudagraph_manager,
            num_reqs,
            num_query_tokens,
            uniform_token_count=self.num_query_per_req,
            dp_size=self.dp_size,
            dp_rank=self.dp_rank,
            need_eager=is_profile,
        )

        num_reqs_padded = batch_desc.num_reqs or num_reqs
        num_tokens_padded = batch_desc.num_tokens

        # Rebuild the draft attention metadata even when replaying the FULL
        # graph so that any attention metadata builder state is updated.
        draft_attn_metadata = self._build_draft_attn_metadata(
            num_reqs=num_reqs,
            num_reqs_padded=num_reqs_padded,
            num_tokens_padded=num_tokens_padded,
            causal=self._group_causal,
        )
        draft_slot_mappings_by_layer = build_slot_mappings_by_layer(
            self.block_tables.slot_mappings[:, :num_tokens_padded],
            self.kv_cache_config,
        )

        # DFlash processes all speculative tokens in one forward pass,
        # so the real token count is num_query_tokens.
        self._prepare_eplb_forward(num_query_tokens)

        if batch_desc.cg_mode == CUDAGraphMode.FULL:
            assert self.query_cudagraph_manager is not None
            self.query_cudagraph_manager.run_fullgraph(batch_desc)
        else:
            self._generate_draft(
                num_reqs,
                num_tokens_padded,
                draft_attn_metadata,
                draft_slot_mappings_by_layer,
                num_tokens_across_dp=num_tokens_across_dp,
                cudagraph_runtime_mode=batch_desc.cg_mode,
            )
        return num_tokens_padded


# ---------------------------------------------------------------------------
# 8. Front end
# ---------------------------------------------------------------------------


def _prometheus_init(original, self, vllm_config, *args, **kwargs):
    cfg = _ddtree_of(vllm_config)
    if cfg is not None:
        from vllm_ddtree.spec_stats import positions_sized

        # One per-position series per drafter position, not per tree node.
        make = type(self)._spec_decoding_cls
        spec = positions_sized(
            vllm_config.speculative_config, _num_draft_positions(vllm_config, cfg)
        )
        self._spec_decoding_cls = lambda _spec, *a, **kw: make(spec, *a, **kw)
    original(self, vllm_config, *args, **kwargs)
