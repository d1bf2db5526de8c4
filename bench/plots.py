"""Each benchmark's picture: a PNG next to its JSON, drawn from the results alone, so that a
reader sees at a glance where a figure stands against its aim.

`harness.write` draws it after writing the JSON; `.venv/bin/python bench/plots.py` redraws every
result under bench/results/ (or the JSON files named) without running anything.

Three kinds of panel recur: a figure against its aim (measured / aim, a line at 1: green where
the aim is met), latency distributions (empirical CDFs), and time per stage of a pipeline.
"""

import json
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display, whatever the environment says

import matplotlib.pyplot as plt  # after the backend is chosen
from matplotlib.axes import Axes
from matplotlib.figure import Figure

Result = Mapping[str, Any]
MET, MISSED, NEUTRAL = "#2e7d32", "#c62828", "#607d8b"


@dataclass(frozen=True)
class Aim:
    """One figure of a result (its key), the aim it is held to, and which way is better."""

    label: str
    key: str
    aim: float
    unit: str = ""
    higher_is_better: bool = False
    scale: float = 1.0  # the JSON's unit to the label's (e.g. 1e3 for seconds shown as ms)

    def value(self, result: Result) -> float | None:
        value = result.get(self.key)
        return None if value is None else float(value) * self.scale

    def met(self, value: float) -> bool:
        return value >= self.aim if self.higher_is_better else value <= self.aim


def number(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


def aims_panel(ax: Axes, result: Result, aims: Sequence[Aim]) -> None:
    """Each figure as a bar of measured / aim with the aim at 1: a bar ending left of the line
    meets a lower-is-better aim, right of it a higher-is-better one."""
    rows = [(aim, value) for aim in aims if (value := aim.value(result)) is not None]
    if not rows:
        ax.set_axis_off()
        return
    labels, ratios, colours = [], [], []
    for aim, value in rows:
        sign = ">=" if aim.higher_is_better else "<="
        labels.append(f"{aim.label}\n{number(value)} {aim.unit} (aim {sign} {number(aim.aim)})")
        ratios.append(value / aim.aim)
        colours.append(MET if aim.met(value) else MISSED)
    positions = range(len(rows))
    ax.barh(positions, ratios, color=colours)
    ax.set_yticks(list(positions), labels, fontsize=8)
    ax.invert_yaxis()
    ax.axvline(1.0, color="black", linewidth=1)
    ax.set_xlabel("measured / aim (green: met)")
    if max(ratios) / max(min(ratios), 1e-9) > 50:
        ax.set_xscale("log")


def cdf_panel(
    ax: Axes, series: Mapping[str, Sequence[float]], unit: str, scale: float = 1.0
) -> None:
    """Empirical CDFs of latency samples, one line per series."""
    drawn = False
    for name, samples in series.items():
        if not samples:
            continue
        ordered = sorted(float(s) * scale for s in samples)
        fractions = [(i + 1) / len(ordered) for i in range(len(ordered))]
        ax.step(ordered, fractions, where="post", label=f"{name} (n={len(ordered):,})")
        drawn = True
    if not drawn:
        ax.set_axis_off()
        return
    ax.set_xlabel(unit)
    ax.set_ylabel("fraction of samples <= x")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def stages_panel(ax: Axes, paths: Mapping[str, Mapping[str, float]]) -> None:
    """One horizontal bar per path, split into its stages (median seconds)."""
    names = list(paths)
    colours = plt.get_cmap("tab20").colors
    stage_names = list(dict.fromkeys(stage for stages in paths.values() for stage in stages))
    for row, name in enumerate(names):
        left = 0.0
        for stage, seconds in paths[name].items():
            colour = colours[stage_names.index(stage) % len(colours)]
            ax.barh(row, seconds, left=left, color=colour, label=f"{name}: {stage} {seconds:.2f} s")
            left += seconds
        ax.text(left, row, f" {left:.2f} s", va="center", fontsize=8)
    ax.set_yticks(range(len(names)), names)
    ax.invert_yaxis()
    ax.set_xlabel("seconds (median per stage)")
    ax.legend(fontsize=7, loc="upper right", ncol=2)  # the adapter path leaves room there


def bars_panel(ax: Axes, values: Mapping[str, float], label: str, log: bool = False) -> None:
    names = [name for name, value in values.items() if value is not None]
    ax.bar(names, [float(values[n]) for n in names], color=NEUTRAL)
    for i, name in enumerate(names):
        ax.text(i, float(values[name]), number(float(values[name])), ha="center", va="bottom")
    ax.set_ylabel(label)
    ax.tick_params(axis="x", labelsize=8, rotation=15)
    if log:
        ax.set_yscale("log")


def figure(title: str, panels: int, width: float = 12.0) -> tuple[Figure, list[Axes]]:
    fig, axes = plt.subplots(1, panels, figsize=(width, 4.2), squeeze=False)
    fig.suptitle(title)
    return fig, list(axes[0])


def rounds_of(result: Result, target: str, key: str) -> list[float]:
    return [float(r[key]) for r in result.get("rounds", {}).get(target, [])]


# The issues' aims, one place: a benchmark's JSON holds what it measured, these what it is held to.


def register(result: Result) -> Figure:
    fig, (samples, aims) = figure("register: one revision against a real MLflow server", 2)
    cdf_panel(
        samples,
        {
            "imported revision": result.get("samples_s", []),
            "trained revision": result.get("trained_samples_s", []),
        },
        "ms",
        scale=1e3,
    )
    aims_panel(
        aims,
        result,
        [
            Aim("register p50, imported", "register_p50_s", 50, "ms", scale=1e3),
            Aim("register p50, trained", "trained_register_p50_s", 50, "ms", scale=1e3),
        ],
    )
    return fig


def admission(result: Result) -> Figure:
    fig, (tenants, aims) = figure("admission: 32 new adapters promoted under tenants' load", 2)
    phases = ("baseline", "fair_baseline", "during")
    bars_panel(
        tenants,
        {f"p95 {p}": result.get(f"p95_{p}_s") for p in phases}
        | {f"p50 {p}": result.get(f"p50_{p}_s") for p in phases},
        "tenants' latency (s)",
    )
    aims_panel(
        aims,
        result,
        [
            Aim("activation p50 (alias move to answers)", "activation_p50_s", 1.0, "s"),
            Aim("loads on the request path", "request_path_loads", 1),
        ],
    )
    return fig


def sync_paths(title: str, reference: float, reference_label: str) -> Callable[[Result], Figure]:
    def draw(result: Result) -> Figure:
        fig, (stages, aims) = figure(title, 2, width=14)
        stages_panel(stages, result.get("stages_s", {}))
        aims_panel(aims, result, [Aim(reference_label, "speedup", reference, "x", True)])
        return fig

    return draw


def batching(result: Result) -> Figure:
    fig, (speeds, aims) = figure("batching: 64 adapters in one continuous batch", 2)
    bars_panel(speeds, result.get("tokens_per_s", {}), "generated tokens/s")
    aims_panel(
        aims,
        result,
        [
            Aim("mixed / base only", "mixed_over_base", 0.95, "x", True),
            Aim("slot load / device copy bandwidth", "slot_copy_over_device_copy", 0.8, "x", True),
        ],
    )
    return fig


def catalog(result: Result) -> Figure:
    fig, (moves, aims) = figure("catalog: a million revisions", 2, width=14)
    cdf_panel(
        moves,
        {
            "alias move seen (from move_alias returning)": result.get(
                "alias_visible_samples_s", []
            ),
            "from move_alias starting": result.get("alias_visible_from_move_start_samples_s", []),
        },
        "s",
    )
    aims_panel(
        aims,
        result,
        [
            Aim("resolve p99, one thread", "resolve_p99_us", 100, "µs"),
            Aim("resolves/s, 8 threads, uniform", "resolve_threaded_per_s", 100_000, "/s", True),
            Aim("resolves/s, 8 threads, Zipf", "resolve_zipf_per_s", 100_000, "/s", True),
            Aim(
                "resolves/s, 8 threads, recent",
                "resolve_recent_threaded_per_s",
                100_000,
                "/s",
                True,
            ),
            Aim("catalog memory", "catalog_rss_mb", 1024, "MiB"),
            Aim("cold start", "cold_start_s", 5, "s"),
            Aim("alias move seen, max", "alias_visible_max_s", 1, "s"),
        ],
    )
    return fig


def gateway(result: Result) -> Figure:
    fig, (rounds, aims) = figure("gateway: two workers behind it vs one worker directly", 2)
    rounds.plot(rounds_of(result, "latency_direct", "p50_ms"), "o-", label="direct p50")
    rounds.plot(rounds_of(result, "latency_gateway", "p50_ms"), "o-", label="gateway p50")
    rounds.set_xlabel("round")
    rounds.set_ylabel("ms (one client, 4 new tokens)")
    rounds.legend(fontsize=8)
    aims_panel(aims, result, [Aim("gateway added p50", "added_p50_ms", 1.0, "ms")])
    return fig


def backends(result: Result) -> Figure:
    fig, (speeds, aims) = figure("backends: embedded, vLLM behind MinT, vLLM alone", 2)
    targets = ("embedded", "vllm_mint", "vllm_direct")
    bars_panel(speeds, {t: result.get(f"{t}_tok_s") for t in targets}, "tokens/s (median)")
    throughput = result.get("vllm_mint_tok_s", 0) / max(result.get("vllm_direct_tok_s", 1), 1e-9)
    aims_panel(
        aims,
        {**result, "throughput_ratio": throughput},
        [
            Aim("vLLM behind MinT, p50 overhead", "gateway_p50_overhead", 5, "%", scale=100),
            Aim("throughput / vLLM alone", "throughput_ratio", 0.97, "x", True),
        ],
    )
    return fig


def packing(result: Result) -> Figure:
    fig, (times,) = figure("packing: loading the reference MoE LoRA", 1)
    bars_panel(times, result.get("median_s", {}), "seconds (median)", log=True)
    return fig


def recipe(result: Result) -> Figure:
    fig, (runs,) = figure("recipe: held-out accuracy per run", 1)
    adapters = result.get("adapters", [])
    runs.plot([a["accuracy"] for a in adapters], "o", color=NEUTRAL)
    runs.set_xlabel("run (threads x base seed x seed)")
    runs.set_ylabel("held-out exact")
    runs.set_ylim(0, 1.05)
    return fig


def rl(result: Result) -> Figure:
    fig, (seeds,) = figure("rl: held-out exact before and after RL", 1)
    for i, run in enumerate(result.get("runs", [])):
        stages = ("held_out_exact_base", "held_out_exact_start", "held_out_exact_after")
        seeds.plot(["base", "SFT start", "after RL"], [run[s] for s in stages], "o-", label=i)
    seeds.set_ylabel("held-out exact")
    seeds.legend(title="seed", fontsize=8)
    return fig


def tenants(result: Result) -> Figure:
    fig, (memory, speed, aims) = figure("tenants: one trainer vs separate trainings", 3, 15)
    for mode in ("shared", "separate"):
        cases = [c for c in result.get("cases", []) if c["mode"] == mode]
        memory.plot([c["tenants"] for c in cases], [c["rss_mb"] for c in cases], "o-", label=mode)
        speed.plot([c["tenants"] for c in cases], [c["tokens_per_s"] for c in cases], "o-")
    memory.set(xlabel="tenants", ylabel="peak RSS (MB)")
    memory.legend(fontsize=8)
    speed.set(xlabel="tenants", ylabel="trained tokens/s")
    most = max(result.get("ratios", []), key=lambda r: r["tenants"], default={})
    aims_panel(
        aims,
        most,
        [
            Aim("shared / separate tokens/s", "throughput_ratio", 1.5, "x", True),
        ],
    )
    return fig


def tiers(result: Result) -> Figure:
    fig, (latency, aims) = figure("tiers: 10,000 adapters over two workers", 2, 14)
    samples = result.get("samples", {})
    cdf_panel(
        latency,
        {
            "ready requests": samples.get("warm_s", []),
            "ready-only baseline": samples.get("baseline_warm_s", []),
            "cold: first 503 to answer": samples.get("cold_s", []),
        },
        "s",
    )
    latency.set_xscale("log")
    aims_panel(
        aims,
        result,
        [
            Aim("cold time to first answer, p50", "cold_p50_s", 1, "s"),
            Aim("cold time to first answer, p99", "cold_p99_s", 3, "s"),
            Aim("ready p95 / baseline", "warm_p95_ratio", 1.10, "x"),
        ],
    )
    return fig


def tiers_sim(result: Result) -> Figure:
    fig, (hits,) = figure("tiers_sim: host hit ratio at 10^6 adapters x 100 workers", 1)
    policies = ("host_hit_ratio", "belady_hit_ratio", "lru_hit_ratio", "static_top_hit_ratio")
    by_zipf = result.get("by_zipf", {})
    width = 0.8 / len(policies)
    for i, policy in enumerate(policies):
        xs = [z + (i - (len(policies) - 1) / 2) * width for z in range(len(by_zipf))]
        hits.bar(xs, [figures[policy] for figures in by_zipf.values()], width * 0.9)
    hits.set_xticks(range(len(by_zipf)), [f"Zipf s = {z}" for z in by_zipf])
    hits.legend(["MinT", "Belady", "LRU", "static top"], fontsize=8)
    hits.set_ylabel("host hit ratio")
    return fig


def cluster(result: Result) -> Figure:
    fig, axes = plt.subplots(2, 2, figsize=(16, 8.5))
    fig.suptitle("cluster: MinT across hosts (network namespaces on one machine)")
    (release, cut), (latency, times) = axes
    figures = {k: result.get(k) or {} for k in
               ("release", "serve_cut", "control_cut", "latency", "train_killed")}  # fmt: skip
    stages = figures["release"].get("stage_s", {})
    if stages:
        bars_panel(release, stages, "seconds (one release)")
        release.set_title(f"release: ran on {figures['release'].get('flow_run_host', '?')}, "
                          f"{figures['release'].get('total_s', 0):.1f} s from its start to the "
                          f"client's first answer by it", fontsize=9)  # fmt: skip
    else:
        release.set_axis_off()
    serve_cut_timeline(cut, figures["serve_cut"])
    p50 = figures["latency"].get("p50_ms", {})
    if p50:
        bars_panel(latency, p50, "client p50 (ms), path@delay")
        latency.set_title(
            f"gateway adds {figures['latency'].get('added_p50_ms_no_delay', 0):.1f} ms, "
            f"{figures['latency'].get('added_p50_ms_20ms', 0):.1f} ms with the delay",
            fontsize=9,
        )
    else:
        latency.set_axis_off()
    waits = {
        "cut: gateway\nsees it": figures["serve_cut"].get("down_s"),
        "cut: revisions\nrecovered": figures["serve_cut"].get("recovery_s"),
        "cut: share\nback": figures["serve_cut"].get("rejoin_s"),
        "control cut:\ncaught up": figures["control_cut"].get("catch_up_s"),
        "activation,\nno delay": figures["latency"].get("activation_s_no_delay"),
        "activation,\n20 ms": figures["latency"].get("activation_s_20ms"),
        "train kill:\nrun ended": figures["train_killed"].get("crash_detected_s"),
    }
    waits = {k: v for k, v in waits.items() if v is not None and v > 0}
    if waits:
        bars_panel(times, waits, "seconds", log=True)
        killed = figures["train_killed"]
        times.set_title(
            f"control cut served all: {figures['control_cut'].get('served_while_cut')}; "
            f"kill: {killed.get('final_state', '?')}, registered {killed.get('registered', '?')}"
            f", rerun ok {killed.get('rerun_ok', '?')} on {killed.get('rerun_host', '?')}",
            fontsize=8,
        )
    else:
        times.set_axis_off()
    return fig


def distributed(result: Result) -> Figure:
    fig, (speed, wall, share) = figure("distributed: one training step on 1 and 2 processes", 3, 16)
    tokens = result.get("tokens_per_s", {})
    bars_panel(speed, tokens, "label tokens/s, steps 2..N (median)")
    for i, case in enumerate(tokens):
        points = [s["tokens_per_s"] for s in result.get("samples", []) if s["case"] == case]
        speed.plot([i] * len(points), points, "k.", markersize=4)
    speed.set_title(f"LoRA equal within {result.get('equal_within') or 0:.2g} (1 vs 2 processes)",
                    fontsize=9)  # fmt: skip
    parts = {"start (to rank 0's started)": "startup_s", "step 1 (waits for all)": "first_step_s",
             "steps 2..N": "steady_s", "score and save": "finish_s"}  # fmt: skip
    colours = plt.get_cmap("tab10").colors
    for row, case in enumerate(tokens):
        left = 0.0
        for i, (name, key) in enumerate(parts.items()):
            seconds = float(result[key][case])
            wall.barh(row, seconds, left=left, color=colours[i], label=name if row == 0 else None)
            left += seconds
        wall.text(left, row, f" {left:.1f} s", va="center", fontsize=8)
    wall.set_yticks(range(len(tokens)), list(tokens))
    wall.invert_yaxis()
    wall.set_xlabel("seconds (median per part)")
    wall.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=2)
    wall.set_title("wall time, launch to result (median)", fontsize=9)
    shares = {
        f"{c}\nin training": 100 * v
        for c, v in result.get("allreduce_share_by_case", {}).items()
        if c != "1"
    }
    shares |= {f"{c}\nalone": 100 * v for c, v in result.get("allreduce_alone_share", {}).items()}
    bars_panel(share, shares, "all-reduce share of the training time (%)")  # fmt: skip
    share.set_title(f"on {result.get('floor', {}).get('cores', '?')} shared cores: "
                    "2 ranks share the cores 1 process used", fontsize=9)  # fmt: skip
    return fig


def serve_cut_timeline(ax: Axes, cut: Result) -> None:
    """Each client lane's requests around the cut (x: sent, seconds from the cut), coloured by
    who answered; lines where the gateway saw it, the lanes recovered, the link came back."""
    lanes = cut.get("timeline", {}).get("lanes", [])
    if not lanes:
        ax.set_axis_off()
        return
    styles = {"serve-1": ("o", "#1565c0"), "serve-2": ("o", "#ef6c00"), "no answer": ("x", "black")}
    points: dict[str, tuple[list[float], list[int]]] = {}
    for row, lane in enumerate(lanes):
        for t, status, worker in zip(lane["t_start_s"], lane["status"], lane["worker"],
                                     strict=True):  # fmt: skip
            kind = worker if status == 200 else f"{status or 'no answer'}"
            xs, ys = points.setdefault(kind, ([], []))
            xs.append(t)
            ys.append(row)
    for kind, (xs, ys) in sorted(points.items()):
        marker, colour = styles.get(kind, ("x", MISSED))
        ax.scatter(xs, ys, s=9, marker=marker, color=colour, label=kind)
    link_up, rejoin_s = cut["timeline"].get("link_up_s"), cut.get("rejoin_s")
    marks = [
        ("cut", 0.0),
        ("gateway sees", cut.get("down_s")),
        ("recovered", cut.get("recovery_s")),
        ("link up", link_up),
        ("its share back", None if link_up is None or rejoin_s is None else link_up + rejoin_s),
    ]
    for (name, at), style in zip(marks, ("-", ":", "--", "-.", (0, (1, 4))), strict=True):
        if at is not None:
            ax.axvline(at, color="black", linestyle=style, linewidth=1, label=name)
    labels = [f"{lane['adapter']}{' (cut host)' * lane['held_by_cut_host']}" for lane in lanes]
    ax.set_yticks(range(len(lanes)), labels, fontsize=8)
    ax.set_xlabel("request sent, s from the cut")
    ax.set_title(f"serve cut: {cut.get('failed_requests')} of {cut.get('requests')} failed "
                 f"({cut.get('failed_status')})", fontsize=9)  # fmt: skip
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))


def noisy(result: Result) -> Figure:
    fig, (quiet, aims) = figure("noisy: a loud principal (10x) beside three quiet ones", 2)
    bars_panel(quiet, result.get("quiet_p95_ratio", {}), "worst quiet p95 / its p95 alone")
    quota_error = result.get("quota_error")
    aims_panel(
        aims,
        {
            **result,
            "quiet_p95_fair": result.get("quiet_p95_ratio", {}).get("fair"),
            "quota_error_abs": None if quota_error is None else abs(quota_error),
        },
        [
            Aim("quiet p95 / alone, fair share", "quiet_p95_fair", 1.3, "x"),
            Aim("throughput fair / today", "throughput_ratio_fair", 0.95, "x", True),
            Aim("loud tokens/min off its quota", "quota_error_abs", 5, "%", scale=100),
        ],
    )
    return fig


def rollback(result: Result) -> Figure:
    fig, (times, stages, aims) = figure("rollback: to users, each way a user starts one", 3, 15)
    samples = result.get("samples_s", {})
    cdf_panel(
        times,
        {
            "alias move alone": samples.get("alias", {}).get("move_s", []),
            "mint rollback/promote, to exit": samples.get("cli", {}).get("exit_s", []),
            "UI submit, to served": samples.get("ui", {}).get("served_s", []),
            "pool: UI submit, to served": samples.get("pool", {}).get("served_s", []),
        },
        "s",
    )
    medians = result.get("median_s", {})
    stages_panel(
        stages,
        {
            way: {"start": medians[way]["start_s"], "run": medians[way]["run_s"]}
            for way in ("ui", "pool")
            if way in medians
        },
    )
    aims_panel(
        aims,
        result,
        [
            Aim("mint rollback/promote p50", "cli_p50_s", 3.0, "s"),
            Aim("UI submit to served p50", "ui_served_p50_s", 5.0, "s"),
            Aim("run start p50 (flow server)", "ui_start_p50_s", 2.0, "s"),
            Aim("run start p50 (control pool)", "pool_start_p50_s", 2.0, "s"),
        ],
    )
    return fig


DRAWINGS: dict[str, Callable[[Result], Figure]] = {
    "register": register,
    "admission": admission,
    "sync": sync_paths("sync: adapter path vs merged checkpoint", 18.3, "adapter / merged"),
    "rl_sync": sync_paths("rl_sync: adapter vs full weights, MoE", 2.85, "adapter / full"),
    "batching": batching,
    "catalog": catalog,
    "gateway": gateway,
    "backends": backends,
    "packing": packing,
    "recipe": recipe,
    "rl": rl,
    "tenants": tenants,
    "tiers": tiers,
    "tiers_sim": tiers_sim,
    "cluster": cluster,
    "distributed": distributed,
    "noisy": noisy,
    "rollback": rollback,
}


def draw(name: str, result: Result, png: Path) -> Path | None:
    """Draw benchmark `name`'s picture of `result` to `png`; None for a benchmark without one."""
    drawing = DRAWINGS.get(name)
    if drawing is None:
        return None
    fig = drawing(result)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png


def main(paths: Sequence[str]) -> None:
    for path in map(Path, paths or sorted((Path(__file__).parent / "results").glob("*.json"))):
        # A result's benchmark is its file's name up to any variant (`admission-one-thread`).
        png = draw(
            path.stem.partition("-")[0], json.loads(path.read_text()), path.with_suffix(".png")
        )
        print(f"drew {png}" if png else f"no picture for {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
