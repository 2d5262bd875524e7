"""Charts drawn on the server as inline SVG (no chart library, nothing from a CDN): stacked bars
(the usage pages) and lines over time (the dashboard); one colour per series, hover values in
SVG <title>s, axes with units, a legend with each series' current value, and an empty state.

The axis labels and the empty note are HTML laid over the SVG at the same relative place, not
SVG text: an SVG's text shrinks with the chart (5-9 px on a 390 px phone), HTML text keeps its
CSS size (usage.css `.chart-box .tick`) however wide the chart is drawn."""
from __future__ import annotations

import time
from functools import lru_cache

from django.utils.html import escape
from django.utils.safestring import SafeString, mark_safe

PALETTE = ("#2459d6", "#1f8a4c", "#b7791f", "#6b46c1", "#c53030", "#2b6cb0", "#718096", "#d69e2e")
MAX_SERIES = len(PALETTE) - 1  # the rest is summed as "other"
IDLE_COLOUR = "#cbd5e0"


def _short(value: float) -> str:
    if -1e3 < value < 1e3:  # most values (percentages, GiB): one comparison first
        return f"{value:.0f}" if value >= 10 or value == int(value) else f"{value:.2f}"
    size = abs(value)
    limit, suffix = (1e9, "G") if size >= 1e9 else (1e6, "M") if size >= 1e6 else (1e3, "k")
    return f"{value / limit:.1f}{suffix}"


_SHIFT = {"start": "0", "middle": "-50%", "end": "-100%"}


def _tick(x: float, y: float, text: str, *, width: int, height: int, anchor: str, cls: str = "tick") -> str:
    """An axis label centred on (x, y) of the SVG's viewBox, aligned on x as SVG's text-anchor."""
    return (f'<span class="{cls}" style="left:{x / width * 100:.2f}%;top:{y / height * 100:.2f}%;'
            f'transform:translate({_SHIFT[anchor]},-50%)">{escape(text)}</span>')


def _boxed(chart_id: str, svg: list[str], ticks: list[str], legend: str) -> SafeString:
    return mark_safe(f'<div class="chart-box" id="{escape(chart_id)}">{"".join(svg)}{"".join(ticks)}</div>'  # noqa: S308
                     f'<div class="legend">{legend}</div>')  # (every value escaped)


def top_series(series: dict[str, list[float]], keep: int = MAX_SERIES) -> dict[str, list[float]]:
    """The `keep` largest series by total, the rest summed as "other" (idle stays apart)."""
    named = {k: v for k, v in series.items() if k != "(idle)"}
    order = sorted(named, key=lambda k: -sum(named[k]))
    out = {k: named[k] for k in order[:keep]}
    rest = order[keep:]
    if rest:
        out["other"] = [sum(named[k][i] for k in rest) for i in range(len(named[rest[0]]))]
    if "(idle)" in series:
        out["(idle)"] = series["(idle)"]
    return out


def stacked_bars(*, labels: list[str], series: dict[str, list[float]], unit: str = "", chart_id: str = "",
                 label: str = "", width: int = 760, height: int = 190) -> SafeString:
    """An SVG of one bar per label, stacked by series. Empty data draws an empty frame with a note."""
    series = top_series(series)
    left, right, top, bottom = 48, 8, 10, 22
    plot_w, plot_h = width - left - right, height - top - bottom
    n = max(1, len(labels))
    totals = [sum(values[i] for values in series.values()) for i in range(len(labels))]
    peak = max(totals, default=0) or 1.0
    slot = plot_w / n
    bar = max(1.0, slot * 0.8)
    parts = [f'<svg class="chart" viewBox="0 0 {width} {height}" role="img" '
             f'aria-label="{escape(label or "bar chart")}{f", {unit}" if unit else ""}" '
             f'preserveAspectRatio="none" xmlns="http://www.w3.org/2000/svg">']
    ticks: list[str] = []
    parts.append(f'<line x1="{left}" y1="{top + plot_h}" x2="{width - right}" y2="{top + plot_h}" stroke="#dfe3e8"/>')
    for frac in (0.5, 1.0):
        y = top + plot_h * (1 - frac)
        parts.append(f'<line x1="{left}" y1="{y:.1f}" x2="{width - right}" y2="{y:.1f}" stroke="#eef1f4"/>')
        ticks.append(_tick(left - 4, y, _short(peak * frac), width=width, height=height, anchor="end"))
    colours = {name: (IDLE_COLOUR if name == "(idle)" else PALETTE[i % len(PALETTE)])
               for i, name in enumerate(series)}
    for i, label in enumerate(labels):
        x = left + i * slot + (slot - bar) / 2
        y = top + plot_h
        for name, values in series.items():
            value = values[i]
            if value <= 0:
                continue
            h = plot_h * value / peak
            y -= h
            parts.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{bar:.1f}" height="{max(h, 0.5):.1f}" '
                         f'fill="{colours[name]}"><title>{escape(label)} · {escape(name)}: '
                         f'{escape(_short(value))} {escape(unit)}</title></rect>')
    if labels:
        for i in sorted({0, len(labels) // 2, len(labels) - 1}):
            x = left + i * slot + slot / 2
            anchor = "start" if i == 0 else "end" if i == len(labels) - 1 else "middle"
            ticks.append(_tick(x, height - 10, labels[i], width=width, height=height, anchor=anchor))
    if not any(totals):
        ticks.append(_tick(left + plot_w / 2, top + plot_h / 2, "no data in this range", width=width, height=height,
                           anchor="middle", cls="tick note"))
    parts.append("</svg>")
    legend = "".join(f'<span class="legend-item"><i style="background:{colours[name]}"></i>{escape(name)}</span>'
                     for name in series)
    return _boxed(chart_id, parts, ticks, legend)


def _nice_top(peak: float) -> float:
    """The axis top: 1, 2 or 5 times a power of ten at or above `peak`."""
    if peak <= 0:
        return 1.0
    scale = 10 ** len(str(int(peak))) / 10 if peak >= 1 else 1.0
    while scale > peak:
        scale /= 10
    for mult in (1, 2, 5, 10):
        if scale * mult >= peak:
            return scale * mult
    return scale * 10


def _value(value: float | None, unit: str) -> str:
    if value is None:
        return "–"
    return f"{_short(value)} {unit}".rstrip()


@lru_cache(maxsize=16)
def _stamps(times: tuple[int, ...]) -> tuple[str, ...]:
    """Hover time labels; every chart of a page shares one time axis, so they are made once."""
    return tuple(time.strftime("%Y-%m-%d %H:%M", time.gmtime(at)) for at in times)


@lru_cache(maxsize=16)
def _columns(n: int, left: int, slot: float) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(each slot's centre x, each slot's left x) as the SVG prints them: the same for every chart
    of a page (40 charts of 60-100 slots on the dashboard)."""
    return (tuple(f"{left + i * slot + slot / 2:.1f}" for i in range(n)),
            tuple(f"{left + i * slot:.1f}" for i in range(n)))


def line_chart(*, times: list[int], series: dict[str, list[float | None]], unit: str, chart_id: str,
               label: str, step_s: int, y_max: float | None = None, empty: str = "no data in this range",
               width: int = 420, height: int = 160) -> SafeString:
    """An SVG of one line per series over `times` (epoch seconds, one slot each; None = no sample).

    The y axis is labelled in `unit` (fixed to `y_max` for percentages), the x axis in local
    clock time; each slot has a hover column whose <title> lists every series' value there, and
    the legend shows the newest value of each series.
    """
    left, right, top, bottom = 62, 8, 10, 22
    plot_w, plot_h = width - left - right, height - top - bottom
    n = max(1, len(times))
    values = [v for vs in series.values() for v in vs if v is not None]
    top_value = y_max if y_max is not None else _nice_top(max(values, default=0.0))
    slot = plot_w / n
    parts = [f'<svg class="chart line-chart" viewBox="0 0 {width} {height}" role="img" '
             f'aria-label="{escape(label)}" xmlns="http://www.w3.org/2000/svg">']
    ticks: list[str] = []
    for frac in (0.0, 0.5, 1.0):  # the unit on the top tick only: short labels fit the margin
        y = top + plot_h * (1 - frac)
        tick = _value(top_value, unit) if frac == 1.0 else _short(top_value * frac)
        parts.append(f'<line x1="{left}" y1="{y:.1f}" x2="{width - right}" y2="{y:.1f}" stroke="#e6e9ee"/>')
        ticks.append(_tick(left - 4, y, tick, width=width, height=height, anchor="end"))
    clock = "%H:%M" if step_s < 3600 else "%a %H:%M"
    if times:
        for i in sorted({0, n // 2, n - 1}):
            anchor = "start" if i == 0 else "end" if i == n - 1 else "middle"
            x = left + i * slot + (slot / 2 if 0 < i < n - 1 else 0 if i == 0 else slot)
            ticks.append(_tick(x, height - 10, time.strftime(clock, time.gmtime(times[i])), width=width,
                               height=height, anchor=anchor))
    colours = {name: PALETTE[i % len(PALETTE)] for i, name in enumerate(series)}
    scale = plot_h / top_value if top_value else 0.0
    centres, lefts = _columns(n, left, slot)
    for name, vs in series.items():
        runs: list[list[str]] = [[]]
        for i, v in enumerate(vs):
            if v is None:
                if runs[-1]:
                    runs.append([])
                continue
            runs[-1].append(f"{centres[i]},{top + plot_h - min(v, top_value) * scale:.1f}")
        for run in runs:
            if len(run) == 1:
                x, y = run[0].split(",")
                parts.append(f'<circle cx="{x}" cy="{y}" r="1.8" fill="{colours[name]}"/>')
            elif run:
                parts.append(f'<polyline fill="none" stroke="{colours[name]}" stroke-width="1.5" '
                             f'points="{" ".join(run)}"/>')
    if values:
        names = [(escape(n), vs) for n, vs in series.items()]
        suffix = f" {escape(unit)}" if unit else ""
        stamps = _stamps(tuple(times))
        box = f'" y="{top}" width="{slot:.2f}" height="{plot_h}" fill="transparent"><title>'
        for i, stamp in enumerate(stamps):
            shown = [f"{n}: {_short(vs[i])}{suffix}" for n, vs in names if vs[i] is not None]
            if shown:
                parts.append(f'<rect class="hover" x="{lefts[i]}{box}{stamp} UTC · {" · ".join(shown)}</title></rect>')
    else:
        ticks.append(_tick(left + plot_w / 2, top + plot_h / 2, empty, width=width, height=height, anchor="middle",
                           cls="tick note"))
    parts.append("</svg>")
    legend = []
    for name, vs in series.items():
        current = next((v for v in reversed(vs) if v is not None), None)
        legend.append(f'<span class="legend-item"><i style="background:{colours[name]}"></i>{escape(name)} '
                      f'<b class="current">{escape(_value(current, unit))}</b></span>')
    return _boxed(chart_id, parts, ticks, "".join(legend))
