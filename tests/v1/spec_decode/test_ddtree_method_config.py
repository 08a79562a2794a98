# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""DDTree's settings in both homes, through one parser and one reader: the
``SpeculativeConfig`` fields of vLLM's method ``"ddtree"`` (the upstream series,
where ``SpeculativeConfig`` calls :func:`tree_budget_of`) and the plugin's
``additional_config["vllm_ddtree"]`` next to a DFlash config (stock vLLM).

Stand-ins for the configs here; the scheduler's tests
(tests/v1/core/test_ddtree_scheduler.py) build the real engine config."""

from types import SimpleNamespace

import pytest

from vllm.v1.spec_decode import ddtree_config as ddt
from vllm.v1.spec_decode.ddtree_config import DDTreeConfig, TreeBudget

# Raw tree settings as a user gives them (the keys of TREE_KEYS only).
SETTINGS = [
    {},
    {"tree_budget": 128},
    {"tree_budget": 64, "adaptive_budget": False},
    {"adaptive_budget": False},
    {"tree_budget": "auto", "adaptive_budget": False},
    {"tree_budget_per_batch_size": [[1, 1, 64], [2, 8, 16], [9, 64, 4]]},
    {
        "tree_budget": 64,
        "tree_budget_per_batch_size": [[9, 64, 4], [1, 1, 64], [2, 8, 16]],
        "adaptive_budget": False,
    },
    {"tree_budget": 1},
]


def _drafter(block_size=16, architecture="DFlashDraftModel"):
    return SimpleNamespace(
        model="drafter",
        architecture=architecture,
        hf_config=SimpleNamespace(block_size=block_size),
    )


def _ddtree_spec(tree: TreeBudget, drafter=None):
    """What SpeculativeConfig(method="ddtree") keeps: the expanded settings,
    and num_speculative_tokens set from them."""
    return SimpleNamespace(
        method="ddtree",
        tree_budget=tree.tree_budget,
        tree_budget_per_batch_size=list(tree.schedule) or None,
        adaptive_budget=tree.adaptive,
        num_speculative_tokens=tree.tree_budget,
        num_speculative_tokens_per_batch_size=tree.num_speculative_tokens_per_batch_size,
        draft_model_config=drafter or _drafter(),
    )


def _fields_of(settings):
    return ddt.tree_budget_of(
        settings.get("tree_budget"),
        settings.get("tree_budget_per_batch_size"),
        settings.get("adaptive_budget"),
    )


def test_fields_left_as_none_take_the_defaults():
    assert ddt.tree_budget_of() == ddt.parse_tree_budget({})
    assert ddt.tree_budget_of() == TreeBudget(ddt.AUTO_TREE_BUDGET_CAP, True, ())
    assert ddt.tree_budget_of(8, None, False) == TreeBudget(8, False, ())


@pytest.mark.parametrize("key", ["tree_budget", "adaptive_budget"])
def test_a_raw_null_is_refused(key):
    """In the plugin's raw dict a key given as null is an error, as it always
    was; only config fields read None as not set."""
    with pytest.raises(ValueError, match=key):
        ddt.parse_tree_budget({key: None})


@pytest.mark.parametrize("settings", SETTINGS)
def test_expanded_settings_parse_to_themselves(settings):
    """SpeculativeConfig stores the expanded settings; the reader parses them
    again in every process, and must get the same."""
    tree = ddt.parse_tree_budget(settings)
    assert _fields_of(settings) == tree
    again = ddt.tree_budget_of(
        tree.tree_budget, list(tree.schedule) or None, tree.adaptive
    )
    assert again == tree


@pytest.mark.parametrize("settings", SETTINGS)
def test_vllm_gets_the_same_draft_counts_either_way(settings):
    """The plugin's DFlash dict and SpeculativeConfig(method="ddtree") give
    vLLM the same num_speculative_tokens and per-batch-size schedule."""
    parsed = ddt.parse_speculative_config(
        {"method": "ddtree", "model": "d", **settings}
    )
    tree = _fields_of(settings)
    assert parsed.dflash["num_speculative_tokens"] == tree.tree_budget
    assert parsed.dflash.get("num_speculative_tokens_per_batch_size") == (
        tree.num_speculative_tokens_per_batch_size
    )
    assert (parsed.tree_budget, parsed.adaptive, parsed.schedule) == tree


@pytest.mark.parametrize("settings", SETTINGS)
def test_one_reader_for_both_homes(settings):
    """DDTreeConfig.from_vllm_config gives the same config from the plugin's
    additional_config (next to the DFlash config built for it) and from the
    fields of a "ddtree" SpeculativeConfig; a vLLM that takes method "ddtree"
    (the series applied) reads the fields alone, so a DFlash engine carrying
    the plugin's key stays DFlash there."""
    parsed = ddt.parse_speculative_config(
        {"method": "ddtree", "model": "d", **settings}
    )
    tree = TreeBudget(parsed.tree_budget, parsed.adaptive, parsed.schedule)
    plugin_cfg = DDTreeConfig.from_tree_budget(tree, 15)
    dflash = SimpleNamespace(
        method="dflash", num_speculative_tokens=parsed.dflash["num_speculative_tokens"]
    )
    plugin = SimpleNamespace(
        speculative_config=dflash,
        additional_config={ddt.ADDITIONAL_CONFIG_KEY: plugin_cfg.to_dict()},
    )
    series = SimpleNamespace(
        speculative_config=_ddtree_spec(tree), additional_config={}
    )
    want = None if ddt.vllm_has_ddtree_method() else plugin_cfg
    assert DDTreeConfig.from_vllm_config(plugin) == want
    assert DDTreeConfig.from_vllm_config(series) == plugin_cfg


def test_ddtree_method_reads_its_fields_not_additional_config():
    """With method "ddtree" the plugin's key is not read (another build's
    settings there cannot win over the config's own)."""
    tree = ddt.tree_budget_of(64, None, False)
    stale = DDTreeConfig(8, 15).to_dict()
    config = SimpleNamespace(
        speculative_config=_ddtree_spec(tree),
        additional_config={ddt.ADDITIONAL_CONFIG_KEY: stale},
    )
    assert DDTreeConfig.from_vllm_config(config) == DDTreeConfig(64, 15)
    # The drafter's block sets the depth.
    deep = _ddtree_spec(tree, _drafter(block_size=8))
    assert DDTreeConfig.from_speculative_config(deep) == DDTreeConfig(64, 7)


def test_plugin_home_needs_its_dflash_config():
    """Stock vLLM: the settings count only next to the DFlash config built for
    them (a user's key never turns DDTree on)."""
    cfg = DDTreeConfig(64, 15)
    for spec in (
        None,
        SimpleNamespace(method="eagle3", num_speculative_tokens=64),
        SimpleNamespace(method="dflash", num_speculative_tokens=15),
    ):
        config = SimpleNamespace(
            speculative_config=spec,
            additional_config={ddt.ADDITIONAL_CONFIG_KEY: cfg.to_dict()},
        )
        assert DDTreeConfig.from_vllm_config(config) is None


@pytest.mark.parametrize(
    "drafter, match",
    [
        (_drafter(block_size=None), "must declare an integer 'block_size'"),
        (_drafter(architecture="Qwen3ForCausalLM"), "drafts with a DFlash drafter"),
    ],
)
def test_reader_checks_the_drafter(drafter, match):
    spec = _ddtree_spec(ddt.tree_budget_of(8, None, False), drafter)
    with pytest.raises(ValueError, match=match):
        DDTreeConfig.from_speculative_config(spec)


@pytest.mark.parametrize(
    "model, sets_draft_counts, match",
    [
        ("d", True, "sizes its trees with 'tree_budget'.*remove 'num_speculative"),
        (None, False, "method 'ddtree' needs 'model'"),
        ("", False, "method 'ddtree' needs 'model'"),
    ],
)
def test_draft_settings(model, sets_draft_counts, match):
    with pytest.raises(ValueError, match=match):
        ddt.check_draft_settings(model, sets_draft_counts)
    ddt.check_draft_settings("d", False)


@pytest.mark.parametrize(
    "schedule",
    [[[2, 8, 16]], [[1, 8, 16], [4, 9, 8]], [[1, 4]]],
)
def test_schedule_errors_name_the_key(schedule):
    """vLLM's schedule checks name no setting; DDTree's errors name its key."""
    with pytest.raises(ValueError, match="tree_budget_per_batch_size") as info:
        ddt.parse_tree_budget({"tree_budget_per_batch_size": schedule})
    assert "num_speculative_tokens" not in str(info.value)


@pytest.mark.parametrize(
    "key, value",
    [
        ("tree_budget", True),
        ("tree_budget", "12"),
        ("tree_budget", 12.0),
        ("tree_budget", 0),
        ("tree_budget_per_batch_size", [[1, True, 8]]),
        ("tree_budget_per_batch_size", [["1", 4, 8]]),
        ("tree_budget_per_batch_size", [[2, 8, 16]]),
        ("adaptive_budget", "yes"),
        ("adaptive_budget", 1),
    ],
)
def test_one_check_per_key(key, value):
    """check_tree_setting, which SpeculativeConfig's tree fields run on the
    raw value, refuses what the parser refuses, with the parser's message."""
    with pytest.raises(ValueError, match=key) as field:
        ddt.check_tree_setting(key, value)
    with pytest.raises(ValueError) as parsed:
        ddt.parse_tree_budget({key: value})
    assert str(field.value) == str(parsed.value)


@pytest.mark.parametrize("key", ddt.TREE_KEYS)
def test_one_check_per_key_takes_valid_values(key):
    valid = {
        "tree_budget": [1, 1024, "auto"],
        "tree_budget_per_batch_size": [[[1, 4, 63], [5, 64, 15]], ((1, 8, 7),)],
        "adaptive_budget": [True, False],
    }
    for value in valid[key]:
        ddt.check_tree_setting(key, value)
    with pytest.raises(ValueError, match="not one of DDTree's tree settings"):
        ddt.check_tree_setting("num_speculative_tokens", 8)


def test_a_budget_beside_a_schedule_is_still_an_integer():
    """true and 12.0 equal a schedule's budget of 1 or 12, and are refused
    all the same."""
    for budget, largest in ((True, 1), (12.0, 12)):
        with pytest.raises(ValueError, match="tree_budget must be an integer"):
            ddt.parse_tree_budget(
                {
                    "tree_budget": budget,
                    "tree_budget_per_batch_size": [[1, 4, largest]],
                }
            )


@pytest.mark.parametrize(
    "num_speculative_tokens, draft_depth, positions",
    [
        (128, 15, 15),  # a tree: the drafter's depth, not its nodes
        (4, 15, 15),  # a budget under the depth still reaches every depth
        (1024, 7, 7),
        (15, None, 15),  # a chain: its draft tokens
        (3, None, 3),
    ],
)
def test_num_draft_positions(num_speculative_tokens, draft_depth, positions):
    """SpeculativeConfig.num_draft_positions (the series) and the plugin's
    stats call this one function."""
    assert ddt.num_draft_positions(num_speculative_tokens, draft_depth) == positions


def test_num_draft_positions_of_a_ddtree_config_is_its_depth():
    """For the reader's config of a "ddtree" SpeculativeConfig, the positions
    are the depth its drafter gives (what the property reads)."""
    for block_size in (16, 8, 2):
        spec = _ddtree_spec(ddt.tree_budget_of(64, None, False), _drafter(block_size))
        depth = ddt.draft_depth_of(spec.draft_model_config)
        assert DDTreeConfig.from_speculative_config(spec).draft_depth == depth
        assert ddt.num_draft_positions(spec.num_speculative_tokens, depth) == (
            block_size - 1
        )
