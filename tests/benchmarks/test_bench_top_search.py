# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""benchmarks/bench_top_search.py at a small shape (Triton's interpreter on the
CPU): each builder copy runs in its own process and every output is checked
against a stable sort, a wrong builder failing the run."""

import json

from benchmarks import bench_top_search


def test_two_copies_side_by_side(tmp_path):
    src = bench_top_search.CHECKOUT_BUILDER
    argv = ["--out", str(tmp_path), "--rows", "1", "--depth", "2", "--vocab", "700"]
    argv += ["--budgets", "15", "--iters", "1"]
    argv += ["--builder", f"a={src}", "--builder", f"b={src}"]
    assert bench_top_search.main(argv) == 0
    result = json.loads((tmp_path / "top_search.json").read_text())
    assert set(result) == {"a", "b"}
    for rows in result.values():
        assert [r["kind"] for r in rows] == list(bench_top_search.KINDS)
        assert all(r["equal_to_stable_sort"] for r in rows)
    assert (tmp_path / "top_search.md").read_text().count("| a | 15 |") == 3


def test_a_wrong_builder_fails_the_run(tmp_path):
    """A copy whose search keeps the wrong tokens (the last instead of the
    first): the run says so and fails."""
    src = bench_top_search.CHECKOUT_BUILDER.read_text()
    marker = "def _ranked_top_tokens("
    assert marker in src
    wrong = src.replace(marker, "def _right_ranked_top_tokens(") + (
        "\n\ndef _ranked_top_tokens(draft_logits, num_top):\n"
        "    lp, ids, lse = _right_ranked_top_tokens(draft_logits, num_top)\n"
        "    return lp, ids.flip(-1), lse\n"
    )
    path = tmp_path / "wrong_builder.py"
    path.write_text(wrong)
    argv = ["--out", str(tmp_path), "--rows", "1", "--depth", "1", "--vocab", "700"]
    argv += ["--budgets", "15", "--iters", "1", "--builder", f"wrong={path}"]
    assert bench_top_search.main(argv) == 1
    rows = json.loads((tmp_path / "top_search.json").read_text())["wrong"]
    assert not any(r["equal_to_stable_sort"] for r in rows)
