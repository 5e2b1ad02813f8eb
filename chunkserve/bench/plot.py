"""`chunkserve bench plot`: figures that show what chunked prefill does to token streams.

Reads the result JSON files of `chunkserve bench serve` and the step traces (JSONL) of
`chunkserve serve --trace-steps` and writes PNGs: what each engine step ran and how long it
took, one decode stream's tokens while long prompts arrive, and the CDF of the time between
tokens. A figure whose inputs are absent is skipped with a log line.

With `--figure KIND` it draws one of docs/BENCHMARKS.md's headline figures instead, from a
compact result file (docs/data/*.json, or the `figure_data.json` of a sweep; figure_data.py),
into the PNG that `-o` names: summary_figures.py.

With `--html OUT.html` it writes the dashboard's page (the server's /dashboard) with a result and
its step trace in it: the run's steps, as they would have looked live, in one file.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
from pathlib import Path
from typing import Any, Iterator

from chunkserve.bench import figure_data
from chunkserve.bench.dashboard_page import page_html, page_steps
from chunkserve.bench.metrics import gaps
from chunkserve.bench.summary_figures import FIGURES, draw, ratio_table

logger = logging.getLogger(__name__)

FIGSIZE = (8.0, 4.5)
DPI = 100
RESULT_KEYS = ("label", "workload", "bench_start", "requests")
REQUEST_KEYS = ("kind", "ok", "token_times")
INTERFERENCE_KEYS = ("long_send_times",)
STEP_KEYS = ("start_time", "duration_s", "forward_mode", "num_prefill_tokens", "num_decode_tokens",
             "num_preemptions")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `chunkserve bench plot`."""
    parser.add_argument("results", nargs="+", metavar="RESULT.json",
                        help="result files of `chunkserve bench serve`; with --figure, one compact result file")
    parser.add_argument("--figure", choices=sorted(FIGURES), metavar="KIND",
                        help=f"draw this headline figure ({', '.join(FIGURES)}) from a compact result file "
                             "(docs/data/*.json, a sweep's figure_data.json) into the PNG -o names")
    parser.add_argument("--trace", nargs="+", action="extend", default=[], metavar="TRACE.jsonl",
                        help="step traces of `chunkserve serve --trace-steps`; each is labelled by its file stem")
    parser.add_argument("-o", "--out-dir", metavar="DIR|PNG",
                        help="folder for the PNGs (created if missing); with --figure, the PNG file")
    parser.add_argument("--html", metavar="OUT.html",
                        help="also (or only, without -o) write the dashboard's page with the first result and "
                             "its step trace (the first --trace) in it: one file that opens in any browser")
    parser.add_argument("--clip-to-results", action="store_true",
                        help="keep only the trace steps that ran during one of the given results' runs "
                             "(a sweep's trace also holds its other workloads)")


def main(args: argparse.Namespace) -> None:
    """Load the files named on the command line and write the figures; bad input exits 2."""
    try:
        if args.figure:
            make_summary_figure(args.figure, args.results, args.out_dir)
            return
        if not args.out_dir and not args.html:
            raise ValueError("give -o DIR (the PNGs) and/or --html OUT.html (the dashboard page)")
        results = [_load_result(path) for path in args.results]
        traces = _load_traces(args.trace)
        if args.clip_to_results:
            traces = {label: clip_to_runs(steps, results) for label, steps in traces.items()}
        if args.out_dir:
            make_figures(results, traces, args.out_dir)
        if args.html:
            write_dashboard(results[0], next(iter(traces.values()), []), args.html)
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)


def make_figures(results: list[dict], traces: dict[str, list[dict]], out_dir: str) -> list[str]:
    """Write every figure the inputs allow into `out_dir` and return the paths of the PNGs."""
    for index, result in enumerate(results):
        _validate_result(result, f"results[{index}]")
    for label, steps in traces.items():
        for index, step in enumerate(steps):
            _require(step, STEP_KEYS, f"trace {label!r}, step {index}")
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for name, fig in _figures(results, traces):
        if fig is not None:
            paths.append(_save(fig, os.path.join(out_dir, name)))
    return paths


def write_dashboard(result: dict, steps: list[dict], path: str) -> str:
    """The dashboard's page (bench/dashboard_page.py) with `result` and its `steps` in it."""
    _validate_result(result, "results[0]")
    engine = (result.get("config") or {}).get("engine") or {}  # (a simulated run's result names its engine)
    embedded = {"name": f"{result['label']} ({result['workload']})", "result": result, "steps": page_steps(steps),
                "token_budget": engine.get("max_num_batched_tokens"), "tbt_slo_ms": engine.get("tbt_slo_ms")}
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        f.write(page_html(embedded))
    logger.info("wrote %s", path)
    return path


def make_summary_figure(kind: str, paths: list[str], out_path: str) -> str:
    """Draw the headline figure `kind` from one compact result file into `out_path` (a PNG); the
    peers figure also prints its Markdown table, ratios to the file's reference included."""
    if len(paths) != 1:
        raise ValueError(f"--figure {kind} draws one compact result file, got {len(paths)}")
    if not out_path or not out_path.endswith(".png"):
        raise ValueError(f"--figure {kind}: -o names the PNG to write (FILE.png), got {out_path!r}")
    data = figure_data.load(paths[0])
    fig = draw(kind, data, paths[0])
    if kind == "peers":
        print(ratio_table(data))
    os.makedirs(os.path.dirname(out_path) or ".", exist_ok=True)
    fig.savefig(out_path)  # laid out by summary_figures, around its caption
    _close(fig)
    logger.info("wrote %s", out_path)
    return out_path


def clip_to_runs(steps: list[dict], results: list[dict]) -> list[dict]:
    """The steps that started while one of the results ran (from its bench start to its last end)."""
    spans = [(result["bench_start"], max((r["end_time"] for r in result["requests"]), default=result["bench_start"]))
             for result in results]
    return [step for step in steps if any(start <= step["start_time"] <= end for start, end in spans)]


def tbt_gaps_ms(result: dict) -> list[float]:
    """Every gap between consecutive tokens of the result's successful requests, in ms."""
    return [gap for request in result["requests"] if request["ok"] for gap in _gaps_ms(request["token_times"])]


def _gaps_ms(times: list[float]) -> list[float]:
    return [1000.0 * gap for gap in gaps(times)]


# ---- loading and validation ---------------------------------------------------------------


def _require(obj: Any, keys: tuple[str, ...], where: str) -> None:
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {json.dumps(obj)[:40]}")
    missing = [key for key in keys if key not in obj]
    if missing:
        raise ValueError(f"{where}: missing required key(s): {', '.join(missing)}")


def _validate_result(result: Any, where: str) -> None:
    _require(result, RESULT_KEYS, where)
    for index, request in enumerate(result["requests"]):
        _require(request, REQUEST_KEYS, f"{where}: requests[{index}]")
    if result["workload"] == "interference":
        _require(result.get("interference"), INTERFERENCE_KEYS, f"{where}: interference")


def _load_result(path: str) -> dict:
    with open(path, encoding="utf-8") as file:
        try:
            result = json.load(file)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}: not valid JSON ({error})") from error
    _validate_result(result, path)
    return result


def _load_trace(path: str) -> list[dict]:
    steps = []
    with open(path, encoding="utf-8") as file:
        for line_number, line in enumerate(file, start=1):
            if not line.strip():
                continue
            try:
                step = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{line_number}: not valid JSON ({error})") from error
            _require(step, STEP_KEYS, f"{path}:{line_number}")
            steps.append(step)
    return steps


def _load_traces(paths: list[str]) -> dict[str, list[dict]]:
    traces: dict[str, list[dict]] = {}
    for path in paths:
        label = Path(path).stem
        if label in traces:
            raise ValueError(f"{path}: another --trace file has the same label {label!r} (its file stem)")
        traces[label] = _load_trace(path)
    return traces


# ---- figures ------------------------------------------------------------------------------


def _figures(results: list[dict], traces: dict[str, list[dict]]) -> Iterator[tuple[str, Any]]:
    """(file name, figure or None) pairs, built one at a time so that one figure is open at once."""
    if not traces:
        logger.info("skipping steps_<label>.png: no step trace given (--trace)")
    for label, steps in traces.items():
        yield f"steps_{_file_label(label)}.png", _steps_figure(label, steps)
    colored = [(result, f"C{index % 10}") for index, result in enumerate(results)]
    yield "timeline.png", _timeline_figure(colored)
    yield "tbt_cdf.png", _tbt_cdf_figure(colored)


def _file_label(label: str) -> str:
    """The label with anything but letters, digits, '.', '-' and '_' replaced, safe in a file name."""
    return re.sub(r"[^\w.-]+", "_", label)


def _new_axes() -> tuple[Any, Any]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=FIGSIZE, dpi=DPI)


def _save(fig: Any, path: str) -> str:
    fig.tight_layout()
    fig.savefig(path)
    _close(fig)
    logger.info("wrote %s", path)
    return path


def _steps_figure(label: str, steps: list[dict]) -> Any:
    """Stacked prefill and decode tokens of each step (a bar as wide as the step) and its latency."""
    if not steps:
        logger.info("skipping the steps figure of trace %r: it has no steps", label)
        return None
    import numpy as np

    steps = sorted(steps, key=lambda step: step["start_time"])
    starts = np.array([step["start_time"] for step in steps]) - steps[0]["start_time"]
    ends = starts + np.array([step["duration_s"] for step in steps])
    prefill = np.array([step["num_prefill_tokens"] for step in steps], dtype=float)
    total = prefill + np.array([step["num_decode_tokens"] for step in steps])
    fig, ax = _new_axes()
    _add_bars(ax, starts, ends, np.zeros_like(prefill), prefill, "tab:orange", "prefill tokens")
    _add_bars(ax, starts, ends, prefill, total, "tab:blue", "decode tokens")
    ax.set_xlim(0, ends.max())
    ax.set_ylim(0, 1.3 * max(total.max(), 1))
    ax.set_xlabel("time since the first step (s)")
    ax.set_ylabel("tokens per step")
    latency_ax = _plot_step_latency(ax, steps, (starts + ends) / 2)
    modes = ", ".join(f"{_count(steps, mode)} {mode}" for mode in ("EXTEND", "MIXED", "DECODE"))
    ax.set_title(f"Engine steps: {label} ({len(steps)} steps: {modes})")
    handles, labels = ax.get_legend_handles_labels()
    more_handles, more_labels = latency_ax.get_legend_handles_labels()
    ax.legend(handles + more_handles, labels + more_labels, loc="upper left", ncol=2, fontsize="small")
    return fig


def _add_bars(ax: Any, starts: Any, ends: Any, bottoms: Any, tops: Any, color: str, label: str) -> None:
    """One rectangle per step in a single collection: `ax.bar` takes minutes for 20k-step traces."""
    import numpy as np
    from matplotlib.collections import PolyCollection

    corners = [(starts, bottoms), (ends, bottoms), (ends, tops), (starts, tops)]
    rectangles = np.stack([np.stack(corner, axis=1) for corner in corners], axis=1)
    ax.add_collection(PolyCollection(rectangles, facecolors=color, linewidths=0, label=label))


def _count(steps: list[dict], mode: str) -> int:
    return sum(step["forward_mode"] == mode for step in steps)


def _plot_step_latency(ax: Any, steps: list[dict], middles: Any) -> Any:
    """Step latency on a second y axis, with the steps that preempted a request marked."""
    import numpy as np

    latency_ax = ax.twinx()
    latency_ms = np.array([step["duration_s"] * 1000.0 for step in steps])
    latency_ax.plot(middles, latency_ms, color="black", linewidth=0.8, label="step latency")
    preempting = np.array([bool(step["num_preemptions"]) for step in steps])
    if preempting.any():
        latency_ax.plot(middles[preempting], latency_ms[preempting], "x", color="tab:red",
                        label="step with preemptions")
    latency_ax.set_ylim(0, 1.3 * max(latency_ms.max(), 1e-3))
    latency_ax.set_ylabel("step latency (ms)")
    return latency_ax


def _timeline_figure(colored: list[tuple[dict, str]]) -> Any:
    """One decode stream per interference result: a flat stretch is the stream waiting."""
    interference = [(result, color) for result, color in colored if result["workload"] == "interference"]
    if not interference:
        logger.info("skipping timeline.png: no result of the 'interference' workload")
        return None
    fig, ax = _new_axes()
    plotted = [_plot_stream(ax, result, color) for result, color in interference]
    if not any(plotted):
        _close(fig)
        logger.info("skipping timeline.png: no interference result has a stream request with tokens")
        return None
    from matplotlib.lines import Line2D

    markers = [Line2D([], [], color="grey", linestyle="--", label="long prompt sent")]
    if any(_long_first_tokens(result) for result, _ in interference):
        markers.append(Line2D([], [], color="grey", linestyle=":", label="long prompt's first token"))
    handles, _ = ax.get_legend_handles_labels()
    ax.legend(handles=handles + markers, loc="upper left", fontsize="small")
    ax.set_xlabel("time since the bench start (s)")
    ax.set_ylabel("tokens received by the stream")
    ax.set_title("A decode stream while long prompts arrive")
    return fig


def _plot_stream(ax: Any, result: dict, color: str) -> bool:
    """The result's first stream request, its long prompts' sends (dashed) and first tokens (dotted)."""
    stream = next((request for request in result["requests"] if request["kind"] == "stream"), None)
    if stream is None or not stream["token_times"]:
        logger.warning("timeline.png: result %r has no stream request with tokens; left out", result["label"])
        return False
    start = result["bench_start"]
    times = [t - start for t in stream["token_times"]]
    gaps = _gaps_ms(stream["token_times"])
    longest = f" (longest gap {max(gaps):.0f} ms)" if gaps else ""
    ax.plot(times, range(1, len(times) + 1), drawstyle="steps-post", color=color,
            label=f"{result['label']}{longest}")
    for sent in result["interference"]["long_send_times"]:
        ax.axvline(sent - start, color=color, linestyle="--", linewidth=1)
    for first_token in _long_first_tokens(result):
        ax.axvline(first_token - start, color=color, linestyle=":", linewidth=1)
    return True


def _long_first_tokens(result: dict) -> list[float]:
    return [request["token_times"][0] for request in result["requests"]
            if request["kind"] == "long" and request["token_times"]]


def _tbt_cdf_figure(colored: list[tuple[dict, str]]) -> Any:
    """The CDF of every gap between tokens, per result; the tail is where chunking matters."""
    import numpy as np

    curves = [(result, color, np.sort(tbt_gaps_ms(result))) for result, color in colored]
    for result, _, gaps in curves:
        if gaps.size == 0:
            logger.warning("tbt_cdf.png: result %r has no gaps between tokens; left out", result["label"])
    curves = [curve for curve in curves if curve[2].size]
    if not curves:
        logger.info("skipping tbt_cdf.png: no result has two tokens in one successful request")
        return None
    fig, ax = _new_axes()
    for result, color, gaps in curves:
        _plot_cdf(ax, result["label"], color, gaps)
    ax.axhline(0.99, color="grey", linestyle=":", linewidth=0.8)
    _log_x_axis_in_plain_numbers(ax)
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("time between tokens (ms, log scale)")
    ax.set_ylabel("fraction of gaps ≤ x")
    ax.set_title("Time between tokens (TBT), all successful requests")
    ax.legend(loc="lower right", fontsize="small")
    return fig


def _plot_cdf(ax: Any, label: str, color: str, gaps: Any) -> None:
    """A step CDF of sorted gaps with its p99 as a dot; it rises from 0, or from the share of
    gaps of 0 ms or less, which a log x axis cannot show."""
    import numpy as np

    positive = gaps[gaps > 0]
    fraction = np.arange(gaps.size - positive.size, gaps.size + 1) / gaps.size
    p99 = float(np.percentile(gaps, 99))
    ax.plot(np.concatenate([positive[:1], positive]), fraction, drawstyle="steps-post", color=color,
            label=f"{label}: p99 {p99:.1f} ms, max {gaps[-1]:.0f} ms ({gaps.size} gaps)")
    if p99 > 0:
        ax.plot([p99], [0.99], "o", color=color, markersize=5)


def _log_x_axis_in_plain_numbers(ax: Any) -> None:
    """Ticks read "20, 50, 100" rather than "2x10^1", which crowd each other."""
    from matplotlib.ticker import LogFormatter

    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(LogFormatter())
    ax.xaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False, minor_thresholds=(1, 0.5)))


def _close(fig: Any) -> None:
    import matplotlib.pyplot as plt

    plt.close(fig)
