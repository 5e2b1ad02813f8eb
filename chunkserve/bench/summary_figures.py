"""The headline figures of docs/BENCHMARKS.md, drawn from compact result files (figure_data.py):
`chunkserve bench plot --figure KIND DATA.json -o FIGURE.png`.

Each kind reads the metrics it names from every configuration, so a sweep's own
`figure_data.json` and a file transcribed from the log draw the same figure. Every figure names
the CPU, commit and date of its numbers, and each bar its dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from chunkserve.bench import figure_data
from chunkserve.bench.figure_data import CAPACITY_PREFIX, median, quoted_ratio, spread

DPI = 110
# (metric, title, unit, higher is better)
Panel = tuple[str, str, str, bool]
SCENARIO_A = ("scenario-a.output_tok_s", "Scenario A throughput", "output tok/s", True)
DECODE_1 = ("decode-1.tbt_p50_ms", "decode-1 TBT p50", "ms", False)
DECODE_8 = ("decode-8.tbt_p50_ms", "decode-8 TBT p50", "ms", False)
STALL = ("tbt_p99_ms", "Scenario B decode TBT p99 during long prompts", "ms", False)
LONG_TTFT = ("long_ttft_p50_s", "Scenario B long-prompt TTFT p50", "s", False)
PEERS = (SCENARIO_A, DECODE_1, DECODE_8, STALL, LONG_TTFT)


def draw(kind: str, data: dict, where: str) -> Any:
    """The figure of `kind` from a validated compact file; a missing input is a ValueError naming it."""
    if kind not in FIGURES:
        raise ValueError(f"unknown figure kind {kind!r}; one of: {', '.join(FIGURES)}")
    return FIGURES[kind](data, where)


def ratio_table(data: dict, panels: tuple[Panel, ...] = PEERS) -> str:
    """The Markdown table docs/BENCHMARKS.md carries: median (range) and the ratio to the reference."""
    header = "| system | " + " | ".join(f"{title} ({unit})" for _, title, unit, _ in panels) + " |"
    lines = [header, "|---" * (len(panels) + 1) + "|"]
    for config in data["configs"]:
        cells = []
        for metric, _, _, _ in panels:
            value = config["values"].get(metric)
            if value is None:
                cells.append("-")
                continue
            cell = _number(median(value))
            if spread(value):
                cell += " ({}-{})".format(*map(_number, spread(value)))
            ratio = _ratio(data, config, metric)
            cells.append(cell + (f", {_ratio_text(ratio)}" if ratio is not None else ""))
        lines.append(f"| {config['label']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---- the kinds ------------------------------------------------------------------------------


def _peers(data: dict, where: str) -> Any:
    return _bar_panels(data, where, PEERS, "the headline numbers per system")


def _throughput(data: dict, where: str) -> Any:
    return _bar_panels(data, where, (SCENARIO_A,), "Scenario A output throughput per system")


def _decode(data: dict, where: str) -> Any:
    return _bar_panels(data, where, (DECODE_1, DECODE_8), "time between tokens of 1 and 8 streams decoding alone")


def _bar_panels(data: dict, where: str, panels: tuple[Panel, ...], title: str) -> Any:
    """One horizontal bar per configuration and panel: the median, the range as a whisker, the value
    and its ratio to the reference written beside it."""
    figure_data.require_metrics(data, tuple(metric for metric, _, _, _ in panels), where)
    configs = data["configs"]
    panel_width = 4.4 if len(panels) <= 2 else 3.3
    fig, axes = _subplots(len(panels), (3.5 + panel_width * len(panels), 0.5 * len(configs) + 2.4), sharey=True)
    for ax, (metric, panel_title, unit, higher) in zip(axes, panels):
        values = [config["values"][metric] for config in configs]
        medians = [median(value) for value in values]
        whiskers = [[m - (spread(v) or (m, m))[0] for m, v in zip(medians, values)],
                    [(spread(v) or (m, m))[1] - m for m, v in zip(medians, values)]]
        ax.barh(range(len(configs)), medians, xerr=whiskers, color=[_color(c["label"]) for c in configs], capsize=3)
        for y, (config, value, above) in enumerate(zip(configs, medians, whiskers[1])):
            ratio = _ratio(data, config, metric)
            text = f" {_number(value)}" + (f" ({_ratio_text(ratio)})" if ratio is not None else "")
            ax.text(value + above, y, text, va="center", fontsize=7)
        if max(medians) > 20 * min(m for m in medians if m > 0):  # Scenario B's p99 spans 100x
            ax.set_xscale("log")
        ax.set_xlim(right=ax.get_xlim()[1] * (5 if ax.get_xscale() == "log" else 1.3))
        ax.set_xlabel(f"{unit} ({'higher' if higher else 'lower'} is better)")
        ax.set_title(panel_title, fontsize=9)
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_yticks(range(len(configs)), [_bar_label(c) for c in configs], fontsize=8)
    axes[0].invert_yaxis()
    reference = f"; (x) = ratio to {data['reference']}" if data.get("reference") else ""
    return _finish(fig, data, f"{title}: median of the rounds, whiskers the range{reference}")


def _tradeoff(data: dict, where: str) -> Any:
    """Decode P99 during long prompts against the long prompts' TTFT, one point per configuration;
    the fixed token budgets (args `--max-num-batched-tokens N` alone) joined in budget order, each
    configuration's `--tbt-slo-ms` drawn as a line."""
    figure_data.require_metrics(data, ("tbt_p99_ms", "long_ttft_p50_s"), where)
    fig, (ax,) = _subplots(1, (8.0, 5.0))
    budgets = []
    for config in data["configs"]:
        x, y = median(config["values"]["long_ttft_p50_s"]), median(config["values"]["tbt_p99_ms"])
        budget = _fixed_budget(config)
        if budget is not None:
            budgets.append((budget, x, y))
        ax.scatter(x, y, marker="o" if budget is not None else "*", s=40 if budget is not None else 140,
                   color="tab:blue" if budget is not None else "tab:red", zorder=3)
        ax.annotate(config["label"], (x, y), textcoords="offset points", fontsize=8,
                    xytext=(6, 4) if budget is not None else (6, -12))
    budgets.sort()
    ax.plot([x for _, x, _ in budgets], [y for _, _, y in budgets], color="tab:blue", alpha=0.4,
            label="fixed token budgets (--max-num-batched-tokens)")
    for slo in sorted({_flag(config, "--tbt-slo-ms") for config in data["configs"]} - {None}):
        ax.axhline(float(slo), color="gray", linestyle="--", linewidth=0.8)
        ax.annotate(f"TBT SLO {slo} ms", (0.99, float(slo)), xycoords=("axes fraction", "data"), ha="right",
                    textcoords="offset points", xytext=(0, 3), fontsize=8, color="gray")
    ax.set(xscale="log", yscale="log", xlabel="long-prompt TTFT p50 (s, log scale)",
           ylabel="decode TBT p99 during long prompts (ms, log scale)")
    ax.set_xlim(right=ax.get_xlim()[1] * 1.5)  # room for the rightmost point's label
    _plain_log_ticks(ax)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper right", fontsize=8)
    return _finish(fig, data, "Stalls against prompt latency, one point per configuration; below and left is better")


def _capacity(data: dict, where: str) -> Any:
    """The highest request rate meeting each P99 TBT SLO, per configuration (grouped bars)."""
    slos = sorted({m for c in data["configs"] for m in c["values"] if m.startswith(CAPACITY_PREFIX)},
                  key=lambda metric: float(metric[len(CAPACITY_PREFIX):-2]))
    if not slos:
        raise ValueError(f"{where}: no configuration has a capacity value ({CAPACITY_PREFIX}<SLO>ms)")
    figure_data.require_metrics(data, tuple(slos), where)
    configs = data["configs"]
    fig, (ax,) = _subplots(1, (8.0, 0.25 * len(configs) * len(slos) + 2.4))
    height = 0.8 / len(slos)
    for index, metric in enumerate(slos):
        ys = [y + _offset(index, height) for y in range(len(configs))]
        values = [median(config["values"][metric]) for config in configs]
        ax.barh(ys, values, height=height, label=f"P99 TBT <= {metric[len(CAPACITY_PREFIX):-2]} ms")
        for y, value in zip(ys, values):
            ax.text(value, y, f" {value:g}", va="center", fontsize=7)
    ax.set_yticks(range(len(configs)), [_bar_label(c) for c in configs], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("capacity (req/s, higher is better)")
    ax.grid(axis="x", alpha=0.3)
    ax.set_xlim(right=ax.get_xlim()[1] * 1.1)
    ax.legend(loc="lower right", fontsize=8)
    return _finish(fig, data, "Capacity: the highest request rate whose P99 TBT meets the SLO")


def _speculative(data: dict, where: str) -> Any:
    """Output tok/s per workload (a panel each), load (streams) and mode, each bar with its ratio to
    the same system without speculation as the source quotes it."""
    figure_data.require_fields(data, ("workload", "streams", "mode"), where)
    figure_data.require_metrics(data, ("out_tok_s", "vs_own_off"), where)
    workloads = list(dict.fromkeys(config["workload"] for config in data["configs"]))
    modes = list(dict.fromkeys(config["mode"] for config in data["configs"]))
    fig, axes = _subplots(len(workloads), (5.2 * len(workloads), 4.8), sharey=True)
    width = 0.8 / len(modes)
    for ax, workload in zip(axes, workloads):
        configs = [config for config in data["configs"] if config["workload"] == workload]
        loads = sorted({config["streams"] for config in configs})
        for index, mode in enumerate(modes):
            for config in (c for c in configs if c["mode"] == mode):
                x = loads.index(config["streams"]) + _offset(index, width)
                value = median(config["values"]["out_tok_s"])
                ax.bar(x, value, width=width, color=f"C{index}", label=mode)
                ax.text(x, value, f"{median(config['values']['vs_own_off']):.2f}x", ha="center", va="bottom",
                        fontsize=6, rotation=90)
        ax.set_xticks(range(len(loads)), [f"{n} stream(s)" for n in loads])
        ax.set_title(workload, fontsize=9)
        ax.set_ylabel("output tok/s (higher is better)")
        ax.grid(axis="y", alpha=0.3)
    top = max(median(config["values"]["out_tok_s"]) for config in data["configs"])
    axes[0].set_ylim(0, 1.15 * top)  # shared by the panels; room for the ratios above the bars
    handles, labels = axes[0].get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    axes[0].legend(unique.values(), unique.keys(), loc="upper left", fontsize=7, title="mode", title_fontsize=7)
    return _finish(fig, data, f"n-gram speculation ({_dtypes(data)}): output tok/s, "
                   "(x) = ratio to the same system without it")


def _disaggregation(data: dict, where: str) -> Any:
    """The streams' TBT during long prompts, the long prompts' TTFT and the output rate per
    configuration, each with its ratio to the reference."""
    panels = ((("tbt_p50_ms", "p50"), ("tbt_p99_ms", "p99"), ("tbt_max_ms", "max")),
              (("long_ttft_p50_s", "p50"), ("long_ttft_p99_s", "p99")), (("output_tok_s", "output"),))
    titles = (("stream TBT during long prompts", "ms"), ("long-prompt TTFT", "s"), ("output throughput", "tok/s"))
    figure_data.require_metrics(data, ("tbt_p50_ms", "tbt_p99_ms", "output_tok_s"), where)
    configs = data["configs"]
    fig, axes = _subplots(3, (15.0, 0.4 * len(configs) * 3 + 2.4), sharey=True)
    for ax, stats, (title, unit) in zip(axes, panels, titles):
        height = 0.8 / len(stats)
        for index, (metric, name) in enumerate(stats):
            rows = [(y + _offset(index, height), c) for y, c in enumerate(configs) if metric in c["values"]]
            values = [median(c["values"][metric]) for _, c in rows]
            ax.barh([y for y, _ in rows], values, height=height, color=f"C{index}", label=name)
            for (y, config), value in zip(rows, values):
                ratio = _ratio(data, config, metric)
                text = f" {_number(value)}" + (f" ({_ratio_text(ratio)})" if ratio is not None else "")
                ax.text(value, y, text, va="center", fontsize=7)
        ax.set_xlim(right=ax.get_xlim()[1] * 1.35)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel(f"{unit} ({'higher' if unit == 'tok/s' else 'lower'} is better)")
        ax.grid(axis="x", alpha=0.3)
        if len(stats) > 1:
            ax.legend(loc="lower right", fontsize=7)
    axes[0].set_yticks(range(len(configs)), [_bar_label(c) for c in configs], fontsize=8)
    axes[0].invert_yaxis()
    reference = f"; (x) = ratio to {data['reference']}" if data.get("reference") else ""
    return _finish(fig, data, f"a prefill core and a decode core against colocated serving{reference}")


FIGURES: dict[str, Callable[[dict, str], Any]] = {
    "peers": _peers, "throughput": _throughput, "decode": _decode, "tradeoff": _tradeoff,
    "capacity": _capacity, "speculative": _speculative, "disaggregation": _disaggregation,
}


# ---- shared parts ---------------------------------------------------------------------------


def _subplots(ncols: int, size: tuple[float, float], sharey: bool = False) -> tuple[Any, list[Any]]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=size, dpi=DPI, sharey=sharey, squeeze=False)
    return fig, list(axes[0])


def _finish(fig: Any, data: dict, title: str) -> Any:
    """The title, and a caption naming the CPU, commit, date and the log section of the numbers,
    both wrapped to the figure's width."""
    import textwrap

    source = data["source"]
    log = f'; log: "{source["log_section"]}"' if source.get("log_section") else ""
    width_in, height_in = fig.get_size_inches()
    fig.suptitle(textwrap.fill(f"{data.get('title', '')}: {title}", int(width_in * 13)), fontsize=10)
    caption = textwrap.fill(f"{source['cpu']}; chunkserve {source['commit']}, {source['date']}{log}",
                            int(width_in * 16))
    fig.text(0.5, 0.01, caption, ha="center", va="bottom", fontsize=7)
    fig.tight_layout(rect=(0, (0.2 + 0.13 * (caption.count("\n") + 1)) / height_in, 1, 1))
    return fig


def _offset(index: int, width: float) -> float:
    """Where the index-th bar of a group sits, the group (0.8 wide) centred on its tick."""
    return (index + 0.5) * width - 0.4


def _plain_log_ticks(ax: Any) -> None:
    """Log axes whose ticks read "3, 4, 6, 10" rather than "3x10^0"."""
    from matplotlib.ticker import LogFormatter

    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_formatter(LogFormatter())
        axis.set_minor_formatter(LogFormatter(labelOnlyBase=False, minor_thresholds=(2, 0.5)))


def _ratio(data: dict, config: dict, metric: str) -> float | None:
    """The ratio to the reference configuration as quoted, else computed from the medians."""
    value = config["values"][metric]
    if quoted_ratio(value) is not None:
        return float(quoted_ratio(value))
    reference = next((c for c in data["configs"] if c["label"] == data.get("reference")), None)
    if reference is None or reference is config or metric not in reference["values"]:
        return None
    base = median(reference["values"][metric])
    return median(value) / base if base else None


def _bar_label(config: dict) -> str:
    """The label, with the dtype after it unless the label names it already ("llama.cpp Q4_0")."""
    dtype = str(config.get("dtype") or "")
    return config["label"] if not dtype or dtype.split()[0] in config["label"] else f"{config['label']}, {dtype}"


def _dtypes(data: dict) -> str:
    return ", ".join(sorted({str(c["dtype"]) for c in data["configs"] if c.get("dtype")})) or "dtype not recorded"


def _color(label: str) -> str:
    return "#1f77b4" if label.startswith("chunkserve") else "#ff7f0e" if label.startswith("vLLM") else "#2ca02c"


def _flag(config: dict, flag: str) -> str | None:
    args = config.get("args", [])
    return args[args.index(flag) + 1] if flag in args[:-1] else None


def _fixed_budget(config: dict) -> int | None:
    """N where the configuration's args are `--max-num-batched-tokens N` and nothing else."""
    args = config.get("args", [])
    return int(args[1]) if len(args) == 2 and args[0] == "--max-num-batched-tokens" else None


def _ratio_text(ratio: float) -> str:
    return f"{ratio:.2f}x" if ratio < 10 else f"{ratio:.1f}x" if ratio < 100 else f"{ratio:.0f}x"


def _number(value: float) -> str:
    return f"{value:.2f}" if value < 10 else f"{value:.1f}" if value < 100 else f"{value:.0f}"

