"""Latency against request rate from `asyncinfer bench serve --json` reports, one line per policy;
and the figures of the scheduling scenarios (``benchmarks.scenarios``).

``python -m benchmarks.plot OUT.png REPORT.json...`` draws the rate sweep from files.
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


def _figure(panels: int, width: float = 5.5, height: float = 4.5) -> tuple[Any, list[Any]]:
    """A figure of ``panels`` axes side by side, and the axes."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise AsyncInferError("plotting needs matplotlib: pip install 'asyncinfer[bench]'"
                              ) from exc
    # A bare Figure on an Agg canvas: no pyplot, so no global figure state or GUI backend.
    figure = Figure(figsize=(width * panels, height), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(1, panels, squeeze=False)[0]
    return figure, list(axes)


def _save(figure: Any, path: str | Path) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, format="png", dpi=120)
    return out


def _bars(ax: Any, labels: list[str], series: dict[str, list[float | None]],
          ylabel: str, title: str) -> None:
    """Grouped bars: one group per label, one bar per series."""
    width = 0.8 / max(len(series), 1)
    for k, (name, values) in enumerate(series.items()):
        xs = [i + (k - (len(series) - 1) / 2) * width for i in range(len(labels))]
        ax.bar(xs, [_or_nan(v) for v in values], width, label=name, color=f"C{k}")
    ax.set_xticks(range(len(labels)), labels, rotation=20, ha="right")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize="small")


def plot_head_of_line(rows: list[dict[str, Any]], path: str | Path) -> Path:
    """Per policy: short requests' TTFT p50 and p99, and long requests' TTFT (their wait)
    p50 and p99, as grouped bars, into the PNG ``path``."""
    figure, (short, long) = _figure(2)
    labels = [row["policy"] for row in rows]
    for ax, key, title in ((short, "short_ttft_ms", "short requests' TTFT"),
                           (long, "long_ttft_ms", "long requests' TTFT (their wait)")):
        _bars(ax, labels, {q: [row[key][q] for row in rows] for q in ("p50", "p99")},
              "ms", title)
    return _save(figure, path)


def plot_noisy_neighbour(rows: list[dict[str, Any]], path: str | Path) -> Path:
    """One panel per policy: each tenant's cumulative weighted service against time, the
    largest gap while both were backlogged marked; a last panel: the steady tenant's TTFT
    p50 and p99 per policy. Into the PNG ``path``."""
    figure, axes = _figure(len(rows) + 1, width=4.5)
    for ax, row in zip(axes, rows):
        service = row["service"]
        for k, (tenant, curve) in enumerate(service["cumulative"].items()):
            ax.plot(service["times_s"], curve, color=f"C{k}", label=f"tenant {tenant}")
        gap = service.get("max_gap") or {}
        if gap.get("from_s") is not None:
            ax.axvspan(gap["from_s"], gap["to_s"], color="grey", alpha=0.2,
                       label=f"largest gap {gap['gap']:.0f}")
        ax.set_xlabel("time (s)")
        ax.set_ylabel("cumulative weighted service (tokens)")
        ax.set_title(row["policy"])
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    victim = rows[0]["victim"] if rows else ""
    _bars(axes[-1], [row["policy"] for row in rows],
          {q: [row["victim_ttft_ms"][q] for row in rows] for q in ("p50", "p99")},
          "ms", f"tenant {victim}'s TTFT")
    return _save(figure, path)


def plot_rate_sweep(results: list[dict[str, Any]], path: str | Path) -> Path:
    """Draw TTFT and TPOT p50 (solid) and p99 (dashed) against ``params.rate``, one colour per
    ``params.policy``, into the PNG ``path``; reports without a finite rate are left out."""
    by_policy: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for report in results:
        params = report["params"]
        if params.get("rate") is None or math.isinf(params["rate"]):
            logger.warning("left out of the plot: a run without a finite --rate (%s)",
                           params.get("load"))
            continue
        by_policy[params.get("policy") or "unnamed"].append(report)

    figure, axes = _figure(len(PANELS))
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
    return _save(figure, path)


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
