"""Latency against request rate from `asyncinfer bench serve --json` reports, one line per policy.

``python -m benchmarks.plot OUT.png REPORT.json...`` draws the same from files.
Needs matplotlib: ``pip install 'asyncinfer[bench]'``.
"""

from __future__ import annotations

import json
import logging
import math
import sys
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from asyncinfer.errors import AsyncInferError

logger = logging.getLogger(__name__)

PANELS = (("ttft_ms", "TTFT (ms)"), ("tpot_ms", "TPOT (ms)"))


def plot_rate_sweep(results: list[dict[str, Any]], path: str | Path) -> Path:
    """Draw TTFT and TPOT p50 (solid) and p99 (dashed) against ``params.rate``, one colour per
    ``params.policy``, into the PNG ``path``; reports without a finite rate are left out."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise AsyncInferError("plotting needs matplotlib: pip install 'asyncinfer[bench]'"
                              ) from exc

    by_policy: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for report in results:
        params = report["params"]
        if params.get("rate") is None or math.isinf(params["rate"]):
            logger.warning("left out of the plot: a run without a finite --rate (%s)",
                           params.get("load"))
            continue
        by_policy[params.get("policy") or "unnamed"].append(report)

    # A bare Figure on an Agg canvas: no pyplot, so no global figure state or GUI backend.
    figure = Figure(figsize=(11, 4.5), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(1, len(PANELS))
    for ax, (key, label) in zip(axes, PANELS):
        for colour, (policy, reports) in enumerate(sorted(by_policy.items())):
            reports.sort(key=lambda r: r["params"]["rate"])
            rates = [r["params"]["rate"] for r in reports]
            for quantile, style in (("p50", "-o"), ("p99", "--x")):
                values = [_or_nan(r[key][quantile]) for r in reports]
                ax.plot(rates, values, style, color=f"C{colour}", label=f"{policy} {quantile}")
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(label)
        ax.set_title(f"{label.split()[0]} p50 (solid) and p99 (dashed)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, format="png", dpi=120)
    return out


def _or_nan(value: float | None) -> float:
    # A run where every request failed has no latency: a gap in its line, not a zero.
    return math.nan if value is None else float(value)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m benchmarks.plot OUT.png REPORT.json...``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    reports = [json.loads(Path(name).read_text()) for name in args[1:]]
    print(plot_rate_sweep(reports, args[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
