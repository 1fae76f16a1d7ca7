"""The equivalence report as one self-contained HTML page: inline SVG plots and CSS, no script, no network.

- per checkpoint kind: the tolerance ratio (error / tolerance, log scale; <= 1 passes) per layer, one line per step,
  the tolerance drawn at 1;
- per decode step: the worst ratio over the layers of each kind;
- the table of every checkpoint with its metrics, the first divergence marked.
"""

from __future__ import annotations

import html
import math

WIDTH, HEIGHT, PAD = 360, 200, 40
COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")
FLOOR = 1e-6  # ratios below this are drawn at the floor (an exact match has ratio 0)


def _y(ratio: float, lo: float, hi: float) -> float:
    r = min(max(ratio, lo), hi) if math.isfinite(ratio) else hi
    return PAD / 2 + (HEIGHT - PAD) * (1 - (math.log10(r) - math.log10(lo)) / (math.log10(hi) - math.log10(lo)))


def line_chart(title: str, series: dict[str, list[tuple[float, float]]], xlabel: str, xticks: list) -> str:
    """series: name -> [(x index, ratio)]; log-scale y from FLOOR to at least 10, the tolerance line at 1."""
    values = [r for pts in series.values() for _, r in pts if math.isfinite(r)]
    hi = max([10.0] + [10 ** math.ceil(math.log10(max(v, FLOOR))) for v in values])
    lo = FLOOR
    n = max(len(xticks) - 1, 1)
    x = lambda i: PAD + (WIDTH - 1.5 * PAD) * i / n  # noqa: E731
    parts = [
        f'<svg class="chart" width="{WIDTH}" height="{HEIGHT + 30}" viewBox="0 0 {WIDTH} {HEIGHT + 30}" '
        f'xmlns="http://www.w3.org/2000/svg"><title>{html.escape(title)}</title>',
        f'<text x="{WIDTH / 2}" y="12" text-anchor="middle" class="t">{html.escape(title)}</text>',
    ]
    for e in range(int(math.log10(lo)), int(math.log10(hi)) + 1):
        yy = _y(10.0**e, lo, hi)
        parts.append(
            f'<line x1="{PAD}" x2="{WIDTH - PAD / 2}" y1="{yy:.1f}" y2="{yy:.1f}" class="grid"/>'
            f'<text x="{PAD - 4}" y="{yy + 3:.1f}" text-anchor="end" class="a">1e{e}</text>'
        )
    yy = _y(1.0, lo, hi)
    parts.append(
        f'<line x1="{PAD}" x2="{WIDTH - PAD / 2}" y1="{yy:.1f}" y2="{yy:.1f}" class="tol"/>'
        f'<text x="{WIDTH - PAD / 2}" y="{yy - 3:.1f}" text-anchor="end" class="a">tolerance</text>'
    )
    for i, tick in enumerate(xticks):
        parts.append(
            f'<text x="{x(i):.1f}" y="{HEIGHT - PAD / 2 + 14}" text-anchor="middle" class="a">'
            f"{html.escape(str(tick))}</text>"
        )
    parts.append(f'<text x="{WIDTH / 2}" y="{HEIGHT + 22}" text-anchor="middle" class="a">{html.escape(xlabel)}</text>')
    for k, (name, pts) in enumerate(series.items()):
        color = COLORS[k % len(COLORS)]
        coords = " ".join(f"{x(i):.1f},{_y(r, lo, hi):.1f}" for i, r in pts)
        parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{coords}"/>')
        for i, r in pts:
            mark = "fail" if not r <= 1 else ""
            parts.append(
                f'<circle cx="{x(i):.1f}" cy="{_y(r, lo, hi):.1f}" r="2.5" fill="{color}" class="{mark}">'
                f"<title>{html.escape(name)} {xticks[i]}: ratio {r:.3g}</title></circle>"
            )
        parts.append(f'<text x="{PAD + 4}" y="{28 + 11 * k}" fill="{color}" class="a">{html.escape(name)}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _fmt(v) -> str:
    return f"{v:.3e}" if isinstance(v, float) else html.escape(str(v))


def render_html(data: dict) -> str:
    meta, rows, first = data["meta"], data["checkpoints"], data["first_divergence"]
    layers = list(range(meta["num_layers"]))
    steps = list(dict.fromkeys(r["step"] for r in rows))
    charts = []
    for kind in meta["kinds"] + ["logits"]:
        series = {}
        for step in steps:
            pts = [
                (r["layer"] if kind != "logits" else 0, r["ratio"])
                for r in rows
                if r["kind"] == kind and r["step"] == step
            ]
            if pts:
                series[step] = pts
        if series:
            ticks = layers if kind != "logits" else ["final"]
            charts.append(line_chart(f"{kind}: error / tolerance per layer", series, "layer", ticks))
    decode = [s for s in steps if s != "prefill"]
    if decode:
        series = {}
        for kind in meta["kinds"] + ["logits"]:
            pts = [
                (i, max(r["ratio"] for r in rows if r["kind"] == kind and r["step"] == s))
                for i, s in enumerate(decode)
                if any(r["kind"] == kind and r["step"] == s for r in rows)
            ]
            if pts:
                series[kind] = pts
        charts.append(
            line_chart(
                "per decode step: worst error / tolerance over layers", series, "decode step", list(range(len(decode)))
            )
        )
    head = (
        "<tr><th>step</th><th>layer</th><th>checkpoint</th><th>ratio</th><th>cosine</th><th>max_abs</th>"
        "<th>max_rel</th><th>rel_l2</th><th>&le;1e-3 rel</th><th>&le;5e-3 rel</th><th>tolerance</th>"
        "<th>note</th></tr>"
    )
    body = []
    for r in rows:
        m = r["metrics"]
        is_first = first is not None and (r["step"], r["layer"], r["kind"]) == (
            first["step"],
            first["layer"],
            first["kind"],
        )
        cls = "first" if is_first else ("fail" if not r["ok"] else "")
        body.append(
            f'<tr class="{cls}"><td>{_fmt(r["step"])}</td><td>{_fmt(r["layer"])}</td><td>{_fmt(r["kind"])}'
            f"</td><td>{r['ratio']:.3g}</td>"
            + "".join(
                f"<td>{_fmt(m.get(k, ''))}</td>"
                for k in ("cosine", "max_abs", "max_rel", "rel_l2", "within_0.001", "within_0.005")
            )
            + f"<td>{_fmt(r['tolerance'])}</td><td>{_fmt(r['note'])}</td></tr>"
        )
    if first is None:
        verdict = f'<p class="ok">No divergence: all {len(rows)} checkpoints within their tolerance.</p>'
    else:
        verdict = (
            f'<p class="bad">First divergence: <b>{_fmt(first["step"])} layer {_fmt(first["layer"])} '
            f"{_fmt(first['kind'])}</b> ({_fmt(first['tolerance'])} exceeded {first['ratio']:.3g}x, rel_l2 "
            f"{first['metrics'].get('rel_l2', float('nan')):.3e}).</p>"
        )
    routing = data.get("routing") or {}
    info = "".join(
        f"<li>{html.escape(k)}: {html.escape(str(v))}</li>"
        for k, v in {**meta, "routing": routing}.items()
        if k not in ("kinds",)
    )
    style = (
        "body{font-family:sans-serif;margin:1em}table{border-collapse:collapse;font-size:12px}"
        "td,th{border:1px solid #ccc;padding:2px 5px}tr.fail{background:#fdd}tr.first{background:#f88}"
        ".ok{color:#060}.bad{color:#a00}.chart{border:1px solid #ddd;margin:4px}.grid{stroke:#eee}"
        ".tol{stroke:#a00;stroke-dasharray:4 3}.t{font-size:12px}.a{font-size:9px}circle.fail{stroke:#000}"
    )
    return (
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>Equivalence report</title><style>{style}"
        f"</style></head><body><h1>Equivalence report</h1>{verdict}<ul>{info}</ul><h2>Error per layer against "
        f"its tolerance</h2><div>{''.join(charts)}</div><h2>Every checkpoint (execution order)</h2><table>{head}"
        f"{''.join(body)}</table></body></html>"
    )
