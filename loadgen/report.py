"""What a bench run leaves behind: results.json, PNG plots beside it, a compact table on the terminal.

Plots are drawn with matplotlib's object API on the Agg canvas (no pyplot state, no display needed).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure


def write_json(path: Path, results: dict[str, Any]) -> None:
    """Write `results` as indented JSON (atomically: a partial file never replaces a good one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(results, indent=2, default=_jsonable) + "\n")
    tmp.replace(path)


def _jsonable(x: Any) -> Any:
    if hasattr(x, "item"):  # numpy scalars
        return x.item()
    raise TypeError(f"not JSON serializable: {type(x).__name__}")


def _ms(x: float | None) -> float:
    return math.nan if x is None else x * 1e3


def _mark(ax: Any, results: dict[str, Any]) -> None:
    knee = results.get("knee") or {}
    if knee.get("found"):
        ax.axvline(
            knee["load"], color="tab:red", linestyle="--", linewidth=1, label=f"knee ({knee['load']:g})"
        )
    rec = results.get("recommended_load")
    if rec:
        ax.axvline(rec, color="tab:green", linestyle=":", linewidth=1.5, label=f"recommended ({rec:g})")
    loads = [s["load"] for s in results["steps"]]
    if len(loads) > 2 and min(loads) > 0 and max(loads) / min(loads) >= 8:
        ax.set_xscale("log", base=2)
        ax.set_xticks(loads, [f"{x:g}" for x in loads])
    ax.set_xlabel(results.get("load_kind", "load"))
    ax.grid(True, alpha=0.3)


def plot_throughput(results: dict[str, Any], path: Path) -> Path:
    """Request throughput and goodput against load, output tokens/s on a second axis."""
    steps = results["steps"]
    loads = [s["load"] for s in steps]
    fig = Figure(figsize=(7, 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot(loads, [s["request_throughput_rps"] for s in steps], "o-", label="throughput (req/s)")
    ax.plot(loads, [s["goodput_rps"] for s in steps], "s-", label="goodput (req/s, within SLO)")
    ax.set_ylabel("requests / s")
    ax2 = ax.twinx()
    ax2.plot(loads, [s["output_token_throughput_tps"] for s in steps], "^--", color="tab:gray", alpha=0.7)
    ax2.set_ylabel("output tokens / s (dashed)")
    _mark(ax, results)
    ax.legend(loc="upper left", fontsize=8)
    ax.set_title(f"Throughput against load: {results.get('workload', '')}")
    fig.savefig(path, dpi=110)
    return path


def plot_latency(results: dict[str, Any], path: Path) -> Path:
    """P50 and P99 TTFT and TPOT against load, SLOs as horizontal lines, knee and recommendation marked."""
    steps = results["steps"]
    loads = [s["load"] for s in steps]
    fig = Figure(figsize=(10, 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    slo = results.get("slo") or {}
    for i, (name, slo_s) in enumerate((("ttft", slo.get("ttft_s")), ("tpot", slo.get("tpot_s")))):
        ax = fig.add_subplot(1, 2, i + 1)
        ax.plot(loads, [_ms(s[f"{name}_s"]["p99"]) for s in steps], "o-", label=f"P99 {name.upper()}")
        ax.plot(
            loads, [_ms(s[f"{name}_s"]["p50"]) for s in steps], ".--", alpha=0.6, label=f"P50 {name.upper()}"
        )
        if slo_s:
            ax.axhline(slo_s * 1e3, color="tab:orange", linewidth=1, label=f"SLO {slo_s * 1e3:g} ms")
        _mark(ax, results)
        ax.set_ylabel(f"{name.upper()} (ms)")
        ax.legend(loc="upper left", fontsize=8)
    fig.suptitle("Latency against load")
    fig.savefig(path, dpi=110)
    return path


def write_plots(results: dict[str, Any], json_path: Path) -> list[Path]:
    """Both plots beside `json_path`, named after its stem; returns their paths."""
    if not results["steps"]:
        return []
    stem = json_path.with_suffix("")
    return [
        plot_throughput(results, Path(f"{stem}_throughput.png")),
        plot_latency(results, Path(f"{stem}_latency.png")),
    ]


def _f(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def table(results: dict[str, Any]) -> str:
    """A compact terminal table of the steps and the verdict."""
    head = (
        f"{results.get('load_kind', 'load'):>11} {'done':>5} {'err':>4} {'req/s':>7} {'tok/s':>8} "
        f"{'goodput':>7} {'SLO%':>5} {'TTFT p50/p99 ms':>16} {'TPOT p50/p99 ms':>16} {'fluid':>5}"
    )
    lines = [head, "-" * len(head)]
    for s in results["steps"]:
        att = s.get("slo_attainment")
        ttft = f"{_f(_ms(s['ttft_s']['p50']), '.0f')}/{_f(_ms(s['ttft_s']['p99']), '.0f')}"
        tpot = f"{_f(_ms(s['tpot_s']['p50']), '.1f')}/{_f(_ms(s['tpot_s']['p99']), '.1f')}"
        lines.append(
            f"{s['load']:>11g} {s['completed']:>5} {s['num_requests'] - s['completed']:>4} "
            f"{s['request_throughput_rps']:>7.2f} {s['output_token_throughput_tps']:>8.1f} "
            f"{s['goodput_rps']:>7.2f} {_f(None if att is None else att * 100, '.0f'):>5} "
            f"{ttft:>16} {tpot:>16} {_f(s.get('fluidity_index'), '.2f'):>5}"
        )
    knee = results.get("knee") or {}
    lines.append("")
    lines.append(
        f"knee: {knee.get('load'):g} ({knee.get('reason')})"
        if knee.get("found")
        else f"knee: {knee.get('reason')}"
    )
    rec = results.get("recommended_load")
    lines.append(
        f"recommended {results.get('load_kind', 'load')}: " + ("none" if rec is None else f"{rec:g}")
    )
    cost = results.get("cost_per_1k_requests")
    if cost is not None:
        lines.append(f"cost per 1k requests at the recommended load: {cost:.4f}")
    if results.get("interrupted"):
        lines.append("interrupted: partial results")
    return "\n".join(lines)
