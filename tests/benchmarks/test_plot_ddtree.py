# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""benchmarks/plot_ddtree.py on the CPU: synthetic bench_ddtree result directories
-> PNG files; the figures, the pixels where known points are drawn (through the
module's own data -> pixel transform), skipped rows, determinism, errors."""

import json
import math
import re

import pytest
from PIL import Image

from benchmarks import bench_ddtree_report as rep
from benchmarks import plot_ddtree as pd

BUDGETS = (16, 64, 256)


def _row(config, batch, temperature=0.0, run="r1", **kw):
    row = {"config": config, "batch": batch, "temperature": temperature, "run_id": run}
    row.update(kw)
    return row


def _results(path, rows, mode=None):
    path.mkdir(parents=True)
    if mode is not None:
        (path / rep.SETUP_FILE).write_text(json.dumps({"mode": mode}))
    for r in rows:
        rep.append_row(path, r)
    return path


def _e2e_rows():
    """Batches 1 and 8 at T=0: DFlash tau 5 / 4, DDTree tau 5 + log2(B/16) (- 1 at
    batch 8), throughput 1.2x DFlash's at every budget of batch 1, 0.9x at batch 8;
    batch 8 has no tok_s at budget 256 (no ratio there); a schedule row and a
    T=1 row with no ratio (no DFlash at T=1)."""
    rows = []
    for batch, tau, speed in ((1, 5.0, 1.2), (8, 4.0, 0.9)):
        rows += [
            _row("none", batch, tok_s=50.0 * batch),
            _row(
                "dflash",
                batch,
                tok_s=100.0 * batch,
                acceptance_length=tau,
                decode_ms_per_step=6.0,
            ),
        ]
        for b in BUDGETS:
            extra = {} if (batch, b) == (8, 256) else {"tok_s": speed * 100.0 * batch}
            rows.append(
                _row(
                    f"ddtree-{b}",
                    batch,
                    decode_ms_per_step=7.0,
                    acceptance_length=tau + math.log2(b / 16),
                    **extra,
                )
            )
        rows.append(
            _row(rep.SCHEDULE_CONFIG, batch, tok_s=999.0, acceptance_length=50.0)
        )
    rows.append(_row("ddtree-64", 1, 1.0, tok_s=10.0, acceptance_length=3.0))
    return rows


def _color_near(image, x, y, color, radius=2):
    """Does ``color`` appear within ``radius`` pixels of (x, y)?"""
    px = image.load()
    return any(
        px[round(x) + dx, round(y) + dy] == color
        for dx in range(-radius, radius + 1)
        for dy in range(-radius, radius + 1)
    )


def _marker_at(image, x, y, color):
    """A filled marker of ``color`` at (x, y): every pixel within 2 of it (a line
    alone, 2 pixels wide, does not fill that square)."""
    px = image.load()
    return all(
        px[round(x) + dx, round(y) + dy] == color
        for dx in range(-2, 3)
        for dy in range(-2, 3)
    )


def _figure(figs, name):
    return next(f for f in figs if f.name == name)


def test_e2e_figures(tmp_path):
    d = _results(tmp_path / "bench_ddtree_e2e", _e2e_rows(), "e2e")
    rows, modes = pd.load([d])
    paths = pd.write_figures(rows, tmp_path / "png", "cmd on H200", modes)
    assert [p.name for p in paths] == [
        "acceptance_vs_budget_T0.png",
        "speedup_vs_budget_T0.png",
        "acceptance_vs_budget_T1.png",
    ]  # no DFlash at T=1: no speedup; no step plot
    for p in paths:
        with Image.open(p) as im:
            assert im.format == "PNG" and im.size == pd.SIZE

    figs = pd.figures(rows, modes)
    acc = _figure(figs, "acceptance_vs_budget_T0.png")
    assert [s.label for s in acc.series] == [
        "batch 1",
        "DFlash, batch 1",
        "batch 8",
        "DFlash, batch 8",
    ]
    blue, orange = pd.PALETTE[:2]
    assert [s.color for s in acc.series] == [blue, blue, orange, orange]
    # Only ddtree-<B> rows are points (the schedule row's 50.0 is not one).
    assert acc.series[0].points == ((16, 5.0), (64, 7.0), (256, 9.0))
    assert acc.series[1].hline == 5.0 and acc.series[1].dashed
    axes = pd.layout(acc.series)
    assert axes.xticks == BUDGETS  # only the budgets present
    assert axes.ylim[0] <= 4.0 and axes.ylim[1] >= 10.0

    image = Image.open(tmp_path / "png" / acc.name).convert("RGB")
    for s in (acc.series[0], acc.series[2]):
        for x, y in s.points:
            assert _marker_at(image, *axes.to_pixel(x, y), s.color), (s.label, x)
    # DFlash's dashed line at batch 8's tau 4 runs across the plot in orange...
    _, py = axes.to_pixel(16, 4.0)
    left, _, right, _ = axes.box
    run = [image.getpixel((x, round(py))) for x in range(left + 1, right)]
    assert 0.3 < run.count(orange) / len(run) < 0.9  # dashed, not solid
    # ... and no blue marker is where batch 1 has no point (tau 4 at budget 64).
    assert not _color_near(image, *axes.to_pixel(64, 4.0), blue, 3)


def test_speedup_skips_rows_without_a_ratio(tmp_path):
    d = _results(tmp_path / "r", _e2e_rows())  # no setup.json: modes from rows
    rows, modes = pd.load([d])
    pd.write_figures(rows, tmp_path / "png", "c", modes)
    fig = _figure(pd.figures(rows, modes), "speedup_vs_budget_T0.png")
    one, eight, ref = fig.series
    assert one.points == ((16, 1.2), (64, 1.2), (256, 1.2))
    assert eight.points == ((16, 0.9), (64, 0.9))  # budget 256 had no tok_s
    assert (ref.label, ref.hline, ref.color) == ("DFlash", 1.0, pd.REFERENCE)
    axes = pd.layout(fig.series)
    image = Image.open(tmp_path / "png" / fig.name).convert("RGB")
    assert _marker_at(image, *axes.to_pixel(64, 0.9), eight.color)
    assert _marker_at(image, *axes.to_pixel(256, 1.2), one.color)
    # Nothing of batch 8 in the column of budget 256.
    x, _ = axes.to_pixel(256, 1.0)
    _, top, _, bottom = axes.box
    assert not any(
        _color_near(image, x, y, eight.color, 3) for y in range(top + 4, bottom - 4, 3)
    )


def test_cost_step_figure(tmp_path):
    rows = [
        _row("dflash", 1, decode_ms_per_step=6.0, acceptance_length=1.1, mode="cost"),
        _row("ddtree-128", 1, decode_ms_per_step=6.6, mode="cost"),
        _row("ddtree-512", 1, decode_ms_per_step=7.8, mode="cost"),
        _row("ddtree-512", 4, decode_ms_per_step=9.0, mode="cost"),
    ]  # no DFlash
    d = _results(tmp_path / "cost", rows)
    rows, modes = pd.load([d])
    paths = pd.write_figures(rows, tmp_path / "png", "c", modes)
    assert [p.name for p in paths] == ["step_vs_budget.png"]
    (fig,) = pd.figures(rows, modes)
    (one, ref) = fig.series
    assert one.label == "batch 1" and ref.hline == 1.0
    assert [(x, round(y, 6)) for x, y in one.points] == [(128, 1.1), (512, 1.3)]
    axes = pd.layout(fig.series)
    image = Image.open(paths[0]).convert("RGB")
    assert _marker_at(image, *axes.to_pixel(512, 1.3), one.color)
    # The mode can come from setup.json too; e2e rows with step times get none.
    for mode, expect in (("cost", True), ("e2e", False)):
        bare = [{k: v for k, v in r.items() if k != "mode"} for r in rows]
        d = _results(tmp_path / f"setup_{mode}", bare, mode)
        names = [f.name for f in pd.figures(*pd.load([d]))]
        assert ("step_vs_budget.png" in names) == expect


def test_ratios_stay_within_their_directory(tmp_path):
    """Two GPU commands, each with its own DFlash: every DDTree point is a ratio to
    the DFlash of its own command, though the merge keeps one DFlash row."""
    first = _results(
        tmp_path / "a",
        [
            _row("dflash", 1, run="a", tok_s=100.0, decode_ms_per_step=6.0),
            _row("ddtree-16", 1, run="a", tok_s=120.0, decode_ms_per_step=6.6),
        ],
        "e2e",
    )
    second = _results(
        tmp_path / "b",
        [
            _row("dflash", 1, run="b", tok_s=200.0, decode_ms_per_step=3.0),
            _row("ddtree-64", 1, run="b", tok_s=150.0, decode_ms_per_step=4.5),
        ],
        "e2e",
    )
    rows, modes = pd.load([first, second])
    assert [r["run_id"] for r in rows if r["config"] == "dflash"] == ["b"]
    fig = _figure(pd.figures(rows, modes), "speedup_vs_budget_T0.png")
    (one, _ref) = fig.series
    assert [(x, round(y, 6)) for x, y in one.points] == [(16, 1.2), (64, 0.75)]
    by_config = {r["config"]: r for r in rows}
    assert by_config["ddtree-16"]["step_vs_dflash"] == pytest.approx(1.1)
    assert by_config["ddtree-64"]["step_vs_dflash"] == pytest.approx(1.5)
    # A directory without its own DFlash gets none (no ratio to another's).
    lone = _results(tmp_path / "c", [_row("ddtree-256", 1, run="c", tok_s=90.0)], "e2e")
    rows, modes = pd.load([first, lone])
    fig = _figure(pd.figures(rows, modes), "speedup_vs_budget_T0.png")
    assert [x for x, _ in fig.series[0].points] == [16]


def test_same_input_same_bytes(tmp_path, capsys):
    d = _results(tmp_path / "bench_ddtree_e2e", _e2e_rows(), "e2e")
    outs = [tmp_path / "a", tmp_path / "b"]
    for out in outs:
        assert pd.main([str(d), "--out", str(out)]) == 0
    printed = capsys.readouterr().out.split()
    assert printed[0] == str(outs[0] / "acceptance_vs_budget_T0.png")
    names = sorted(p.name for p in outs[0].iterdir())
    assert len(names) == 3 and names == sorted(p.name for p in outs[1].iterdir())
    for name in names:
        assert (outs[0] / name).read_bytes() == (outs[1] / name).read_bytes()
    # The caption is drawn: another caption, other bytes.
    pd.main([str(d), "--out", str(tmp_path / "c"), "--caption", "other text"])
    name = names[0]
    assert (tmp_path / "c" / name).read_bytes() != (outs[0] / name).read_bytes()


def test_default_caption():
    rows = [_row("dflash", 1, gpu="NVIDIA H200"), _row("none", 1, gpu="NVIDIA H200")]
    assert pd.default_caption([pd.Path("x/bench_ddtree_cost")], rows) == (
        "results: bench_ddtree_cost; GPU: NVIDIA H200"
    )
    assert pd.default_caption([pd.Path("a"), pd.Path("b")], []) == "results: a, b"


def test_ticks_and_transform():
    assert pd.nice_ticks(4.0, 9.2) == [4, 5, 6, 7, 8, 9, 10]
    assert pd.nice_ticks(0.85, 1.32) == [0.8, 0.9, 1.0, 1.1, 1.2, 1.3, 1.4]
    assert pd.nice_ticks(2.0, 2.0)[0] <= 1.5 and pd.nice_ticks(2.0, 2.0)[-1] >= 2.5
    axes = pd.layout([pd.Series("s", (0, 0, 0), ((16, 1.0), (1024, 2.0)))])
    left, top, right, bottom = axes.box
    x16, y1 = axes.to_pixel(16, 1.0)
    x1024, y2 = axes.to_pixel(1024, 2.0)
    assert left < x16 < x1024 < right and top < y2 < y1 < bottom
    x128, _ = axes.to_pixel(128, 1.0)
    assert x128 == pytest.approx(x16 + (x1024 - x16) / 2)  # log2 axis


@pytest.mark.parametrize(
    "rows, match",
    [
        (
            [_row("dflash", 1, tok_s=1.0, acceptance_length=5.0), _row("none", 1)],
            "nothing to plot in .*no ddtree-<B> row",
        ),
        (
            [_row(rep.SCHEDULE_CONFIG, 1, tok_s=1.0, acceptance_length=5.0)],
            "nothing to plot",
        ),
        (
            [_row("ddtree-64", 1, decode_ms_per_step=7.0, mode="cost")],
            "nothing to plot",
        ),  # no DFlash row: no ratio
    ],
)
def test_nothing_to_plot(tmp_path, capsys, rows, match):
    d = _results(tmp_path / "r", rows)
    with pytest.raises(SystemExit) as err:
        pd.main([str(d), "--out", str(tmp_path / "png")])
    assert err.value.code == 2
    assert re.search(match, capsys.readouterr().err)
    assert not (tmp_path / "png").exists()


def test_missing_results_and_mixed_setups(tmp_path, capsys):
    good = _results(tmp_path / "good", _e2e_rows(), "e2e")
    with pytest.raises(SystemExit) as err:
        pd.main([str(good), str(tmp_path / "nope"), "--out", str(tmp_path / "o")])
    assert err.value.code == 2
    assert f"no results.jsonl in {tmp_path / 'nope'}" in capsys.readouterr().err
    cost = _results(tmp_path / "cost", [_row("ddtree-16", 1)], "cost")
    with pytest.raises(SystemExit) as err:
        pd.main([str(good), str(cost), "--out", str(tmp_path / "o")])
    assert err.value.code == 2
    assert "different setup (mode: 'cost' there, 'e2e' now)" in capsys.readouterr().err


def test_overlapping_tick_labels_are_left_out():
    """15 and 16 sit 0.09 log2 steps apart: the second label is dropped, the
    next one far enough away is drawn again."""
    assert pd.drawn_labels([100, 110, 200, 204, 300], [14, 14, 14, 14, 20]) == [
        True,
        False,
        True,
        False,
        True,
    ]
    assert pd.drawn_labels([], []) == []
