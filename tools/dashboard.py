#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""aiokv's Grafana dashboard (docs/grafana-aiokv.json) outside Grafana: every panel's queries
with the dashboard's variables set, evaluated by a Prometheus, and a picture of the panels drawn
with matplotlib where Grafana's grid puts them (stat panels: the value now; time series: the
last --minutes).

    PYTHONPATH=. .venv/bin/python tools/dashboard.py --prometheus http://127.0.0.1:9090 \
        --out docs/img/dashboard.png [--minutes 10] [--model NAME]

tests/test_dashboard_queries_answer_e2e.py evaluates every query this way against a real
Prometheus scraping a served engine, and draws the picture when AIOKV_DASHBOARD_PNG names a file.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import time
import urllib.parse
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DASHBOARD = os.path.join(ROOT, "docs", "grafana-aiokv.json")


def load(path: str = DASHBOARD) -> dict:
    with open(path) as f:
        return json.load(f)


def expand(expr: str, rate_interval: str = "30s", model: str = ".*") -> str:
    """A panel's query as Grafana sends it: $__rate_interval and $model_name ("All": any) set."""
    expr = expr.replace("$__rate_interval", rate_interval)
    return re.sub(r"\$\{?model_name\}?", model, expr)


def targets(dash: dict) -> list[tuple[dict, dict]]:
    """(panel, target) for every query of every panel, in the dashboard's order."""
    return [(p, t) for p in dash["panels"] for t in p.get("targets", ())]


class Client:
    """Prometheus's HTTP API, the two calls the picture needs."""

    def __init__(self, url: str):
        self.url = url.rstrip("/")

    def _get(self, path: str, **params) -> dict:
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}", timeout=30) as r:
            body = json.load(r)
        if body.get("status") != "success":
            raise RuntimeError(f"prometheus: {path}: {body}")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list:
        data = self._get("query", query=expr, **({"time": at} if at is not None else {}))
        return data["result"] if data["resultType"] in ("vector", "matrix") else [data["result"]]

    def query_range(self, expr: str, start: float, end: float, step: float) -> list:
        return self._get("query_range", query=expr, start=start, end=end, step=step)["result"]


def _legend(fmt: str | None, metric: dict) -> str:
    if not fmt:
        return ""
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: metric.get(m.group(1), ""), fmt)


def _human(v: float, unit: str | None) -> str:
    if v is None or math.isnan(v):
        return "no data"
    if unit == "percentunit":
        return f"{v:.1%}"
    if unit == "bytes":
        for u in ("B", "KiB", "MiB", "GiB", "TiB"):
            if abs(v) < 1024 or u == "TiB":
                return f"{v:.1f} {u}" if u != "B" else f"{v:.0f} B"
            v /= 1024
    return f"{v:.3g}"


def render(prom, dash: dict, out: str, end: float | None = None, minutes: float = 10, model: str = ".*") -> None:
    """Draw every panel into `out` (PNG): stat panels' values at `end`, time series over the minutes before."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    end = end or time.time()
    start, step = end - minutes * 60, max(1.0, minutes * 60 / 240)
    panels = dash["panels"]
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels) + 1  # (a row for the title)
    fig = plt.figure(figsize=(16, rows * 0.42))
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(end))
    fig.suptitle(f"{dash['title']}: every panel's queries on Prometheus, {when}", fontsize=11, y=1 - 0.3 / rows)
    for p in panels:
        g = p["gridPos"]
        top = (g["y"] + 1) / rows  # below the title row
        ax = fig.add_axes(
            [g["x"] / 24 + 0.035, 1 - top - g["h"] / rows + 0.02, g["w"] / 24 - 0.045, g["h"] / rows - 0.05]
        )
        ax.set_title(p["title"], fontsize=8, loc="left")
        unit = (p.get("fieldConfig") or {}).get("defaults", {}).get("unit")
        if p["type"] == "stat":
            got = prom.query(expand(p["targets"][0]["expr"], model=model), at=end)
            v = float(got[0]["value"][1]) if got else float("nan")
            ax.text(0.5, 0.4, _human(v, unit), ha="center", va="center", fontsize=16)
            ax.set_xticks([])
            ax.set_yticks([])
            continue
        for t in p.get("targets", ()):
            for s in prom.query_range(expand(t["expr"], model=model), start, end, step):
                xs = [float(x) - end for x, _ in s["values"]]
                ys = [float(y) for _, y in s["values"]]
                ax.plot(xs, ys, lw=1, marker=".", ms=2, label=_legend(t.get("legendFormat"), s["metric"]) or None)
        ax.tick_params(labelsize=6)
        ax.set_xlabel("seconds before the picture", fontsize=6)
        if unit and unit != "short":
            ax.set_ylabel(unit, fontsize=6)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6, loc="upper left")
    fig.savefig(out, dpi=90)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prometheus", required=True, help="Prometheus's URL")
    ap.add_argument("--out", required=True, help="the PNG to write")
    ap.add_argument("--minutes", type=float, default=10)
    ap.add_argument("--model", default=".*", help="the model_name variable (a regex; default: all)")
    ap.add_argument("--dashboard", default=DASHBOARD)
    a = ap.parse_args()
    render(Client(a.prometheus), load(a.dashboard), a.out, minutes=a.minutes, model=a.model)


if __name__ == "__main__":
    main()
