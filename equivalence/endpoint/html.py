"""The endpoint report as one self-contained HTML page (inline SVG, no script, no network), in the style of the
equivalence report (equivalence/report/html.py, whose chart it draws with): |delta logprob| / bound per position,
one line per request (the bound at 1); the worst ratio per request, alone and under concurrency; the worst
positions with their text; the generated tokens' near-ties and divergences."""

from __future__ import annotations

import html

from equivalence.report.html import line_chart

WORST = 15


def _e(v) -> str:
    return f"{v:.3g}" if isinstance(v, float) else html.escape(str(v))


def render_html(data: dict) -> str:
    meta, reqs, conc = data["meta"], data["requests"], data["concurrent"]
    charts = []
    series = {
        f"request {r['index']}": [(p["position"], p["ratio"]) for p in r["positions"]] for r in reqs if r["positions"]
    }
    if series:
        longest = max(p["position"] for r in reqs for p in r["positions"])
        charts.append(
            line_chart("|d logprob| / bound per position (alone)", series, "position", list(range(longest + 1)))
        )
    per_req = {}
    for label, group in (("alone", reqs), ("concurrent", conc)):
        pts = [(i, max([p["ratio"] for p in r["positions"]] + [0.0])) for i, r in enumerate(group)]
        if any(r["positions"] for r in group):
            per_req[label] = pts
    if per_req:
        n = max(len(v) for v in per_req.values())
        charts.append(line_chart("worst |d logprob| / bound per request", per_req, "request", list(range(n))))
    worst = sorted(
        (
            (label, r["index"], p)
            for label, group in (("alone", reqs), ("concurrent", conc))
            for r in group
            for p in r["positions"]
        ),
        key=lambda t: -t[2]["ratio"],
    )[:WORST]
    rows = "".join(
        f'<tr class="{"fail" if p["ratio"] > 1 else ""}"><td>{label}</td><td>{i}</td><td>{p["position"]}</td>'
        f"<td>{p['region']}</td><td><code>{_e(p['context'])}</code><b><code>{_e(p['token_text'])}</code></b></td>"
        f"<td>{_e(p['endpoint_logprob'])}</td><td>{_e(p['reference_logprob'])}</td><td>{_e(p['abs_delta'])}</td>"
        f"<td>{_e(p['bound'])}</td><td>{_e(p['ratio'])}</td><td>{_e(p['topk_overlap'])}</td>"
        f"<td>{_e(p['kl_lower_bound'])}</td></tr>"
        for label, i, p in worst
    )
    j = data["judgement"]
    ties = "".join(
        f"<tr class='{cls}'><td>{cls}</td><td>{t['position'] + 1}</td><td>{t['token']}</td>"
        f"<td>{t['reference_token']}</td><td>{_e(t['margin'])}</td><td>{_e(t['top2_margin'])}</td>"
        f"<td>{_e(t['bound'])}</td></tr>"
        for cls, group in (("near-tie", j["near_ties"]), ("fail", j["divergences"]))
        for t in group
    )
    verdict = (
        f'<p class="{"ok" if data["ok"] else "bad"}">{"Agrees" if data["ok"] else "Diverged"}: '
        f"{_e(data.get('first_failure') or 'every position within its bound, no generated token diverges')}</p>"
    )
    info = "".join(
        f"<li>{html.escape(k)}: {_e(v)}</li>"
        for k, v in {**meta, **{"generated tokens": j["verdict"], "batch invariance": data["batch_invariance"]}}.items()
    )
    style = (
        "body{font-family:sans-serif;margin:1em}table{border-collapse:collapse;font-size:12px}"
        "td,th{border:1px solid #ccc;padding:2px 5px}tr.fail{background:#fdd}tr.near-tie{background:#ffd}"
        ".ok{color:#060}.bad{color:#a00}.chart{border:1px solid #ddd;margin:4px}.grid{stroke:#eee}"
        ".tol{stroke:#a00;stroke-dasharray:4 3}.t{font-size:12px}.a{font-size:9px}circle.fail{stroke:#000}"
    )
    return (
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>Endpoint equivalence report</title>"
        f"<style>{style}</style></head><body><h1>Endpoint equivalence report</h1>{verdict}<ul>{info}</ul>"
        f"<h2>|d logprob| against the per-position bound</h2><div>{''.join(charts) or 'no logprobs returned'}"
        f"</div><h2>Worst positions</h2><table><tr><th>run</th><th>request</th><th>position</th><th>region</th>"
        f"<th>text (context, <b>token</b>)</th><th>endpoint logprob</th><th>reference logprob</th><th>|d|</th>"
        f"<th>bound</th><th>ratio</th><th>top-k overlap</th><th>KL lower bound</th></tr>{rows}</table>"
        f"<h2>Generated tokens that differ (reference teacher-forced)</h2><table><tr><th>kind</th><th>token</th>"
        f"<th>endpoint</th><th>reference</th><th>margin</th><th>top-2 margin</th><th>bound</th></tr>{ties}"
        f"</table></body></html>"
    )
