# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""DDTree settings: the user's speculative config, the checks it must pass, and the
batch limits it implies.

A user asks for DDTree with::

    --speculative-config '{"method": "ddtree", "model": "<DFlash drafter>",
                           "tree_budget": 128}'

DDTree drafts with vLLM's DFlash drafter, unchanged, so the request maps onto a
DFlash ``SpeculativeConfig`` with ``tree_budget`` draft slots per request: the
scheduler, the input batch and the CUDA graphs then size every decode step for
``tree_budget + 1`` verified tokens. Two numbers are DDTree's own, the tree budget
B and the drafter depth D (the drafter's block size minus one, 15 for DFlash's
blocks of 16, independent of B); :class:`DDTreeConfig` carries them to every
process. Where vLLM knows method ``"ddtree"`` (the upstream series), the tree
settings are ``SpeculativeConfig`` fields, checked and expanded by the functions
below. On stock vLLM 0.26 (the plugin) ``SpeculativeConfig`` forbids unknown
keys, so the engine runs a DFlash ``SpeculativeConfig`` and the settings travel
in ``VllmConfig.additional_config["vllm_ddtree"]`` (plain ints, picklable).
:meth:`DDTreeConfig.from_vllm_config` reads either.

A budget per batch size is asked for with ``tree_budget_per_batch_size``, a list of
inclusive ranges ``[[first_batch_size, last_batch_size, budget], ...]`` (the first
range starts at 1): it maps onto vLLM's dynamic speculative decoding
(``num_speculative_tokens_per_batch_size``), whose scheduler picks the number of
draft tokens of each step from the number of running requests. The drafter still
builds trees of the largest budget; since nodes are in best-first order, the first
b nodes the scheduler keeps are the best tree of budget b.

``"tree_budget": "auto"``, the default, is a cap of :data:`AUTO_TREE_BUDGET_CAP`
nodes per request with the adaptive budget, and with fixed budgets
:data:`AUTO_TREE_BUDGET_PER_BATCH_SIZE`, a schedule read off measured step times.

Every check raises ``ValueError`` with the setting to change.
"""

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple, get_args

from vllm.v1.spec_decode.ddtree_budget import MAX_BUDGETS as MAX_LADDER
from vllm.v1.spec_decode.ddtree_cost import budget_ladder
from vllm.v1.spec_decode.dflash_tree_builder import MAX_BUDGET, MAX_DEPTH

DDTREE_METHOD = "ddtree"
# The plugin's own key of VllmConfig.additional_config, written only for
# method="ddtree" (the value also names the method, and the engine's speculative
# config must be the DFlash config built for it): a user's "ddtree" key or
# another plugin's settings never turn DDTree on.
ADDITIONAL_CONFIG_KEY = "vllm_ddtree"
AUTO_TREE_BUDGET = "auto"
# The best budget falls as the batch grows, so the default picks one per batch
# size.
DEFAULT_TREE_BUDGET = AUTO_TREE_BUDGET
# The schedule "tree_budget": "auto" stands for, read off step times measured
# for a Qwen3-8B-shaped target and DFlash drafter (dummy weights) and the
# acceptance of a small trained target and drafter pair. Few requests: 31 nodes, as B
# nodes verify B + 1 tokens and 32 fill the tree kernel's query tiles where 33
# open another (plan_tree_attention). More: 15 nodes, the 16 tokens per request
# a DFlash chain verifies, so a step costs about what DFlash's does.
AUTO_TREE_BUDGET_PER_BATCH_SIZE: tuple[tuple[int, int, int], ...] = (
    (1, 4, 31),
    (5, 1024, 15),  # vLLM carries the last budget past the end
)
# "auto" with an adaptive budget: the cost model decides, up to 128 nodes per
# request (or the largest the target's start-up warm-up fits,
# max_warmup_budget). The drafter builds trees of the cap at small batches,
# whatever a step then verifies, so a cap that steps rarely reach costs every
# such step its build: on Qwen3-8B shapes the adaptive budget verified mostly
# 31-63 nodes at batch 1 (127 or more in a small share of steps) and fewer at
# larger batches, and with a cap of 1024 its batch-1 steps took 0.4-0.9 ms
# longer than with 128 at the same tree sizes. Up to MAX_BUDGET nodes stay a
# setting away, for targets whose steps grow slowly with tokens.
AUTO_TREE_BUDGET_CAP = 128
# Speculative-config key: true (the default) sizes each step's trees by
# measured cost and acceptance, with tree_budget a per-request cap; false
# verifies tree_budget nodes (or the schedule's) in every step.
ADAPTIVE_KEY = "adaptive_budget"
DEFAULT_ADAPTIVE = True
# The keys that size a ddtree config's trees (parse_tree_budget).
TREE_KEYS = ("tree_budget", "tree_budget_per_batch_size", ADAPTIVE_KEY)
# Keys of a ddtree speculative config passed to the DFlash drafter's config as is.
DRAFTER_KEYS = frozenset(
    {
        "model",
        "revision",
        "code_revision",
        "quantization",
        "draft_tensor_parallel_size",
        "max_model_len",
        "attention_backend",
        "kv_cache_dtype",
        "enforce_eager",
        "moe_backend",
        "draft_load_config",
    }
)
# KV cache dtypes TREE_ATTN reads and the tree KV compaction copies.
TREE_KV_CACHE_DTYPES = ("auto", "bfloat16", "float16")
# vLLM's default cap on CUDA-graph sizes, in tokens.
_VLLM_MAX_CAPTURE_SIZE = 512


@dataclass(frozen=True)
class DDTreeConfig:
    """The two numbers DDTree adds to a DFlash speculative config."""

    # B: tree nodes per request and step (the root is extra).
    tree_budget: int
    # D: drafter positions per step, the deepest a tree can be.
    draft_depth: int
    # The smaller budgets a step may verify per request (sorted, without
    # tree_budget): a tree_budget_per_batch_size schedule's, or with an
    # adaptive budget every ladder value (ddtree_cost.budget_ladder); empty
    # when every step verifies tree_budget nodes.
    step_budgets: tuple[int, ...] = ()
    # Each step's budget is chosen by measured cost and acceptance, and
    # tree_budget (or the schedule's budget for the batch size) is a
    # per-request cap.
    adaptive: bool = False
    # With adaptive: the user's caps per batch size, inclusive ranges
    # [(first, last, cap), ...] (empty: tree_budget at every batch size).
    caps: tuple[tuple[int, int, int], ...] = ()

    @property
    def verify_len(self) -> int:
        """Tokens a decoding request verifies per step: the root and B nodes."""
        return self.tree_budget + 1

    @property
    def draft_len(self) -> int:
        """Tokens the drafter runs per request: the root and D masks."""
        return self.draft_depth + 1

    @property
    def tokens_per_request(self) -> int:
        """Step tokens a decoding request needs: its tree and the drafter's
        block; with an adaptive budget only the drafter's block, as the
        scheduler sizes trees to the batch (:func:`scheduled_tree_budgets`)."""
        if self.adaptive:
            return self.draft_len
        return max(self.verify_len, self.draft_len)

    @property
    def all_budgets(self) -> tuple[int, ...]:
        """Every number of nodes a decode step may verify per request."""
        return (*self.step_budgets, self.tree_budget)

    @property
    def ladder(self) -> tuple[int, ...]:
        """Per-request budgets an adaptive step chooses from, 0 (no drafts)
        first."""
        return (0, *self.step_budgets, self.tree_budget)

    def cap_for(self, num_reqs: int) -> int:
        """The most nodes a request may verify in a batch of ``num_reqs``."""
        for first, last, cap in self.caps:
            if first <= num_reqs <= last:
                return cap
        # vLLM carries the last range's budget past its end.
        return self.caps[-1][2] if self.caps else self.tree_budget

    def to_dict(self) -> dict[str, Any]:
        return {
            "method": DDTREE_METHOD,
            "tree_budget": self.tree_budget,
            "draft_depth": self.draft_depth,
            "step_budgets": list(self.step_budgets),
            "adaptive": self.adaptive,
            "caps": [list(c) for c in self.caps],
        }

    @classmethod
    def from_tree_budget(cls, tree: "TreeBudget", draft_depth: int) -> "DDTreeConfig":
        """The config for checked tree settings and the drafter's depth."""
        budget = tree.tree_budget
        if tree.adaptive:
            # Every budget an adaptive step may choose, below the cap.
            smaller = adaptive_ladder(budget, tree.schedule)[1:-1]
        else:
            smaller = tuple(sorted({b for *_, b in tree.schedule} - {budget}))
        caps = tree.schedule if tree.adaptive else ()
        return cls(budget, draft_depth, smaller, tree.adaptive, caps)

    @classmethod
    def from_speculative_config(cls, spec: Any) -> "DDTreeConfig":
        """The config of a ``SpeculativeConfig(method="ddtree")``: its tree
        fields and its DFlash drafter's depth."""
        tree = tree_budget_of(
            spec.tree_budget, spec.tree_budget_per_batch_size, spec.adaptive_budget
        )
        return cls.from_tree_budget(tree, draft_depth_of(spec.draft_model_config))

    @classmethod
    def from_vllm_config(cls, vllm_config: Any) -> "DDTreeConfig | None":
        """The DDTree settings of an engine config, or None if DDTree is off."""
        spec = getattr(vllm_config, "speculative_config", None)
        if getattr(spec, "method", None) == DDTREE_METHOD:
            # vLLM with method "ddtree": the settings are the config's fields.
            return cls.from_speculative_config(spec)
        if vllm_has_ddtree_method():
            # There the method is the only switch: a DFlash engine that
            # carries the plugin's key stays DFlash.
            return None
        additional = getattr(vllm_config, "additional_config", None)
        if not isinstance(additional, Mapping):
            return None
        raw = additional.get(ADDITIONAL_CONFIG_KEY)
        if (
            not isinstance(raw, Mapping)
            or raw.get("method") != DDTREE_METHOD
            or getattr(spec, "method", None) != "dflash"
            or getattr(spec, "num_speculative_tokens", None) != raw.get("tree_budget")
        ):
            return None
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "DDTreeConfig":
        return cls(
            int(raw["tree_budget"]),
            int(raw["draft_depth"]),
            tuple(int(b) for b in raw.get("step_budgets", ())),
            bool(raw.get("adaptive", False)),
            tuple(tuple(int(v) for v in c) for c in raw.get("caps", ())),
        )


@functools.cache
def vllm_has_ddtree_method() -> bool:
    """Whether this vLLM takes method "ddtree" (the upstream series applied),
    rather than running DDTree through the plugin's DFlash config."""
    from vllm.config.speculative import SpeculativeMethod

    return DDTREE_METHOD in get_args(SpeculativeMethod)


def is_ddtree_method(speculative_config: Any) -> bool:
    """Whether a raw ``--speculative-config`` dict asks for DDTree."""
    return (
        isinstance(speculative_config, Mapping)
        and speculative_config.get("method") == DDTREE_METHOD
    )


class TreeBudget(NamedTuple):
    """A ddtree config's tree settings, checked and expanded
    (:func:`parse_tree_budget`)."""

    # The largest tree budget (nodes per request and step); the cap with an
    # adaptive budget.
    tree_budget: int
    # Each step's budget is chosen by cost and acceptance (ADAPTIVE_KEY).
    adaptive: bool
    # The schedule's ranges (first, last, budget); empty: one budget.
    schedule: tuple[tuple[int, int, int], ...]

    @property
    def num_speculative_tokens_per_batch_size(self) -> list[list[int]] | None:
        """vLLM's dynamic speculative decoding schedule for these settings.

        Fixed budgets: the schedule, if any. Adaptive: one range per ladder
        budget, largest first, so that vLLM captures uniform decode graphs for
        every budget a step may verify (the scheduler's draft slots per batch
        size are DDTree's own, :func:`scheduled_tree_budgets`)."""
        if self.adaptive:
            ladder = adaptive_ladder(self.tree_budget, self.schedule)[::-1]
            return [[i + 1, i + 1, b] for i, b in enumerate(ladder)]
        return [list(r) for r in self.schedule] or None


def parse_tree_budget(
    settings: Mapping[str, Any], target_model_config: Any = None
) -> TreeBudget:
    """Check and expand the tree keys (:data:`TREE_KEYS`) of a ddtree config;
    ``settings`` holds those the user gave, the others take their defaults.

    With a fixed budget per batch size (``adaptive_budget: false``) a
    ``tree_budget_per_batch_size`` schedule (or ``auto``'s) sets the budget of
    each batch size. With an adaptive budget (the default) the budget and the
    schedule are per-request caps, and ``"auto"`` is
    :data:`AUTO_TREE_BUDGET_CAP`. ``target_model_config`` (None: no bound) bounds every budget by
    what vLLM's start-up warm-up can run on the target
    (:func:`max_warmup_budget`): ``"auto"`` shrinks to fit, a budget the user
    gave is refused past it.
    """
    adaptive = settings.get(ADAPTIVE_KEY, DEFAULT_ADAPTIVE)
    check_adaptive_budget(adaptive)
    schedule = settings.get("tree_budget_per_batch_size")
    given = settings.get("tree_budget", DEFAULT_TREE_BUDGET)
    if given != AUTO_TREE_BUDGET:
        # Before the schedule's budget is compared with it, which true or
        # 12.0 would equal.
        check_tree_budget(given)
    if "tree_budget" in settings and given == AUTO_TREE_BUDGET and schedule is not None:
        raise ValueError(
            "tree_budget='auto' picks the budget itself; drop "
            "tree_budget_per_batch_size, or drop tree_budget to use your "
            "schedule"
        )
    limit = max_warmup_budget(target_model_config)
    # "auto" leaves the size to DDTree, so it shrinks to what the target can
    # run (the smallest tree still needs a budget of 1) rather than fail.
    fit = MAX_BUDGET if limit is None else max(limit, 1)
    if schedule is None and given == AUTO_TREE_BUDGET:
        if adaptive:
            given = min(AUTO_TREE_BUDGET_CAP, fit)
        else:
            schedule = [
                [first, last, min(budget, fit)]
                for first, last, budget in AUTO_TREE_BUDGET_PER_BATCH_SIZE
            ]
    if schedule is None:
        budget, ranges = given, ()
    else:
        ranges = tuple(parse_budget_schedule(schedule))
        budget = max(b for _, _, b in ranges)
        if given not in (budget, AUTO_TREE_BUDGET):
            raise ValueError(
                f"tree_budget={given!r} must equal the largest budget of "
                f"tree_budget_per_batch_size ({budget}), or be left out"
            )
    check_warmup_budget(budget, target_model_config, from_schedule=bool(ranges))
    if adaptive:
        ladder = adaptive_ladder(budget, ranges)
        if len(ladder) > MAX_LADDER:
            raise ValueError(
                f"DDTree: with adaptive_budget, tree_budget {budget} and the "
                f"caps of tree_budget_per_batch_size give {len(ladder)} "
                f"budgets to choose from ({sorted(ladder)}); at most "
                f"{MAX_LADDER}: use fewer distinct caps, or caps of the form "
                "2**k - 1"
            )
    return TreeBudget(budget, adaptive, ranges)


def max_warmup_budget(target_model_config: Any) -> int | None:
    """The largest tree budget vLLM's start-up warm-up can run on the target
    (None without a target config).

    Model Runner V2's ``warmup_kernels`` prefills requests of
    ``decode_query_len + 1`` prompt tokens with ids ``0, 1, ...``, then runs a
    decode step of ``decode_query_len`` tokens each, and ``decode_query_len``
    is ``B + 1`` for trees of B nodes. So ``B + 1`` must be a token of the
    vocabulary (the embedding lookup asserts), and ``2 * B + 3`` tokens must
    fit in ``max_model_len``: a block-table row holds ``max_model_len``
    rounded up to 128 tokens, and the warm-up's blocks can write past it;
    within ``max_model_len`` they also stay within the KV cache, which vLLM
    sizes for one request of that length. A tree of 1024 nodes needs
    ``max_model_len`` >= 2051."""
    if target_model_config is None:
        return None
    max_model_len = target_model_config.max_model_len
    vocab_size = target_model_config.get_vocab_size()
    return min((max_model_len - 3) // 2, vocab_size - 2)


def check_warmup_budget(
    tree_budget: int, target_model_config: Any, from_schedule: bool = False
) -> None:
    """Raise if vLLM's start-up warm-up cannot run trees of ``tree_budget``
    nodes on the target as it is now (:func:`max_warmup_budget`), naming the
    limit that binds and what to change. The parsers check it when the
    engine config is built; the model state checks it again once the KV
    cache is sized, since ``--max-model-len -1`` fits the length to GPU
    memory only then."""
    limit = max_warmup_budget(target_model_config)
    if limit is None or tree_budget <= limit:
        return
    model = target_model_config.model
    max_model_len = target_model_config.max_model_len
    what = (
        "the largest budget of tree_budget_per_batch_size"
        if from_schedule
        else "tree_budget"
    )
    if limit < 1:
        raise ValueError(
            f"DDTree cannot run on {model!r} at max_model_len={max_model_len}: "
            "vLLM's start-up warm-up of the smallest tree (1 node) needs "
            "max_model_len >= 5 and a vocabulary of 3 tokens or more"
        )
    if 2 * tree_budget + 3 > max_model_len:
        fitted = (
            " (fitted to GPU memory for --max-model-len -1)"
            if getattr(target_model_config, "original_max_model_len", None) == -1
            else ""
        )
        raise ValueError(
            f"DDTree: {what} {tree_budget} needs --max-model-len >= "
            f"{2 * tree_budget + 3} (vLLM's start-up warm-up runs a "
            f"{tree_budget + 2}-token prompt, then a {tree_budget + 1}-token tree "
            f"step per request); {model!r} runs at max_model_len="
            f"{max_model_len}{fitted}: raise it, or set {what} to at most {limit}"
        )
    raise ValueError(
        f"DDTree: {what} {tree_budget} is too large for {model!r}: vLLM's "
        f"start-up warm-up feeds token ids up to {tree_budget + 1}, and its "
        f"vocabulary has {target_model_config.get_vocab_size()} tokens; set "
        f"{what} to at most {limit}"
    )


def check_tree_setting(key: str, value: Any) -> None:
    """Check one tree key (:data:`TREE_KEYS`) as the user gave it, before any
    conversion: its type and range, not how it goes with the other keys
    (:func:`parse_tree_budget`). ``SpeculativeConfig``'s tree fields run it
    on the raw value, where pydantic's lax mode would take ``"12"`` or
    ``true`` as a budget and ``1`` as ``adaptive_budget``."""
    if key == "tree_budget":
        if value != AUTO_TREE_BUDGET:
            check_tree_budget(value)
    elif key == "tree_budget_per_batch_size":
        parse_budget_schedule(value)
    elif key == ADAPTIVE_KEY:
        check_adaptive_budget(value)
    else:
        raise ValueError(f"{key!r} is not one of DDTree's tree settings {TREE_KEYS}")


def tree_budget_of(
    tree_budget: Any = None,
    tree_budget_per_batch_size: Any = None,
    adaptive_budget: Any = None,
    target_model_config: Any = None,
) -> TreeBudget:
    """:func:`parse_tree_budget` of config fields, where None means not set."""
    values = (tree_budget, tree_budget_per_batch_size, adaptive_budget)
    return parse_tree_budget(
        {key: value for key, value in zip(TREE_KEYS, values) if value is not None},
        target_model_config,
    )


def check_draft_settings(
    model: Any, sets_draft_counts: bool, attention_backend: Any = None
) -> None:
    """What a ddtree config may say about its drafter: a DFlash drafter
    (``model``), no draft counts of its own (``sets_draft_counts``: it gives
    ``num_speculative_tokens`` or ``num_speculative_tokens_per_batch_size``;
    the tree keys size the trees) and a drafter backend that attends
    bidirectionally."""
    if sets_draft_counts:
        raise ValueError(
            "method 'ddtree' sizes its trees with 'tree_budget' (or "
            "'tree_budget_per_batch_size'); remove 'num_speculative_tokens' and "
            "'num_speculative_tokens_per_batch_size' from the speculative config "
            "(the drafter always drafts its full block)"
        )
    if not model:
        raise ValueError(
            "method 'ddtree' needs 'model': the path or Hugging Face name of a "
            "DFlash drafter for the target, e.g. "
            '{"method": "ddtree", "model": "z-lab/Qwen3-8B-DFlash-b16", '
            '"tree_budget": 128}'
        )
    backend = attention_backend
    tree_attn = _tree_attn_name()
    if backend is not None and str(getattr(backend, "name", backend)).upper() == (
        tree_attn
    ):
        raise ValueError(
            "the DFlash drafter attends bidirectionally within its block and "
            f"cannot use TREE_ATTN ({tree_attn}), which is causal-only; drop the "
            "speculative config's 'attention_backend' or name a non-causal "
            "backend such as FLASH_ATTN"
        )


class ParsedSpeculativeConfig(NamedTuple):
    """What :func:`parse_speculative_config` makes of a ``ddtree`` config."""

    # The largest tree budget (nodes per request and step).
    tree_budget: int
    # vLLM's DFlash speculative config (a dict SpeculativeConfig accepts).
    dflash: dict[str, Any]
    # Each step's budget is chosen by cost and acceptance (ADAPTIVE_KEY).
    adaptive: bool
    # The schedule's ranges (first, last, budget); empty: one budget.
    schedule: tuple[tuple[int, int, int], ...]


def parse_speculative_config(
    raw: Mapping[str, Any], target_model_config: Any = None
) -> ParsedSpeculativeConfig:
    """A ``{"method": "ddtree", ...}`` dict -> DDTree's settings and the DFlash
    config dict (stock vLLM, which has no ``ddtree`` method); the target's
    ``ModelConfig``, where given, bounds the tree budget
    (:func:`max_warmup_budget`).

    The dict is what vLLM's ``SpeculativeConfig`` accepts: method ``"dflash"``
    with ``tree_budget`` draft slots per request, and the tree settings'
    ``num_speculative_tokens_per_batch_size``
    (:attr:`TreeBudget.num_speculative_tokens_per_batch_size`).
    """
    cfg = {str(k).replace("-", "_"): v for k, v in raw.items()}
    cfg.pop("method")
    tree = parse_tree_budget(
        {k: cfg.pop(k) for k in TREE_KEYS if k in cfg}, target_model_config
    )
    check_draft_settings(
        cfg.get("model"),
        "num_speculative_tokens" in cfg
        or "num_speculative_tokens_per_batch_size" in cfg,
        cfg.get("attention_backend"),
    )
    unknown = sorted(set(cfg) - DRAFTER_KEYS)
    if unknown:
        raise ValueError(
            f"method 'ddtree' does not take {', '.join(map(repr, unknown))} in the "
            "speculative config; it takes 'method', 'tree_budget', "
            f"'tree_budget_per_batch_size', '{ADAPTIVE_KEY}' and the drafter "
            "settings "
            f"{', '.join(sorted(DRAFTER_KEYS))}"
        )
    dflash = {**cfg, "method": "dflash", "num_speculative_tokens": tree.tree_budget}
    per_batch_size = tree.num_speculative_tokens_per_batch_size
    if per_batch_size is not None:
        # Adaptive: the scheduler's own lookup from it is replaced (glue,
        # Scheduler.__init__).
        dflash["num_speculative_tokens_per_batch_size"] = per_batch_size
    return ParsedSpeculativeConfig(
        tree.tree_budget, dflash, tree.adaptive, tree.schedule
    )


def parse_budget_schedule(schedule: Any) -> list[tuple[int, int, int]]:
    """Check a ``tree_budget_per_batch_size`` schedule: vLLM's rules for dynamic
    speculative decoding schedules (inclusive, non-overlapping batch-size ranges,
    the first starting at 1) and a tree budget in [1, MAX_BUDGET] per range."""
    from vllm.v1.spec_decode.dynamic.utils import (
        validate_and_normalize_dynamic_sd_schedule,
    )

    example = "e.g. [[1, 1, 256], [2, 8, 64], [9, 64, 16]]"
    if isinstance(schedule, list | tuple):
        for entry in schedule:
            if isinstance(entry, list | tuple):
                for value in entry:
                    if isinstance(value, bool) or not isinstance(value, int):
                        raise ValueError(
                            "tree_budget_per_batch_size entries must be "
                            "[first_batch_size, last_batch_size, tree_budget] of "
                            f"integers, got {list(entry)!r}; {example}"
                        )
    try:
        parsed = validate_and_normalize_dynamic_sd_schedule(
            list(schedule) if isinstance(schedule, tuple) else schedule
        )
    except ValueError as e:
        message = (
            str(e)
            .replace(
                "num_speculative_tokens_per_batch_size", "tree_budget_per_batch_size"
            )
            .replace("num_speculative_tokens", "tree_budget")
        )
        if "tree_budget_per_batch_size" not in message:
            # vLLM's range checks name no setting.
            message = f"tree_budget_per_batch_size: {message}"
        raise ValueError(f"{message} ({example})") from e
    for first, last, budget in parsed:
        if not 1 <= budget <= MAX_BUDGET:
            raise ValueError(
                f"tree_budget_per_batch_size: the budget of batch sizes "
                f"{first}-{last} must be in [1, {MAX_BUDGET}], got {budget}"
            )
    return parsed


def check_tree_budget(budget: Any) -> None:
    if isinstance(budget, bool) or not isinstance(budget, int):
        raise ValueError(
            f"tree_budget must be an integer in [1, {MAX_BUDGET}] or "
            f"{AUTO_TREE_BUDGET!r}, got {budget!r}"
        )
    if not 1 <= budget <= MAX_BUDGET:
        raise ValueError(
            f"tree_budget must be in [1, {MAX_BUDGET}], got {budget}; "
            f"{AUTO_TREE_BUDGET!r} (the default) lets the cost model pick"
        )


def check_adaptive_budget(adaptive: Any) -> None:
    if not isinstance(adaptive, bool):
        raise ValueError(
            f"{ADAPTIVE_KEY} must be true (each step's tree sized by measured cost "
            f"and acceptance: the default) or false (every step verifies "
            f"tree_budget, or its schedule's budget for the batch size), got "
            f"{adaptive!r}"
        )


def draft_depth_of(draft_model_config: Any) -> int:
    """D = the DFlash drafter's block size - 1, after checking it is DFlash."""
    arch = draft_model_config.architecture
    if not arch.startswith("DFlash"):
        raise ValueError(
            f"method 'ddtree' drafts with a DFlash drafter, but "
            f"{draft_model_config.model!r} is a {arch}; point the speculative "
            "config's 'model' at a DFlash checkpoint (DFlashDraftModel)"
        )
    block_size = getattr(draft_model_config.hf_config, "block_size", None)
    if not isinstance(block_size, int) or not 2 <= block_size <= MAX_DEPTH + 1:
        raise ValueError(
            f"the DFlash drafter {draft_model_config.model!r} must declare an "
            f"integer 'block_size' in [2, {MAX_DEPTH + 1}] in its config.json "
            f"(DDTree drafts block_size - 1 positions), got {block_size!r}"
        )
    return block_size - 1


def num_draft_positions(num_speculative_tokens: int, draft_depth: int | None) -> int:
    """Draft positions per request and step, by which vLLM's spec-decode stats
    count acceptance (``SpecDecodingStats``, the Prometheus per-position
    series): the drafter's depth for a tree (``draft_depth``; its
    ``num_speculative_tokens`` nodes lie at most that deep, and position ``i``
    counts paths that reached depth ``i + 1``), else the chain's
    ``num_speculative_tokens``. ``SpeculativeConfig.num_draft_positions``
    where vLLM has method "ddtree"; the plugin's stats on stock vLLM."""
    return num_speculative_tokens if draft_depth is None else draft_depth


def check_engine_args(args: Any, target_model_config: Any) -> None:
    """Raise for engine settings DDTree cannot serve. ``args`` is vLLM's
    ``EngineArgs``; ``target_model_config`` its target ``ModelConfig``."""
    unsupported = {
        "pipeline parallelism (the drafter and the tree verifier need the whole "
        "model on one stage); drop --pipeline-parallel-size or use "
        "--tensor-parallel-size": args.pipeline_parallel_size > 1,
        "decode context parallelism (TREE_ATTN has no DCP support); drop "
        "--decode-context-parallel-size": args.decode_context_parallel_size > 1,
        "prefill context parallelism; drop --prefill-context-parallel-size": (
            args.prefill_context_parallel_size > 1
        ),
        "LoRA adapters; drop --enable-lora": bool(args.enable_lora),
        "KV connectors (a layer-wise KV save would capture tree KV before the "
        "accepted path is compacted); drop --kv-transfer-config": (
            args.kv_transfer_config is not None
        ),
        "KV offloading (vLLM builds it as a KV connector, untested with tree "
        "KV); drop --kv-offloading-size": (
            getattr(args, "kv_offloading_size", None) is not None
        ),
        "data parallelism (not tested with DDTree); drop --data-parallel-size": (
            args.data_parallel_size > 1
        ),
        f"kv_cache_dtype={args.kv_cache_dtype!r} (TREE_ATTN keeps KV in the "
        "model dtype); use --kv-cache-dtype auto": (
            args.kv_cache_dtype not in TREE_KV_CACHE_DTYPES
        ),
    }
    _raise_unsupported(unsupported)
    _check_target_model(target_model_config)


def _check_target_model(model_config: Any) -> None:
    name = model_config.model
    unsupported = {
        f"{name}: only text-generation models are supported": (
            model_config.runner_type != "generate"
        ),
        f"{name}: multimodal inputs are not supported": (
            model_config.is_multimodal_model
        ),
        f"{name}: multi-dimensional RoPE positions are not supported": (
            model_config.uses_mrope or model_config.uses_xdrope_dim > 0
        ),
        f"{name}: sliding-window attention is not supported by TREE_ATTN": (
            model_config.get_sliding_window() is not None
        ),
        f"{name}: hybrid (Mamba/linear-attention) models are not supported": (
            model_config.is_hybrid or model_config.is_attention_free
        ),
        f"{name}: encoder-decoder models are not supported": (
            model_config.is_encoder_decoder
        ),
    }
    _raise_unsupported(unsupported)


def _raise_unsupported(unsupported: Mapping[str, bool]) -> None:
    problems = [what for what, bad in unsupported.items() if bad]
    if problems:
        raise ValueError(
            "DDTree speculative decoding does not support " + "; ".join(problems)
        )


def _tree_attn_name() -> str:
    # Imported here, not at the top: the backend module loads attention
    # kernels, which a process that only reads these settings (the
    # scheduler's) does not need.
    from vllm.v1.attention.backends.tree_attn import TREE_ATTN_NAME

    return TREE_ATTN_NAME


def target_attention_backend(backend: Any) -> str:
    """The name of the target's attention backend for DDTree: TREE_ATTN's
    ``AttentionBackendEnum`` member (``TREE_ATTN_NAME``: its own, or ``CUSTOM``
    where vLLM has none). ``backend`` is what the user chose, if any."""
    tree_attn = _tree_attn_name()
    name = None if backend is None else str(getattr(backend, "name", backend))
    if name is not None and name.upper() not in (tree_attn, "AUTO"):
        raise ValueError(
            f"DDTree verifies trees with TREE_ATTN (attention backend {tree_attn}), "
            f"but the target's attention backend is set to {name}; drop "
            "--attention-backend / attention_config.backend (set the drafter's "
            "backend with the speculative config's 'attention_backend')"
        )
    return tree_attn


def batch_limits(
    cfg: DDTreeConfig,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    seqs_from_user: bool,
    tokens_from_user: bool,
) -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens) for DDTree, from vLLM's values.

    Every decoding request verifies B + 1 tokens per step and the drafter runs
    D + 1 per request, so a full batch needs ``max_num_seqs * max(B + 1, D + 1)``
    step tokens. Values the user did not set are fitted (fewer sequences at large
    budgets, never fewer tokens than vLLM's default); values the user set are
    checked, naming the setting to change.
    """
    per_req = cfg.tokens_per_request
    if not tokens_from_user:
        if not seqs_from_user:
            max_num_seqs = max(1, min(max_num_seqs, max_num_batched_tokens // per_req))
        max_num_batched_tokens = max(max_num_batched_tokens, max_num_seqs * per_req)
        return max_num_seqs, max_num_batched_tokens
    if max_num_batched_tokens < per_req:
        raise ValueError(
            f"max_num_batched_tokens={max_num_batched_tokens} cannot hold one DDTree "
            f"step ({per_req} tokens per request for tree_budget={cfg.tree_budget}); "
            f"raise --max-num-batched-tokens to at least {per_req} or lower "
            "tree_budget"
        )
    if not seqs_from_user:
        return min(max_num_seqs, max_num_batched_tokens // per_req), (
            max_num_batched_tokens
        )
    if max_num_seqs * cfg.draft_len > max_num_batched_tokens:
        raise ValueError(
            f"max_num_seqs={max_num_seqs} requests need {cfg.draft_len} drafter "
            f"tokens each, more than max_num_batched_tokens={max_num_batched_tokens}; "
            f"raise --max-num-batched-tokens to at least "
            f"{max_num_seqs * cfg.draft_len} or lower --max-num-seqs"
        )
    return max_num_seqs, max_num_batched_tokens


def default_max_capture_size(
    cfg: DDTreeConfig, max_num_seqs: int, max_num_batched_tokens: int
) -> int:
    """vLLM's default largest CUDA-graph size (``VllmConfig._set_cudagraph_sizes``:
    twice a full batch of decode steps, at most 512 tokens), but never less
    than one request's step, so that a single request's tree always verifies
    in a graph. MRv2 sizes the KV cache before capturing and reserves no
    memory for the graphs, so larger sizes are the user's choice
    (``--max-cudagraph-capture-size``): graphs up to ``max_num_batched_tokens``
    left an 8B target without memory for its first step."""
    per_req = cfg.tokens_per_request
    size = max(min(max_num_seqs * per_req * 2, _VLLM_MAX_CAPTURE_SIZE), per_req)
    return min(size, max_num_batched_tokens)


def cudagraph_capture_sizes(
    cfg: DDTreeConfig,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_size: int | None = None,
    interactivity: bool = False,
) -> list[int]:
    """Capture sizes up to ``max_size`` tokens (default
    :func:`default_max_capture_size`): vLLM's own ladder up to its default 512
    tokens (1, 2, 4, multiples of 8 below 256, of 16 from 256; every size up to
    32 with ``interactivity``), for mixed steps, plus multiples of b + 1 for
    every budget b a step may verify (the target's uniform tree-verify batches)
    and of D + 1 (the drafter's batches) for batches of 1, 2, 4, 8, 16, 24, ...
    requests. Above 512 tokens only those multiples: a raised maximum adds
    graphs for full batches, not one every 16 tokens."""
    if max_size is None:
        max_size = default_max_capture_size(cfg, max_num_seqs, max_num_batched_tokens)
    max_size = min(max_size, max_num_batched_tokens)
    ladder_max = min(max_size, _VLLM_MAX_CAPTURE_SIZE)
    sizes = set(range(1, min(ladder_max, 32) + 1)) if interactivity else {1, 2, 4}
    sizes |= set(range(8, min(ladder_max + 1, 256), 8))
    sizes |= set(range(256, ladder_max + 1, 16))
    num_reqs = [n for n in (1, 2, 4) if n < max_num_seqs]
    num_reqs += list(range(8, max_num_seqs, 8)) + [max_num_seqs]
    if not cfg.adaptive:
        # An adaptive step's uniform batches are vLLM's sizes rounded up to
        # a multiple of the step's b + 1 (vLLM's graph manager does that for
        # every budget of the schedule); their count, not full trees, grows.
        sizes |= {n * (b + 1) for n in num_reqs for b in cfg.all_budgets}
    sizes |= {n * cfg.draft_len for n in num_reqs}
    # vLLM checks that a user's maximum is the largest size.
    sizes.add(max_size)
    return sorted(s for s in sizes if s <= max_size)


def adaptive_ladder(
    tree_budget: int, schedule: tuple[tuple[int, int, int], ...] = ()
) -> tuple[int, ...]:
    """Per-request budgets an adaptive step chooses from: 0, ``2**k - 1``
    below ``tree_budget``, the schedule's caps and ``tree_budget``."""
    return tuple(sorted(set(budget_ladder(tree_budget)) | {b for *_, b in schedule}))


def ladder_floor(ladder: tuple[int, ...], budget: int) -> int:
    """The largest ladder value at most ``budget`` (ladder[0] is 0)."""
    best = 0
    for b in ladder:
        if b <= budget:
            best = b
    return best


def scheduled_tree_budgets(
    cfg: DDTreeConfig,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_capture_size: int,
) -> list[int]:
    """Draft slots the scheduler gives each decoding request of an adaptive
    engine, by the number of scheduled requests (index 0 unused).

    A slot is a node the step may verify; the step's budget (chosen later, by
    cost) and the batch-wide ranking decide how many it does, so the slots
    are a cap: the user's (``cap_for``), and what keeps a step's trees within
    twice the largest CUDA graph (larger steps run eagerly and rarely pay) and
    within half of ``max_num_batched_tokens`` (the rest is left for prompts).
    Each slot also reserves a KV slot, which the request's next step rewrites
    where this one's nodes were rejected."""
    span = max(2 * max(max_capture_size, _VLLM_MAX_CAPTURE_SIZE), cfg.draft_len)
    span = min(span, max_num_batched_tokens // 2)
    slots = slot_ladder(cfg)
    return [0] + [
        ladder_floor(slots, min(cfg.cap_for(r), max(span // r - 1, 0)))
        for r in range(1, max_num_seqs + 1)
    ]


def engine_tree_slots(cfg: DDTreeConfig, vllm_config: Any) -> list[int]:
    """:func:`scheduled_tree_budgets` for a finished engine config: what the
    scheduler gives and what the worker's drafter and budget size for, from
    the same settings."""
    sched = vllm_config.scheduler_config
    return scheduled_tree_budgets(
        cfg,
        sched.max_num_seqs,
        sched.max_num_batched_tokens,
        vllm_config.compilation_config.max_cudagraph_capture_size or 0,
    )


def slot_ladder(cfg: DDTreeConfig) -> tuple[int, ...]:
    """The draft-slot counts the scheduler gives: 0, ``4**k - 1`` below the cap,
    the caps. Coarser than the step budgets' ladder: the drafter builds trees
    as wide as a batch's slots and the budget's kernels are compiled per width
    and per cap at start-up, and slots a few times the chosen budget leave the
    batch-wide split its room."""
    caps = {cap for *_, cap in cfg.caps} | {cfg.tree_budget}
    quarters = {b for b in cfg.ladder if _is_power_of_4(b + 1)}
    return tuple(sorted(quarters | caps))


def _is_power_of_4(n: int) -> bool:
    return n & (n - 1) == 0 and (n.bit_length() - 1) % 2 == 0


def first_ungraphed_batch(
    cfg: DDTreeConfig,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_capture_size: int,
) -> int | None:
    """The fewest running requests whose trees no longer fit the largest CUDA
    graph (``max_capture_size`` tokens) while a DFlash chain of the same drafter
    would still run in one, or None. Only for one budget at every batch size:
    such steps run eagerly, on top of verifying B + 1 rows per request."""
    if cfg.step_budgets or cfg.verify_len <= cfg.draft_len or max_capture_size < 1:
        return None  # adaptive budgets have step_budgets: they fit the batch
    if max_num_batched_tokens <= max_capture_size:
        return None  # no step is larger than the largest graph
    first = max_capture_size // cfg.verify_len + 1
    if first > max_num_seqs or first * cfg.draft_len > max_capture_size:
        return None
    return first
