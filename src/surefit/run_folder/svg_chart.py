"""Line charts as SVG text: the run's ``curves.svg``, written in milliseconds and without a plotting library.

Why not matplotlib: importing it and drawing was most of a run's time after its last step (docs/performance.md), for
a picture whose whole content is a few hundred numbers. SVG is text: a browser, an editor's
preview and GitHub show it, it scales without blurring, and ``report.html`` embeds it as it is.

Everything drawn is data from the run folder; every piece of text is XML-escaped, and non-finite values are left out
(a NaN loss is reported by the run, not drawn as a line to infinity).
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass, field

PANEL_W, PANEL_H = 520, 400  # one panel's box in pixels (the figure's width grows with the panels)
_LEFT, _RIGHT, _TOP, _BOTTOM = 92, 18, 66, 62  # margins of a panel's plot area: tick labels, title, axis label
FONT = "DejaVu Sans, Arial, Helvetica, sans-serif"


@dataclass
class Series:
    """One curve: points (non-finite ones skipped), a colour, a legend label and how it is drawn.

    ``style``: ``"line"``, ``"points"`` or ``"line+points"``; ``marker``: ``"circle"``, ``"square"`` or ``"dot"``."""

    xs: list[float]
    ys: list[float]
    color: str
    label: str = ""
    style: str = "line"
    marker: str = "circle"


@dataclass
class Panel:
    """One plot: its series, vertical guide lines (epoch ends), a message where there is nothing to draw, a fixed
    y range (scores on their whole scale) and whether the x axis counts whole things (steps, epochs)."""

    title: str
    xlabel: str
    ylabel: str
    series: list[Series] = field(default_factory=list)
    vlines: list[float] = field(default_factory=list)
    empty_note: str = ""
    ylim: tuple[float, float] | None = None
    integer_x: bool = True


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


def _finite(xs: list[float], ys: list[float]) -> list[tuple[float, float]]:
    return [(float(x), float(y)) for x, y in zip(xs, ys, strict=True) if math.isfinite(x) and math.isfinite(y)]


def nice_ticks(lo: float, hi: float, integer: bool = False, target: int = 5) -> list[float]:
    """About ``target`` round tick values covering ``[lo, hi]`` (steps of 1, 2, 2.5 or 5 times a power of ten;
    whole numbers only where ``integer``)."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return []
    if hi <= lo:
        hi = lo + (1.0 if integer or lo == 0 else abs(lo) * 0.1)
    raw = (hi - lo) / max(1, target)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= raw * 0.999)
    if integer:
        step = max(1.0, round(step))
    first = math.ceil(lo / step - 1e-9) * step
    ticks: list[float] = []
    v = first
    while v <= hi + step * 1e-9 and len(ticks) < 50:
        ticks.append(0.0 if abs(v) < step * 1e-9 else v)
        v = first + len(ticks) * step
    return ticks


def tick_labels(ticks: list[float]) -> list[str]:
    """Tick values with no more digits than their spacing needs; in powers of ten for an axis of tiny or huge values
    (learning rates), so one axis never mixes ``0.00015`` and ``5e-5``."""
    if not ticks:
        return []
    top = max(abs(t) for t in ticks)
    if 0 < top < 1e-3 or top >= 1e6:
        out = []
        for v in ticks:
            mant, exp = f"{v:.3e}".split("e")
            mant = mant.rstrip("0").rstrip(".")
            out.append("0" if v == 0 else f"{mant}e{int(exp)}")
        return out
    step = ticks[1] - ticks[0] if len(ticks) > 1 else 1.0
    decimals = max(0, -math.floor(math.log10(step) + 1e-9))
    if abs(step * 10**decimals - round(step * 10**decimals)) > 1e-6:
        decimals += 1  # 2.5, 0.25: one digit more than the power of ten says
    return [f"{v:.{decimals}f}" for v in ticks]


MAX_LINE_POINTS = 2000  # a longer line is thinned to this order (the plot is a few hundred pixels wide)


def thin(pts: list[tuple[float, float]], buckets: int = MAX_LINE_POINTS // 4) -> list[tuple[float, float]]:
    """A long line as the first, lowest, highest and last point of each of ``buckets`` runs of consecutive points,
    in their order: what a plot a few hundred pixels wide can show of it (spikes kept), at a bounded file size."""
    if len(pts) <= MAX_LINE_POINTS:
        return pts
    size = -(-len(pts) // buckets)
    out: list[tuple[float, float]] = []
    for i in range(0, len(pts), size):
        run = pts[i : i + size]
        keep = {0, len(run) - 1, min(range(len(run)), key=lambda k: run[k][1]),
                max(range(len(run)), key=lambda k: run[k][1])}
        out += [run[k] for k in sorted(keep)]
    return out


def _range(values: list[float], integer: bool) -> tuple[float, float]:
    lo, hi = min(values), max(values)
    if hi == lo:
        pad = 1.0 if integer or lo == 0 else abs(lo) * 0.05
        return lo - pad, hi + pad
    pad = (hi - lo) * 0.05
    return lo - pad, hi + pad


def _panel_svg(p: Panel, x0: float, clip_id: str) -> list[str]:
    """The SVG elements of one panel whose box starts at ``x0``."""
    left, top = x0 + _LEFT, _TOP
    w, h = PANEL_W - _LEFT - _RIGHT, PANEL_H - _TOP - _BOTTOM
    out = [f'<g class="panel" data-title="{_e(p.title)}">',
           f'<text x="{left + w / 2:.1f}" y="{top - 12}" text-anchor="middle" font-size="16">{_e(p.title)}</text>']
    points = [thin(_finite(s.xs, s.ys)) for s in p.series]
    xs = [x for pts in points for x, _ in pts] + [v for v in p.vlines if math.isfinite(v)]
    ys = [y for pts in points for _, y in pts]
    if not xs or not ys:
        out.append(f'<rect x="{left}" y="{top}" width="{w}" height="{h}" fill="none" stroke="#888"/>')
        out.append(f'<text x="{left + w / 2:.1f}" y="{top + h / 2:.1f}" text-anchor="middle" font-size="13" '
                   f'fill="#555">{_e(p.empty_note or "nothing to draw yet")}</text>')
        out += _axis_labels(p, left, top, w, h)
        out.append("</g>")
        return out
    xlo, xhi = _range(xs, p.integer_x)
    ylo, yhi = p.ylim if p.ylim is not None else _range(ys, False)

    def sx(v: float) -> float:
        return left + (v - xlo) / (xhi - xlo) * w

    def sy(v: float) -> float:
        return top + h - (v - ylo) / (yhi - ylo) * h

    xt = nice_ticks(xlo, xhi, p.integer_x)
    yt = nice_ticks(ylo, yhi)
    out.append('<g class="grid" stroke="#e6e6e6" stroke-width="1">')
    out += [f'<line x1="{sx(t):.1f}" y1="{top}" x2="{sx(t):.1f}" y2="{top + h}"/>' for t in xt if xlo <= t <= xhi]
    out += [f'<line x1="{left}" y1="{sy(t):.1f}" x2="{left + w}" y2="{sy(t):.1f}"/>' for t in yt if ylo <= t <= yhi]
    out.append("</g>")
    out += [f'<line class="vline" x1="{sx(v):.1f}" y1="{top}" x2="{sx(v):.1f}" y2="{top + h}" stroke="#cccccc" '
            f'stroke-width="0.8"/>' for v in p.vlines if math.isfinite(v)]
    out.append(f'<g clip-path="url(#{clip_id})">')
    for s, pts in zip(p.series, points, strict=True):
        if not pts:
            continue
        coords = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in pts)
        if "line" in s.style:
            out.append(f'<polyline class="series" data-label="{_e(s.label)}" points="{coords}" fill="none" '
                       f'stroke="{s.color}" stroke-width="2.2" stroke-linejoin="round"/>')
        if "points" in s.style or len(pts) == 1:  # a line of one point would draw nothing
            out.append(f'<g class="markers" data-label="{_e(s.label)}" fill="{s.color}">')
            for x, y in pts:
                if s.marker == "square":
                    out.append(f'<rect x="{sx(x) - 4:.1f}" y="{sy(y) - 4:.1f}" width="8" height="8"/>')
                else:
                    out.append(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="{2.2 if s.marker == "dot" else 4}"/>')
            out.append("</g>")
    out.append("</g>")
    out.append(f'<rect x="{left}" y="{top}" width="{w}" height="{h}" fill="none" stroke="#333"/>')
    out += [f'<text x="{sx(t):.1f}" y="{top + h + 18}" text-anchor="middle" font-size="13">{_e(label)}</text>'
            for t, label in zip(xt, tick_labels(xt), strict=True) if xlo <= t <= xhi]
    out += [f'<text x="{left - 6}" y="{sy(t) + 4:.1f}" text-anchor="end" font-size="13">{_e(label)}</text>'
            for t, label in zip(yt, tick_labels(yt), strict=True) if ylo <= t <= yhi]
    out += _axis_labels(p, left, top, w, h)
    shown = [s for s, pts in zip(p.series, points, strict=True) if s.label and pts]
    drawn = [(sx(x), sy(y)) for pts in points for x, y in pts]
    out += _legend(shown, (left, top, w, h), drawn)
    out.append("</g>")
    return out


def _axis_labels(p: Panel, left: float, top: float, w: float, h: float) -> list[str]:
    return [f'<text x="{left + w / 2:.1f}" y="{top + h + 44}" text-anchor="middle" font-size="14">{_e(p.xlabel)}</text>',
            f'<text transform="translate({left - 66:.1f},{top + h / 2:.1f}) rotate(-90)" text-anchor="middle" '
            f'font-size="14">{_e(p.ylabel)}</text>']


def _legend(series: list[Series], box: tuple[float, float, float, float],
            drawn: list[tuple[float, float]]) -> list[str]:
    """The legend in the corner of the plot area ``box`` (left, top, width, height) that covers the fewest drawn
    points (top right on a tie), as matplotlib's ``loc="best"`` does."""
    if not series:
        return []
    left, top, w, h = box
    width, height = 36 + 7.4 * max(len(s.label) for s in series), 8 + 18 * len(series)
    corners = [(left + w - 8 - width, top + 8), (left + 8, top + 8), (left + w - 8 - width, top + h - 8 - height),
               (left + 8, top + h - 8 - height)]

    def covered(corner: tuple[float, float]) -> int:
        x, y = corner
        return sum(x - 4 <= px <= x + width + 4 and y - 4 <= py <= y + height + 4 for px, py in drawn)

    x0, y0 = min(corners, key=covered)
    out = [f'<g class="legend"><rect x="{x0:.1f}" y="{y0:.1f}" width="{width:.1f}" height="{height}" '
           'fill="#ffffff" fill-opacity="0.85" stroke="#cccccc"/>']
    for i, s in enumerate(series):
        y = y0 + 16 + 18 * i
        x = x0 + 6
        if "line" in s.style:
            out.append(f'<line x1="{x:.1f}" y1="{y - 4:.1f}" x2="{x + 20:.1f}" y2="{y - 4:.1f}" stroke="{s.color}" '
                       'stroke-width="2.2"/>')
        if "points" in s.style and s.marker == "square":
            out.append(f'<rect x="{x + 7:.1f}" y="{y - 7:.1f}" width="6" height="6" fill="{s.color}"/>')
        elif "points" in s.style:
            out.append(f'<circle cx="{x + 10:.1f}" cy="{y - 4:.1f}" r="3" fill="{s.color}"/>')
        out.append(f'<text x="{x + 26:.1f}" y="{y:.1f}" font-size="12">{_e(s.label)}</text>')
    out.append("</g>")
    return out


def render(panels: list[Panel], title: str) -> str:
    """The panels side by side under one title, as a standalone SVG document."""
    width = PANEL_W * max(1, len(panels))
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{PANEL_H}" '
             f'viewBox="0 0 {width} {PANEL_H}" font-family="{FONT}">',
             "<defs>" + "".join(
                 f'<clipPath id="plot{i}"><rect x="{i * PANEL_W + _LEFT}" y="{_TOP}" width="{PANEL_W - _LEFT - _RIGHT}" '
                 f'height="{PANEL_H - _TOP - _BOTTOM}"/></clipPath>' for i in range(len(panels))) + "</defs>",
             f'<rect width="{width}" height="{PANEL_H}" fill="#ffffff"/>',
             f'<text x="{width / 2:.1f}" y="24" text-anchor="middle" font-size="17">{_e(title)}</text>']
    for i, p in enumerate(panels):
        parts += _panel_svg(p, i * PANEL_W, f"plot{i}")
    parts.append("</svg>\n")
    return "\n".join(parts)
