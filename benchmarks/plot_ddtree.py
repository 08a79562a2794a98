# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""PNG plots of ``benchmarks/bench_ddtree.py`` results, drawn with Pillow
(no matplotlib).

    python benchmarks/plot_ddtree.py DIR [DIR ...] --out OUTDIR [--caption TEXT]

From the merged rows of the result directories (``bench_ddtree_report``; each
row's ratios are to the DFlash of its own directory, one GPU command), with the
tree budget on a log2 x axis and one line per batch size:

* ``acceptance_vs_budget_T{t}.png``: acceptance length of ``ddtree-<B>``, DFlash's
  at the same batch as a dashed line of the same color;
* ``speedup_vs_budget_T{t}.png``: throughput / DFlash's (``tok_s_vs_dflash``),
  reference line at 1.0;
* ``step_vs_budget.png`` (cost-mode rows only; ``_T{t}`` added when the rows hold
  several temperatures): decode step time / DFlash's (``step_vs_dflash``).

Only ``ddtree-<B>`` rows are points; a row without the plotted number is skipped.
Every figure carries a footer with ``--caption`` (the command and machine that
produced the numbers; default: the directories' names and the rows' GPUs). The
output is deterministic: the same rows give the same bytes.
"""

import argparse
import itertools
import json
import math
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.bench_ddtree_report import (
    RESULTS_FILE,
    SETUP_FILE,
    budget_of,
    check_setup,
    config_order,
    load_rows,
    merge_rows,
    row_key,
    with_ratios,
)

# Present once a row's ratios are computed (bench_ddtree_report.with_ratios).
RATIO_KEY = "tok_s_vs_dflash"
SIZE = (900, 600)
# Plot area (left, top, right, bottom); the legend sits right of it, the footer
# below the x label.
PLOT_BOX = (80, 50, 690, 500)
BACKGROUND = (255, 255, 255)
INK = (0, 0, 0)
GRID = (225, 225, 225)
REFERENCE = (110, 110, 110)
# Matplotlib's tab10 colors: one per batch size, the same in every figure.
PALETTE = [
    (31, 119, 180),
    (255, 127, 14),
    (44, 160, 44),
    (214, 39, 40),
    (148, 103, 189),
    (140, 86, 75),
    (227, 119, 194),
    (188, 189, 34),
    (23, 190, 207),
]
MARKER_RADIUS = 4
LINE_WIDTH = 2
DASH = (8, 5)  # pixels on, off


# ---------------------------------------------------------------------------
# A small plotting helper: series, axes (the data -> pixel transform), figure
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Series:
    """A legend entry: a line through ``points`` (x, y) with markers, or, with
    ``hline`` set, a horizontal line across the whole plot at y = ``hline``."""

    label: str
    color: tuple[int, int, int]
    points: tuple[tuple[float, float], ...] = ()
    hline: float | None = None
    dashed: bool = False


@dataclass(frozen=True)
class Axes:
    """Log2 x, linear y; ``xlim`` in log2 units, ``box`` in pixels."""

    box: tuple[int, int, int, int]
    xlim: tuple[float, float]
    ylim: tuple[float, float]
    xticks: tuple[float, ...]
    yticks: tuple[float, ...]

    def to_pixel(self, x: float, y: float) -> tuple[float, float]:
        left, top, right, bottom = self.box
        fx = (math.log2(x) - self.xlim[0]) / (self.xlim[1] - self.xlim[0])
        fy = (y - self.ylim[0]) / (self.ylim[1] - self.ylim[0])
        return left + fx * (right - left), bottom - fy * (bottom - top)


def nice_ticks(lo: float, hi: float, target: int = 6) -> list[float]:
    """Round ticks (1, 2, 2.5 or 5 x 10^k apart) covering [lo, hi]."""
    if hi <= lo:
        lo, hi = lo - 0.5, hi + 0.5
    raw = (hi - lo) / target
    base = 10 ** math.floor(math.log10(raw))
    step = next(m * base for m in (1, 2, 2.5, 5, 10) if m * base >= raw)
    first = math.floor(lo / step + 1e-9)
    last = math.ceil(hi / step - 1e-9)
    return [round(i * step, 10) for i in range(first, last + 1)]


def layout(series: Sequence[Series], box=PLOT_BOX) -> Axes:
    """The axes that hold every series: x ticks at the x values present (half a
    log2 step of margin), y ticks round numbers around every y (and hline)."""
    xs = sorted({x for s in series for x, _ in s.points})
    ys = [y for s in series for _, y in s.points]
    ys += [s.hline for s in series if s.hline is not None]
    if not xs or not ys:
        raise ValueError("nothing to plot")
    xlim = (math.log2(xs[0]) - 0.5, math.log2(xs[-1]) + 0.5)
    pad = 0.05 * (max(ys) - min(ys))
    yticks = nice_ticks(min(ys) - pad, max(ys) + pad)
    return Axes(box, xlim, (yticks[0], yticks[-1]), tuple(xs), tuple(yticks))


def _font(size: int):
    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # no FreeType: the fixed bitmap font
        return ImageFont.load_default()


def _line(draw, points, color, dashed: bool, width: int = LINE_WIDTH) -> None:
    if not dashed:
        draw.line(points, fill=color, width=width)
        return
    on, off = DASH
    for (x0, y0), (x1, y1) in itertools.pairwise(points):
        length = math.hypot(x1 - x0, y1 - y0)
        pos = 0.0
        while pos < length:
            end = min(pos + on, length)
            draw.line(
                [
                    (x0 + (x1 - x0) * pos / length, y0 + (y1 - y0) * pos / length),
                    (x0 + (x1 - x0) * end / length, y0 + (y1 - y0) * end / length),
                ],
                fill=color,
                width=width,
            )
            pos = end + off


def _marker(draw, x: float, y: float, color) -> None:
    r = MARKER_RADIUS
    draw.ellipse([x - r, y - r, x + r, y + r], fill=color)


def drawn_labels(
    centers: Sequence[float], widths: Sequence[float], gap: float = 6
) -> list[bool]:
    """Which of the centred labels (ascending centres) to draw: each unless it
    would come within ``gap`` pixels of the last one drawn."""
    shown, last_right = [], float("-inf")
    for center, width in zip(centers, widths):
        ok = center - width / 2 >= last_right + gap
        shown.append(ok)
        if ok:
            last_right = center + width / 2
    return shown


def _fmt_tick(v: float) -> str:
    return f"{v:g}"


def _wrap(draw, text: str, font, width: int) -> list[str]:
    lines: list[str] = []
    for word in text.split():
        if lines and draw.textlength(lines[-1] + " " + word, font=font) <= width:
            lines[-1] += " " + word
        else:
            lines.append(word)
    return lines


def plot(
    path: Path,
    title: str,
    xlabel: str,
    ylabel: str,
    series: Sequence[Series],
    caption: str = "",
) -> Axes:
    """Draw ``series`` into a PNG at ``path``; returns the axes used (for the
    data -> pixel transform)."""
    axes = layout(series)
    image = Image.new("RGB", SIZE, BACKGROUND)
    draw = ImageDraw.Draw(image)
    small, normal, big = _font(11), _font(13), _font(16)
    left, top, right, bottom = axes.box

    # Grid, ticks and tick labels (a label that would overlap the one before it,
    # e.g. 16 next to 15 on the log axis, is left out; its tick stays).
    xpixels = [axes.to_pixel(x, axes.ylim[0])[0] for x in axes.xticks]
    labels = [_fmt_tick(x) for x in axes.xticks]
    widths = [draw.textlength(t, font=normal) for t in labels]
    for px, text, shown in zip(xpixels, labels, drawn_labels(xpixels, widths)):
        draw.line([(px, top), (px, bottom)], fill=GRID)
        draw.line([(px, bottom), (px, bottom + 5)], fill=INK)
        if shown:
            draw.text((px, bottom + 8), text, fill=INK, font=normal, anchor="mt")
    for y in axes.yticks:
        _, py = axes.to_pixel(2 ** axes.xlim[0], y)
        draw.line([(left, py), (right, py)], fill=GRID)
        draw.line([(left - 5, py), (left, py)], fill=INK)
        draw.text((left - 8, py), _fmt_tick(y), fill=INK, font=normal, anchor="rm")
    draw.rectangle(axes.box, outline=INK)

    # Data: reference lines first, then lines with markers on top.
    for s in sorted(series, key=lambda s: s.hline is None):
        if s.hline is not None:
            _, py = axes.to_pixel(1, s.hline)
            _line(draw, [(left + 1, py), (right - 1, py)], s.color, s.dashed)
            continue
        pixels = [axes.to_pixel(x, y) for x, y in s.points]
        if len(pixels) > 1:
            _line(draw, pixels, s.color, s.dashed)
        for px, py in pixels:
            _marker(draw, px, py, s.color)

    # Labels.
    draw.text((SIZE[0] // 2, 20), title, fill=INK, font=big, anchor="mm")
    draw.text(
        ((left + right) // 2, bottom + 30), xlabel, fill=INK, font=normal, anchor="mt"
    )
    label = Image.new("RGB", (bottom - top, 20), BACKGROUND)
    ImageDraw.Draw(label).text(
        ((bottom - top) // 2, 10), ylabel, fill=INK, font=normal, anchor="mm"
    )
    image.paste(label.rotate(90, expand=True), (8, top))

    # Legend, right of the plot.
    lx, ly = right + 15, top
    for s in series:
        _line(draw, [(lx, ly + 8), (lx + 28, ly + 8)], s.color, s.dashed)
        if s.hline is None:
            _marker(draw, lx + 14, ly + 8, s.color)
        draw.text((lx + 36, ly + 8), s.label, fill=INK, font=normal, anchor="lm")
        ly += 20

    # Footer: where the numbers come from.
    fy = bottom + 52
    for line in _wrap(draw, caption, small, SIZE[0] - 20):
        draw.text((10, fy), line, fill=INK, font=small)
        fy += 14
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path, format="PNG")
    return axes


# ---------------------------------------------------------------------------
# DDTree figures
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Figure:
    name: str
    title: str
    ylabel: str
    series: tuple[Series, ...]


XLABEL = "tree budget (nodes per request)"


def batch_colors(rows: Iterable[Mapping]) -> dict[int, tuple[int, int, int]]:
    """One color per batch size of the rows, the same in every figure."""
    batches = sorted({row_key(r)[1] for r in rows})
    return {b: PALETTE[i % len(PALETTE)] for i, b in enumerate(batches)}


def budget_series(
    rows: Sequence[Mapping], temperature: float, field: str, colors: Mapping[int, tuple]
) -> dict[int, Series]:
    """Per batch, ``field`` of the ``ddtree-<B>`` rows at ``temperature`` against
    B; rows without the field are skipped, batches with no point left out."""
    points: dict[int, list[tuple[float, float]]] = {}
    for r in sorted(rows, key=lambda r: config_order(r["config"])):
        config, batch, t = row_key(r)
        budget = budget_of(config)
        if budget is None or t != temperature or r.get(field) is None:
            continue
        points.setdefault(batch, []).append((budget, float(r[field])))
    return {
        b: Series(f"batch {b}", colors[b], tuple(p)) for b, p in sorted(points.items())
    }


def _temp(t: float) -> str:
    return f"{t:g}"


def figures(rows: Sequence[Mapping], modes: Mapping | None = None) -> list[Figure]:
    """The figures the rows hold, in file-name order. ``rows`` are merged rows
    (``merge_rows``); a row without ratios gets them here, from the DFlash row
    of its batch and temperature among ``rows`` (``load`` gives each directory's
    rows their own DFlash's first). ``modes`` maps a row's key to its mode when
    the row does not carry one (from the directory's setup)."""
    rows = [
        r if RATIO_KEY in r else with_r for r, with_r in zip(rows, with_ratios(rows))
    ]
    colors = batch_colors(rows)
    by_key = {row_key(r): r for r in rows}
    temps = sorted({row_key(r)[2] for r in rows})
    out = []
    for t in temps:
        acc = budget_series(rows, t, "acceptance_length", colors)
        series = []
        for b, s in acc.items():
            series.append(s)
            tau = by_key.get(("dflash", b, t), {}).get("acceptance_length")
            if tau is not None:
                series.append(
                    Series(
                        f"DFlash, batch {b}", colors[b], hline=float(tau), dashed=True
                    )
                )
        if acc:
            out.append(
                Figure(
                    f"acceptance_vs_budget_T{_temp(t)}.png",
                    f"DDTree acceptance length vs tree budget, T={_temp(t)}",
                    "acceptance length (tokens per step)",
                    tuple(series),
                )
            )
        speed = budget_series(rows, t, "tok_s_vs_dflash", colors)
        if speed:
            out.append(
                Figure(
                    f"speedup_vs_budget_T{_temp(t)}.png",
                    f"DDTree throughput / DFlash's vs tree budget, T={_temp(t)}",
                    "tok/s / DFlash tok/s",
                    (
                        *speed.values(),
                        Series("DFlash", REFERENCE, hline=1.0, dashed=True),
                    ),
                )
            )
    modes = modes or {}
    cost = [r for r in rows if (r.get("mode") or modes.get(row_key(r))) == "cost"]
    cost_temps = sorted({row_key(r)[2] for r in cost})
    for t in cost_temps:
        step = budget_series(cost, t, "step_vs_dflash", colors)
        if not step:
            continue
        suffix = f"_T{_temp(t)}" if len(cost_temps) > 1 else ""
        out.append(
            Figure(
                f"step_vs_budget{suffix}.png",
                f"DDTree decode step time / DFlash's vs tree budget (cost), T={_temp(t)}",
                "decode ms/step / DFlash ms/step",
                (*step.values(), Series("DFlash", REFERENCE, hline=1.0, dashed=True)),
            )
        )
    return out


def default_caption(dirs: Sequence[Path], rows: Sequence[Mapping]) -> str:
    text = "results: " + ", ".join(Path(d).name for d in dirs)
    gpus = sorted({str(r["gpu"]) for r in rows if r.get("gpu")})
    return text + (f"; GPU: {', '.join(gpus)}" if gpus else "")


def load(dirs: Sequence[Path]) -> tuple[list[dict], dict]:
    """Merged rows of ``dirs``, each with its ratios to the DFlash and no-spec rows
    of its own directory, and each row's mode from its directory's setup.
    Raises ``ValueError`` for a directory without results or setups that differ."""
    missing = [str(d) for d in dirs if not (Path(d) / RESULTS_FILE).is_file()]
    if missing:
        raise ValueError(f"no {RESULTS_FILE} in {', '.join(missing)}")
    setups = [
        (d, json.loads((Path(d) / SETUP_FILE).read_text()))
        for d in dirs
        if (Path(d) / SETUP_FILE).is_file()
    ]
    for d, other in setups[1:]:
        check_setup(setups[0][1], other, str(d))
    modes, rows = {}, []
    for d in dirs:
        setup = dict(setups).get(d, {})
        # Ratios within the directory (one GPU command), before the merge lets
        # a later directory's DFlash row stand in for an earlier one's.
        own = with_ratios(merge_rows(load_rows([d])))
        for r in own:
            modes[row_key(r)] = r.get("mode") or setup.get("mode")
        rows += own
    return merge_rows(rows), modes


def write_figures(
    rows: Sequence[Mapping], out: Path, caption: str, modes: Mapping | None = None
) -> list[Path]:
    paths = []
    for fig in figures(rows, modes):
        path = Path(out) / fig.name
        plot(path, fig.title, XLABEL, fig.ylabel, fig.series, caption)
        paths.append(path)
    return paths


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "dirs",
        nargs="+",
        type=Path,
        help="bench_ddtree result directories (results.jsonl)",
    )
    parser.add_argument("--out", type=Path, required=True, help="PNG directory")
    parser.add_argument(
        "--caption",
        default=None,
        help="footer of every figure: the command and machine that "
        "produced the results (default: the directories' names)",
    )
    args = parser.parse_args(argv)
    try:
        rows, modes = load(args.dirs)
    except ValueError as e:
        parser.error(str(e))
    caption = (
        args.caption if args.caption is not None else default_caption(args.dirs, rows)
    )
    paths = write_figures(rows, args.out, caption, modes)
    if not paths:
        parser.error(
            "nothing to plot in " + ", ".join(map(str, args.dirs)) + ": no ddtree-<B> "
            "row with acceptance_length, or with tok_s (or, in cost mode, "
            "decode_ms_per_step) next to a dflash row of the same batch and "
            "temperature"
        )
    for p in paths:
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
