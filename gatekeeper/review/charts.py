"""Charts drawn on the server as SVG: no script, nothing fetched, so they work under the app's strict CSP. Each
bar and point carries its own label (which side, what value), so none is read by colour alone. The detection
curve, the prompt-token chart and the KLD quantiles are the export's own (``reports.export``)."""

from __future__ import annotations

from html import escape

from ..reports.export import StageRow, chart_svg, curve_svg, kld_svg
from .pages import DriftPoint, SuiteFlips

__all__ = ["chart_svg", "curve_svg", "drift_svg", "flips_svg", "kld_svg", "telemetry_svg"]

OFF, ON, HARM = "#57606a", "#1a7f37", "#cf222e"
FONT = 'font-size="12" font-family="system-ui,sans-serif"'


def _e(x: object) -> str:
    return escape(str(x), quote=True)


def _n(x: float) -> str:
    return f"{x:.3g}" if isinstance(x, float) else str(x)


def drift_svg(points: list[DriftPoint]) -> str:
    """Top-2 logit drift (flag off vs on) at each generated step, turn after turn, with the largest one labelled."""
    if not points:
        return "<p>No step has top-2 logits on both sides: the drift is unknown.</p>"
    left, top, w, h = 60, 20, 520, 150
    peak = max(p["drift"] for p in points) or 1.0
    step_w = w / max(len(points) - 1, 1)
    xy = [(left + i * step_w, top + h * (1 - p["drift"] / peak)) for i, p in enumerate(points)]
    worst = max(range(len(points)), key=lambda i: points[i]["drift"])
    parts = [f'<svg role="img" width="{left + w + 40}" height="{top + h + 50}" {FONT}>'
             "<title>Top-2 logit drift per generated step, flag off vs on</title>",
             f'<line x1="{left}" y1="{top + h}" x2="{left + w}" y2="{top + h}" stroke="{OFF}"/>',
             f'<line x1="{left}" y1="{top}" x2="{left}" y2="{top + h}" stroke="{OFF}"/>',
             f'<text x="{left - 6}" y="{top + 4}" text-anchor="end">{_n(peak)}</text>',
             f'<text x="{left - 6}" y="{top + h + 4}" text-anchor="end">0</text>',
             f'<text x="{left + w / 2}" y="{top + h + 36}" text-anchor="middle">generated step (turn.step)</text>',
             f'<polyline fill="none" stroke="{ON}" stroke-width="1.5" points="'
             + " ".join(f"{x:.1f},{y:.1f}" for x, y in xy) + '"/>']
    every = max(1, len(points) // 10)
    for i, ((x, y), p) in enumerate(zip(xy, points)):
        parts.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2.5" fill="{ON}"><title>turn {p["turn"]} step {p["step"]}: '
                     f'drift {_n(p["drift"])}</title></circle>')
        if i % every == 0:
            parts.append(f'<text x="{x:.1f}" y="{top + h + 16}" text-anchor="middle">{p["turn"]}.{p["step"]}</text>')
    x, y = xy[worst]
    parts.append(f'<text x="{x + 6:.1f}" y="{max(y, top + 10):.1f}">largest {_n(points[worst]["drift"])}</text>')
    return "".join(parts) + "</svg>"


def _bars(title: str, groups: list[tuple[str, list[tuple[str, float | None]]]], unit: str) -> str:
    """Horizontal bars in groups (one group per stage): each bar labelled with its side and value."""
    label_w, bar_w, bar_h, gap = 150, 380, 14, 12
    values = [v for _, bars in groups for _, v in bars if v is not None]
    peak = max(values + [1e-12])
    height = 24 + sum(len(bars) * bar_h + gap for _, bars in groups)
    parts = [f'<svg role="img" width="{label_w + bar_w + 170}" height="{height}" {FONT}><title>{_e(title)}</title>']
    y = 18
    for name, bars in groups:
        parts.append(f'<text x="0" y="{y + bar_h}">{_e(name)}</text>')
        for side, v in bars:
            colour = OFF if side.startswith("off") else HARM if side == "harmful" else ON
            wd = 0 if v is None else round(bar_w * v / peak)
            shown = "not reported" if v is None else f"{_n(v)}{unit}"
            parts.append(f'<rect x="{label_w}" y="{y}" width="{wd}" height="{bar_h - 2}" fill="{colour}"/>'
                         f'<text x="{label_w + wd + 4}" y="{y + bar_h - 3}">{_e(side)}: {_e(shown)}</text>')
            y += bar_h
        y += gap
    return "".join(parts) + "</svg>"


def telemetry_svg(stages: list[StageRow]) -> tuple[str, str]:
    """Per stage, off vs on: prompt, cached and computed tokens; and prefill and decode seconds."""
    by_stage: dict[str, dict[str, StageRow]] = {}
    for s in stages:
        by_stage.setdefault(s["stage"], {})[s["config"]] = s
    tokens: list[tuple[str, list[tuple[str, float | None]]]] = []
    seconds: list[tuple[str, list[tuple[str, float | None]]]] = []
    for stage, sides in by_stage.items():
        tokens.append((stage, [(f"{c} {k}", x) for c in ("off", "on") if c in sides for k, x in (
            ("prompt", sides[c]["prompt_tokens"]), ("cached", sides[c]["cached_tokens"]),
            ("computed", sides[c]["computed_tokens"]))]))
        seconds.append((stage, [(f"{c} {k}", x) for c in ("off", "on") if c in sides for k, x in (
            ("prefill", sides[c]["prefill_s"]), ("decode", sides[c]["decode_s"]))]))
    return (_bars("Tokens per stage, flag off vs on: prompt, cached, computed", tokens, ""),
            _bars("Model seconds per stage, flag off vs on: prefill, decode", seconds, " s"))


def flips_svg(suites: list[SuiteFlips]) -> str:
    """Assertion flips per suite, off -> on: harmful (a pass became a fail) beside beneficial."""
    return _bars("Assertion flips per suite: harmful and beneficial",
                 [(s["suite"], [("harmful", s["harmful"]), ("beneficial", s["beneficial"])]) for s in suites], "")
