"""The Grafana dashboard (deploy/observability/tandem-dashboard.json) drawn with matplotlib: every panel's queries
run as range queries against a live Prometheus, one subplot per panel, for docs/operations.md.

`tests/e2e/test_observability.py` calls `plot` on its Prometheus (scraping a mesh under load) when
`TANDEM_DASHBOARD_PNG=PATH` is set:

    TANDEM_DASHBOARD_PNG=docs/observability-dashboard.png \
        .venv/bin/python -m pytest -q tests/e2e/test_observability.py
"""

from __future__ import annotations

import json
import math
import re
import urllib.parse
import urllib.request
from pathlib import Path

DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "observability" / "tandem-dashboard.json"


def _range(address: str, expr: str, start: float, end: float, step: float) -> list[dict]:
    params = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": step})
    reply = json.loads(
        urllib.request.urlopen(f"http://{address}/api/v1/query_range?{params}", timeout=30).read()
    )
    return reply["data"]["result"] if reply["status"] == "success" else []


def _legend(template: str, labels: dict[str, str]) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), template).strip() or "value"


def plot(address: str, start: float, end: float, path: str | Path, step: float = 1.0) -> Path:
    """Draws every panel of the dashboard from Prometheus at `address` over [start, end] (unix seconds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [p for p in json.loads(DASHBOARD.read_text())["panels"] if p["type"] != "row"]
    cols = 4
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(cols * 5, rows * 3.2), squeeze=False)
    for ax, panel in zip(axes.flat, panels, strict=False):
        for target in panel["targets"]:
            for series in _range(address, target["expr"], start, end, step)[:8]:
                xs = [float(t) - start for t, _ in series["values"]]
                ys = [float(v) for _, v in series["values"]]
                ax.plot(xs, ys, label=_legend(target["legendFormat"], series["metric"]), linewidth=1)
        ax.set_title(panel["title"], fontsize=9)
        ax.tick_params(labelsize=7)
        ax.set_xlabel("s", fontsize=7)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6, loc="upper left")
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.suptitle(
        "Tandem dashboard (deploy/observability/tandem-dashboard.json), sim mesh under load", fontsize=11
    )
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=80)
    plt.close(fig)
    return out
