# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""benchmarks/tree_attn_variants.py: which TREE_ATTN variants captures compile
and which only eager steps meet (the kernel planner, no kernel)."""

from benchmarks import tree_attn_variants as tav
from vllm.v1.attention.ops.triton_tree_attention import plan_tree_attention


def test_captured_and_eager_only_variants():
    result = tav.analyse(32, 8, 128, [15], max_num_seqs=8)
    captured = set(result["captured"])
    # Every uniform tree-verify step of the ladder is compiled by its capture.
    for n in (1, 2, 4, 8):
        main, _ = tav._variants(plan_tree_attention(n * 16, n, 32, 8, 128, 132))
        assert main in captured
    eager = result["eager_only"]
    assert eager and not set(eager) & captured
    # A one-token prompt alone runs its causal row in the kernel with 16-row
    # tiles, which no tree step of budget 15 uses.
    first = plan_tree_attention(1, 1, 32, 8, 128, 132)
    assert tav._variants(first)[0] in eager
    for variant, (budget, num_reqs, num_tokens) in eager.items():
        assert budget == 15 and num_reqs <= num_tokens <= num_reqs * 16
        assert variant in tav._variants(
            plan_tree_attention(num_tokens, num_reqs, 32, 8, 128, 132)
        )


def test_cli(capsys):
    assert tav.main(["--budgets", "15", "--max-num-seqs", "4"]) == 0
    out = capsys.readouterr().out
    assert "variants compiled by captures" in out and "met only by" in out
