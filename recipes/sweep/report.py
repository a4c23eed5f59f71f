"""A sweep's report, from the runs finished so far: ``sweep.md``, ``sweep.csv``, ``sweep_summary.csv``, one plot per
axis and ``SUMMARY.md`` (columns and contents in docs/recipes.md). ``recipes.compare`` writes its comparison with the
same summary and table."""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from recipes import stats
from recipes.report import HISTORY_FILE, METRIC_LABELS, RESULTS_FILE, no_difference_note, read_json
from recipes.sweep.plan import RUN_RECORD, Configuration, SweepPlan, format_label, safe_name
from recipes.tasks import get_task

SWEEP_TABLE, SWEEP_CSV, SUMMARY_CSV, SUMMARY_FILE = "sweep.md", "sweep.csv", "sweep_summary.csv", "SUMMARY.md"
HISTORY_CSV, COMPARISONS_CSV = "sweep_history.csv", "sweep_comparisons.csv"
ALPHA = 0.05  # the family-wise error rate of a corrected family (the intervals stay 95 %)
CURVES_PLOT = "sweep_curves.png"
BASE_LABEL = "(base)"  # an ablation plot's point for the base configuration, where no value of the axis is it


@dataclass
class Row:
    """One configuration's aggregate over the seeds it finished."""

    configuration: Configuration
    values: dict[int, float]  # seed -> primary metric
    params_added: int | None
    runtime: list[float]
    peak_rss_mib: list[float]  # each finished seed's peak memory (all_results.json's peak_memory), where recorded
    at_start: list[float]  # each finished seed's metric at step 0 (runs with eval_at_start)
    evaluations: dict[int, list[dict[str, Any]]]  # seed -> its evaluations (training_history.json), step by step
    last_quarter: list[float]  # each finished seed's change of the metric over the last quarter of its steps
    comparison: Comparison | None = None  # against its baseline, once seeds of both have finished


@dataclass
class Comparison:
    """One configuration against another (its baseline, or a config's ``compare`` pair), seed by seed."""

    configuration: str
    against: str
    difference: stats.PairedDifference
    p_value: float | None  # two-sided paired t-test; None for one seed
    p_adjusted: float | None  # Holm's, over every comparison of the sweep (correction: holm); else None
    verdict: str


@dataclass
class Summary:
    """What the runs finished so far give: every report writer of a sweep (and recipes.compare) reads this."""

    found: dict[str, dict[int, dict[str, Any]]]  # configuration name -> seed -> its all_results.json
    rows: list[Row]  # one per configuration, in the plan's order
    comparisons: list[Comparison]  # every comparison with paired seeds, in plan.comparisons()'s order
    metric: str  # the task's primary metric
    greater_is_better: bool
    metrics: list[str]  # the task's metrics (and eval_loss for a language model): sweep.csv's columns

    @property
    def done(self) -> int:
        """How many runs have finished."""
        return sum(len(results) for results in self.found.values())


def greater_is_better(task, metric: str) -> bool:
    """The direction of ``metric``: the task's for its primary metric; a loss is lower-is-better, others higher."""
    if metric == task.primary_metric:
        return task.greater_is_better
    return "loss" not in metric


def metric_at_start(history: dict[str, Any], metric: str) -> float | None:
    """The metric of the step-0 evaluation (``--eval_at_start``), or None."""
    return next((e[metric] for e in history.get("evaluations", []) if e["step"] == 0 and metric in e), None)


def last_quarter_change(evaluations: list[dict[str, Any]], metric: str) -> float | None:
    """The metric at the last evaluation minus the metric at the last evaluation at or before three quarters of the
    steps (negative: a loss still falling); None where that evaluation is not past half of the steps (a run
    evaluated at its start and end only has no last quarter to tell). The convergence rule of docs/experiments.md
    compares it with the seed spread."""
    points = [(e["step"], e[metric]) for e in evaluations if metric in e]
    if len(points) < 2:
        return None
    last_step, last = points[-1]
    earlier = [(step, value) for step, value in points[:-1] if step <= 0.75 * last_step]
    if not earlier or earlier[-1][0] <= 0.5 * last_step:
        return None
    return last - earlier[-1][1]


def compare_runs(plan: SweepPlan, rows: dict[str, Row], greater: bool) -> list[Comparison]:
    """Every comparison of the plan with at least one paired seed: the paired difference, its p-value and verdict
    (Holm-adjusted over the plan's whole family with ``correction: holm``, once every comparison has a p-value)."""
    found = []
    for name, against in plan.comparisons():
        mine, theirs = rows[name].values, rows[against].values
        paired = [seed for seed in plan.seeds if seed in mine and seed in theirs]
        if paired:
            difference = stats.paired_difference([mine[s] for s in paired], [theirs[s] for s in paired])
            found.append(Comparison(name, against, difference, difference.p_value, None, ""))
    # Holm's family is every comparison the plan makes: corrected only once each has a p-value (a family read
    # while some of it has not run would be corrected for fewer comparisons than it holds).
    if (
        plan.correction == "holm"
        and len(found) == len(plan.comparisons())
        and all(c.p_value is not None for c in found)
    ):
        for comparison, adjusted in zip(found, stats.holm_adjusted([c.p_value for c in found])):
            comparison.p_adjusted = adjusted
    for comparison in found:
        comparison.verdict = stats.verdict(
            comparison.difference, greater, plan.no_difference_below, comparison.p_adjusted, ALPHA
        )
    return found


def collect(plan: SweepPlan) -> dict[str, dict[int, dict[str, Any]]]:
    """The finished runs' ``all_results.json``: configuration name -> seed -> results."""
    found: dict[str, dict[int, dict[str, Any]]] = {}
    for configuration in plan.configurations:
        found[configuration.name] = {}
        for run in configuration.runs:
            path = run.output_dir / RESULTS_FILE
            if path.is_file():
                found[configuration.name][run.seed] = json.loads(path.read_text())
    return found


def summarize(plan: SweepPlan) -> Summary:
    """Read the finished runs and aggregate each configuration over its seeds: the primary metric, the paired
    difference to its baseline and its verdict, the parameters added, the training times."""
    found = collect(plan)
    task = get_task(plan.configurations[-1].runs[0].args.task)
    metric = plan.metric or task.primary_metric
    greater = greater_is_better(task, metric)
    rows = []
    for configuration in plan.configurations:
        results = found[configuration.name]
        values = {seed: float(r[metric]) for seed, r in results.items() if metric in r}
        first = next(iter(results.values()), None)
        params = parameters_added(first) if first else None
        runtime = [float(r.get("train_runtime_s", 0.0)) for r in results.values()]
        memory = [
            r["peak_memory"]["peak_rss_mib"]
            for r in results.values()
            if (r.get("peak_memory") or {}).get("peak_rss_mib")
        ]
        runs = {run.seed: run for run in configuration.runs}
        histories = {seed: read_json(runs[seed].output_dir / HISTORY_FILE) or {} for seed in results}
        starts = [metric_at_start(history, metric) for history in histories.values()]
        at_start = [value for value in starts if value is not None]
        evaluations = {seed: history.get("evaluations", []) for seed, history in histories.items()}
        changes = [last_quarter_change(points, metric) for points in evaluations.values()]
        last_quarter = [change for change in changes if change is not None]
        rows.append(Row(configuration, values, params, runtime, memory, at_start, evaluations, last_quarter))
    by_name = {row.configuration.name: row for row in rows}
    comparisons = compare_runs(plan, by_name, greater)
    for comparison in comparisons:  # each row's own: against its baseline
        row = by_name[comparison.configuration]
        if comparison.against == row.configuration.baseline:
            row.comparison = comparison
    metrics = task.metric_columns()
    return Summary(found, rows, comparisons, metric, greater, metrics)


def parameters_added(results: dict[str, Any]) -> int:
    """What a run added to the model it started from: the patch's parameters, and a wider MLP's
    (``--widen_mlp``; all_results.json's ``parameters``)."""
    counts = results.get("parameters", {})
    return counts.get("added", counts.get("added_by_patch", 0))


def markdown_table(plan: SweepPlan, summary: Summary) -> str:
    """The summary table (sweep.md, SUMMARY.md, recipes.compare's comparison.md): one row per configuration, its
    flags, parameters added, primary metric (mean ± std over seeds), with a baseline the paired difference (95 %
    interval), with ``correction: holm`` its p-value and Holm's, its verdict, the seeds finished, the mean training
    time of a run; then the config's other comparisons (``compare``), as a second table."""
    label = METRIC_LABELS.get(summary.metric, summary.metric)
    several = len(plan.seeds) > 1
    holm = plan.correction == "holm"
    from_start = any(row.at_start for row in summary.rows)
    converging = any(row.last_quarter for row in summary.rows)
    header = ["configuration", "flags", "params added"]
    header += [f"{label} at step 0"] if from_start else []
    header += [f"{label} (mean ± std)" if several else label]
    header += ["change over the last quarter of the steps"] if converging else []
    if plan.baseline:
        header += [f"Δ {label} vs baseline" + (", paired (95 % CI)" if several else "")]
        header += ["p", f"p, Holm ({len(plan.comparisons())} comparisons)"] if holm else []
        header += ["verdict"]
    header += ["seeds", "train time (s)", "peak memory (MiB, mean over seeds)" if several else "peak memory (MiB)"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in summary.rows:
        values = [row.values[s] for s in plan.seeds if s in row.values]
        cells = [f"`{row.configuration.name}`", row.configuration.changes]
        cells.append("—" if row.params_added is None else f"{row.params_added:,}")
        if from_start:
            cells.append(stats.format_mean_std(row.at_start) if row.at_start else "—")
        cells.append(stats.format_mean_std(values) if values else "not run")
        if converging:
            cells.append(stats.format_mean_std(row.last_quarter) if row.last_quarter else "—")
        if plan.baseline:
            comparison = row.comparison
            if row.configuration.kind == "baseline":
                cells += ["—"] * (4 if holm else 2)
            elif comparison is None:
                cells += ["—"] * (3 if holm else 1) + ["no paired seeds yet"]
            else:
                cells.append(stats.format_difference(comparison.difference))
                cells += p_cells(comparison) if holm else []
                cells.append(comparison.verdict)
        cells.append(f"{len(values)}/{len(plan.seeds)}")
        cells.append(stats.format_mean_std(row.runtime, digits=1) if row.runtime else "—")
        cells.append(f"{stats.mean(row.peak_rss_mib):,.0f}" if row.peak_rss_mib else "—")
        lines.append("| " + " | ".join(cells) + " |")
    table = "\n".join(lines) + "\n"
    others = [c for c in summary.comparisons if (c.configuration, c.against) in set(plan.compare)]
    if others:
        header = ["configuration", "against", f"Δ {label}" + (", paired (95 % CI)" if several else "")]
        header += ["p", f"p, Holm ({len(plan.comparisons())} comparisons)"] if holm else []
        lines = ["| " + " | ".join([*header, "verdict", "seeds"]) + " |", "|" + "---|" * (len(header) + 2)]
        for comparison in others:
            cells = [f"`{comparison.configuration}`", f"`{comparison.against}`"]
            cells.append(stats.format_difference(comparison.difference))
            cells += p_cells(comparison) if holm else []
            cells += [comparison.verdict, str(comparison.difference.n)]
            lines.append("| " + " | ".join(cells) + " |")
        table += "\nOther comparisons:\n\n" + "\n".join(lines) + "\n"
    return table


def p_cells(comparison: Comparison) -> list[str]:
    """A comparison's p-value and Holm-adjusted p-value, as table cells."""
    return [format_p(comparison.p_value), format_p(comparison.p_adjusted)]


def format_p(value: float | None) -> str:
    """``0.012``, ``3.1e-05``; — where there is none."""
    if value is None:
        return "—"
    return f"{value:.3f}" if value >= 0.001 else f"{value:.1e}"


def axis_columns(plan: SweepPlan, configuration: Configuration) -> dict[str, str]:
    """The label of each axis for a configuration (empty where it stays at the base)."""
    chosen = {item.axis: item.label for item in configuration.choices}
    return {f"axis:{axis}": chosen.get(axis, "") for axis in plan.axes}


def run_row(plan: SweepPlan, summary: Summary, aggregate: Row, run) -> dict[str, Any]:
    """A run's row of sweep.csv (``aggregate``: its configuration's row): what it is, its status and, finished, its
    results."""
    configuration = aggregate.configuration
    results = summary.found[configuration.name].get(run.seed)
    row = {
        "configuration": configuration.name,
        "kind": configuration.kind,
        "baseline": configuration.baseline or "",
        "seed": run.seed,
        "status": "done" if results else ("interrupted" if (run.output_dir / RUN_RECORD).is_file() else "pending"),
        **axis_columns(plan, configuration),
        "flags": configuration.changes,
        "output_dir": str(run.output_dir),
    }
    if results:
        start = metric_at_start({"evaluations": aggregate.evaluations[run.seed]}, summary.metric)
        row.update({m: results.get(m, "") for m in summary.metrics})
        row.update(
            {f"{summary.metric}_at_start": "" if start is None else start},
            train_loss=results.get("train_loss", ""),
            params_added=parameters_added(results),
            train_steps=results.get("train_steps"),
            train_runtime_s=results.get("train_runtime_s"),
            peak_rss_mib=(results.get("peak_memory") or {}).get("peak_rss_mib", ""),
        )
    return row


def write_csvs(plan: SweepPlan, summary: Summary) -> None:
    """sweep.csv: one row per run and seed; sweep_summary.csv: one row per configuration (columns in
    docs/recipes.md)."""
    rows, metrics = summary.rows, summary.metrics
    fields = ["configuration", "kind", "baseline", "seed", "status", *[f"axis:{a}" for a in plan.axes], "flags"]
    fields += [*metrics, f"{summary.metric}_at_start", "train_loss", "params_added", "train_steps", "train_runtime_s"]
    fields += ["peak_rss_mib", "output_dir"]
    with open(plan.root / SWEEP_CSV, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        for aggregate in rows:
            for run in aggregate.configuration.runs:
                writer.writerow(run_row(plan, summary, aggregate, run))
    summary_fields = ["configuration", "kind", "baseline", *[f"axis:{a}" for a in plan.axes], "flags", "seeds_done"]
    summary_fields += ["metric", "mean", "std", "baseline_mean", "diff_mean", "diff_std", "ci_low", "ci_high"]
    summary_fields += ["relative_diff_percent", "verdict", "params_added", "train_runtime_s_mean"]
    summary_fields += ["peak_rss_mib_mean", "at_start_mean", "last_quarter_change_mean", "p_value", "p_holm"]
    with open(plan.root / SUMMARY_CSV, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=summary_fields)
        writer.writeheader()
        for row in rows:
            values = list(row.values.values())
            difference = row.comparison.difference if row.comparison else None
            writer.writerow(
                {
                    "configuration": row.configuration.name,
                    "kind": row.configuration.kind,
                    "baseline": row.configuration.baseline or "",
                    **axis_columns(plan, row.configuration),
                    "flags": row.configuration.changes,
                    "seeds_done": len(values),
                    "metric": summary.metric,
                    "mean": stats.mean(values) if values else "",
                    "std": stats.sample_std(values) if len(values) > 1 else "",
                    "baseline_mean": difference.baseline_mean if difference else "",
                    "diff_mean": difference.mean if difference else "",
                    "diff_std": difference.std if difference and difference.std is not None else "",
                    "ci_low": difference.ci_low if difference and difference.ci_low is not None else "",
                    "ci_high": difference.ci_high if difference and difference.ci_high is not None else "",
                    "relative_diff_percent": difference.relative
                    if difference and difference.relative is not None
                    else "",
                    "verdict": row.comparison.verdict if row.comparison else "",
                    "params_added": "" if row.params_added is None else row.params_added,
                    "train_runtime_s_mean": stats.mean(row.runtime) if row.runtime else "",
                    "peak_rss_mib_mean": stats.mean(row.peak_rss_mib) if row.peak_rss_mib else "",
                    "at_start_mean": stats.mean(row.at_start) if row.at_start else "",
                    "last_quarter_change_mean": stats.mean(row.last_quarter) if row.last_quarter else "",
                    **p_columns(row.comparison),
                }
            )
    write_comparisons_csv(plan, summary)
    write_history_csv(plan, summary)


def p_columns(comparison: Comparison | None) -> dict[str, Any]:
    """The p_value and p_holm columns of a comparison (empty where there is none)."""
    p_value = comparison.p_value if comparison is not None else None
    p_holm = comparison.p_adjusted if comparison is not None else None
    return {"p_value": "" if p_value is None else p_value, "p_holm": "" if p_holm is None else p_holm}


def write_comparisons_csv(plan: SweepPlan, summary: Summary) -> None:
    """sweep_comparisons.csv: every comparison (each configuration against its baseline, then the config's
    ``compare`` pairs), its paired difference, interval, p-values and verdict."""
    fields = ["configuration", "against", "seeds", "metric", "diff_mean", "diff_std", "ci_low", "ci_high"]
    fields += ["relative_diff_percent", "p_value", "p_holm", "correction", "verdict"]
    with open(plan.root / COMPARISONS_CSV, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        for comparison in summary.comparisons:
            difference = comparison.difference
            writer.writerow(
                {
                    "configuration": comparison.configuration,
                    "against": comparison.against,
                    "seeds": difference.n,
                    "metric": summary.metric,
                    "diff_mean": difference.mean,
                    "diff_std": "" if difference.std is None else difference.std,
                    "ci_low": "" if difference.ci_low is None else difference.ci_low,
                    "ci_high": "" if difference.ci_high is None else difference.ci_high,
                    "relative_diff_percent": "" if difference.relative is None else difference.relative,
                    **p_columns(comparison),
                    "correction": plan.correction,
                    "verdict": comparison.verdict,
                }
            )


def write_history_csv(plan: SweepPlan, summary: Summary) -> None:
    """sweep_history.csv: every evaluation of every finished run (step, wall-clock seconds so far, the task's
    metrics), so that curves and the convergence rule recompute from the committed files."""
    fields = ["configuration", "seed", "step", "elapsed_s", *summary.metrics]
    with open(plan.root / HISTORY_CSV, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        for row in summary.rows:
            for seed in plan.seeds:
                for evaluation in row.evaluations.get(seed, []):
                    writer.writerow(
                        {"configuration": row.configuration.name, "seed": seed, "elapsed_s": "", **evaluation}
                    )


def axis_series(plan: SweepPlan, axis: str) -> list[tuple[str, list[tuple[str, str]]]]:
    """The lines of an axis's plot: (legend, [(value label, configuration name), ...]). Ablation: one line over
    the axis's values; grid: one line per combination of the other axes."""
    series: dict[str, list[tuple[str, str]]] = {}
    for choices, name in plan.cells:
        mine = [item for item in choices if item.axis == axis]
        if not mine or (plan.mode == "ablation" and len(choices) != 1):
            continue
        others = ", ".join(f"{item.axis}={item.label}" for item in choices if item.axis != axis)
        series.setdefault(others, []).append((mine[0].label, name))
    order = {item.label: index for index, item in enumerate(plan.axes[axis])}
    lines = [(legend, sorted(points, key=lambda p: order[p[0]])) for legend, points in series.items()]
    if plan.mode == "ablation" and lines:
        base = next(name for choices, name in plan.cells if not choices)
        if base not in {name for _, name in lines[0][1]}:  # no value of this axis is the base: show it first
            lines[0][1].insert(0, (BASE_LABEL, base))
    return lines


def plot_axis(plan: SweepPlan, axis: str, summary: Summary, path: Path) -> bool:
    """``sweep_<axis>.png``: the primary metric over the axis's values, mean ± std over seeds with each seed as a
    dot; the baseline as a band (mean ± std) where the whole axis shares one, else as grey points. Returns whether
    it drew one (False while no run of the axis has finished)."""
    rows, metric = {row.configuration.name: row for row in summary.rows}, summary.metric
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = axis_series(plan, axis)
    labels = [item.label for item in plan.axes[axis]]
    if any(label == BASE_LABEL for _, points in series for label, _ in points):
        labels.insert(0, BASE_LABEL)
    if not any(rows[name].values for _, points in series for _, name in points):
        return False
    figure, axes = plt.subplots(figsize=(max(5.0, 1.2 * len(labels) + 2), 4.5))
    width = 0.25 / max(1, len(series))
    for index, (legend, points) in enumerate(series):
        offset = (index - (len(series) - 1) / 2) * width
        xs, means, spreads = [], [], []
        for label, name in points:
            values = list(rows[name].values.values())
            if not values:
                continue
            x = labels.index(label) + offset
            xs.append(x)
            means.append(stats.mean(values))
            spreads.append(stats.sample_std(values) or 0.0)
            axes.scatter([x] * len(values), values, s=12, alpha=0.4, color="black", zorder=3)
        if xs:
            axes.errorbar(xs, means, yerr=spreads, marker="o", capsize=4, label=legend or "mean ± std over seeds")
    baselines = {rows[name].configuration.baseline for _, points in series for _, name in points} - {None}
    if len(baselines) == 1:
        values = list(rows[baselines.pop()].values.values())
        if values:
            centre, spread = stats.mean(values), stats.sample_std(values) or 0.0
            axes.axhline(centre, color="grey", linestyle="--", label="baseline (mean ± std)")
            if spread:
                axes.axhspan(centre - spread, centre + spread, color="grey", alpha=0.2)
    elif baselines:
        for label, name in series[0][1]:
            base = rows[name].configuration.baseline
            values = list(rows[base].values.values()) if base else []
            if values:
                axes.errorbar(
                    [labels.index(label)],
                    [stats.mean(values)],
                    yerr=[stats.sample_std(values) or 0.0],
                    marker="s",
                    color="grey",
                    capsize=4,
                    label="baseline (mean ± std)" if label == series[0][1][0][0] else None,
                )
    axes.set_xticks(range(len(labels)), labels)
    axes.set(
        xlabel=axis,
        ylabel=METRIC_LABELS.get(metric, metric),
        title=f"{axis}: {METRIC_LABELS.get(metric, metric)}, {len(plan.seeds)} seed(s), {plan.grid} grid",
    )
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return True


def mean_curve(histories: list[dict[str, Any]], metric: str) -> list[tuple[int, float, float | None]]:
    """(step, mean metric, mean elapsed seconds or None) over the seeds' evaluations, at the steps all of them
    evaluated."""
    per_seed = [{e["step"]: e for e in h.get("evaluations", []) if metric in e} for h in histories]
    steps = sorted(set.intersection(*(set(points) for points in per_seed))) if per_seed else []
    curve = []
    for step in steps:
        points = [points[step] for points in per_seed]
        elapsed = [p["elapsed_s"] for p in points if "elapsed_s" in p]
        curve.append(
            (
                step,
                stats.mean([p[metric] for p in points]),
                stats.mean(elapsed) if len(elapsed) == len(points) else None,
            )
        )
    return curve


def plot_curves(plan: SweepPlan, summary: Summary, path: Path) -> bool:
    """``sweep_curves.png``: each configuration's metric against optimizer steps and against wall-clock time (the
    mean over its finished seeds at each evaluation; the time counts earlier evaluations). False while no run has
    finished."""
    curves = {}
    for configuration in plan.configurations:
        finished = summary.found[configuration.name]
        histories = [
            read_json(run.output_dir / HISTORY_FILE) or {} for run in configuration.runs if run.seed in finished
        ]
        curve = mean_curve([h for h in histories if h], summary.metric)
        if curve:
            curves[configuration.name] = (curve, len(histories))
    if not curves:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    label = METRIC_LABELS.get(summary.metric, summary.metric)
    figure, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4.5), sharey=True)
    for name, (curve, seeds) in curves.items():
        steps, values, elapsed = zip(*curve)
        (line,) = by_step.plot(steps, values, marker="o", markersize=3, label=f"{name} ({seeds} seed(s))")
        timed = [(t, v) for t, v in zip(elapsed, values) if t is not None]
        if timed:
            by_time.plot(*zip(*timed), marker="o", markersize=3, color=line.get_color())
    # The first evaluation of a run from scratch (chance level) would flatten the rest: the axis starts at the second
    # evaluation unless the first is close to the others (a fine-tune's, where step 0 shows the function kept).
    low = min(v for curve, _ in curves.values() for _, v, _ in curve)
    top = max(curve[min(1, len(curve) - 1)][1] for curve, _ in curves.values())
    first = max(curve[0][1] for curve, _ in curves.values())
    top = first if first - low <= 2 * (top - low) else top
    if top > low:
        by_step.set_ylim(low - 0.05 * (top - low), top + 0.05 * (top - low))
    by_step.set(xlabel="optimizer step", ylabel=label, title=f"{label} against steps")
    by_time.set(xlabel="wall-clock seconds (evaluations included)", title=f"{label} against time")
    for axes in (by_step, by_time):
        axes.grid(alpha=0.3)
    by_step.legend(fontsize=8)
    figure.suptitle(f"Sweep {plan.name}: mean over seeds")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return True


def write_report(plan: SweepPlan) -> dict[str, Path]:
    """sweep.md, sweep.csv, sweep_summary.csv, sweep_<axis>.png and SUMMARY.md from the runs finished so far;
    returns what it wrote (name -> path)."""
    summary = summarize(plan)
    metric = summary.metric
    plan.root.mkdir(parents=True, exist_ok=True)
    written = {}
    plots = []
    for axis in plan.axes:
        path = plan.root / f"sweep_{safe_name(axis)}.png"
        if plot_axis(plan, axis, summary, path):
            plots.append((axis, path.name))
            written[f"plot:{axis}"] = path
    if plot_curves(plan, summary, plan.root / CURVES_PLOT):
        plots.append(("curves", CURVES_PLOT))
        written["plot:curves"] = plan.root / CURVES_PLOT
    table = markdown_table(plan, summary)
    total = len(plan.configurations) * len(plan.seeds)
    notes = sweep_notes(plan)
    pictures = "".join(f"![{axis}]({name})\n\n" for axis, name in plots)
    heading = f"# Sweep {plan.name} ({plan.grid} grid)\n\n"
    summary_line = (
        f"{plan.mode.capitalize()} over {', '.join(plan.axes) or 'no axis'}; {len(plan.seeds)} seed(s) "
        f"({', '.join(map(str, plan.seeds))}); primary metric {METRIC_LABELS.get(metric, metric)} "
        f"({'higher' if summary.greater_is_better else 'lower'} is better); {summary.done}/{total} runs finished.\n\n"
    )
    (plan.root / SWEEP_TABLE).write_text(heading + summary_line + table + "\n" + notes + "\n" + pictures)
    written["table"] = plan.root / SWEEP_TABLE
    write_csvs(plan, summary)
    written["csv"], written["summary_csv"] = plan.root / SWEEP_CSV, plan.root / SUMMARY_CSV
    written["comparisons_csv"], written["history_csv"] = plan.root / COMPARISONS_CSV, plan.root / HISTORY_CSV
    (plan.root / SUMMARY_FILE).write_text(summary_card(plan, summary, table, notes, pictures))
    written["summary"] = plan.root / SUMMARY_FILE
    return written


def sweep_notes(plan: SweepPlan) -> str:
    """What the table's ±, Δ, interval, verdict and training time mean, for the plan's number of seeds."""
    if len(plan.seeds) < 2 and plan.no_difference_below is not None:
        spread = no_difference_note(plan.no_difference_below)
    elif len(plan.seeds) < 2:
        spread = (
            "One seed gives no error bar: a difference of about the size of the seed noise (docs/recipes.md has the "
            "offline demo's) cannot be told from it. Set seeds: 2 or more."
        )
    else:
        interval = (
            "Δ is the configuration minus its baseline seed by seed (the same seed gives both the same data "
            f"order and initial weights), with a 95 % Student-t interval ({len(plan.seeds) - 1} degree"
            f"{'s' if len(plan.seeds) != 2 else ''} of freedom)"
        )
        if not plan.baseline:
            reading = "No baseline was run (baseline: false), so there are no paired differences."
        elif plan.correction == "holm":
            reading = (
                f"{interval}, uncorrected. p is the paired t-test's two-sided p-value; every comparison of the "
                "report (each row against its baseline, and the other comparisons) is one family, and the verdict "
                "calls a difference larger than the seed noise only where Holm's adjusted p is below 0.05, so the "
                "chance of any false call in the family is at most 5 %."
            )
        else:
            reading = (
                f"{interval}; it is called larger than the seed noise only when the interval excludes 0. With many "
                "configurations, about one in twenty intervals excludes 0 by chance."
            )
        spread = f"± is the sample standard deviation over the {len(plan.seeds)} seeds. {reading}"
    controls = (
        " A control is unpatched and compared with the base's baseline: what it changes (more steps, a wider "
        "model) is what it measures."
        if any(c.kind == "control" for c in plan.configurations)
        else ""
    )
    return (
        f"{spread}{controls} The change over the last quarter: the metric at the last evaluation minus at the last one "
        "at or before three quarters of the steps (mean ± std over seeds; where the runs evaluate along the way): "
        "still improving, or converged. Train time: the mean training time of one run, evaluations included. Peak "
        "memory: the mean over seeds of the process's peak resident memory during training (Python and torch "
        "included).\n"
    )


def what_was_run(found: dict[str, dict[int, dict[str, Any]]]) -> tuple[str, str, str]:
    """SUMMARY.md's data, model and budget, in words, from the first finished run (every run shares them)."""
    first = next((r for results in found.values() for r in results.values()), None)
    if not first:
        return ("no run has finished yet",) * 3
    data = first["data"]
    data_text = f"{data['dataset_name']}" + (f" ({data['dataset_config']})" if data.get("dataset_config") else "")
    data_text += f", evaluated on `{data.get('eval_split')}`; {first.get('train_samples')} training examples"
    if first.get("block_size"):
        data_text += f" of {first['block_size']} tokens"
    unpatched = first["parameters"]["total"] - parameters_added(first)
    model_text = (
        f"{first['model_class']} from {first['model_source']}, "
        f"{'trained from scratch' if first.get('from_scratch') else 'fine-tuned'}; {unpatched:,} parameters "
        "without the patch (each configuration's additions are in the table)"
    )
    budget = (
        f"{first['train_steps']} optimizer steps of {first['total_train_batch_size']} examples per run "
        f"({first['num_processes']} process(es))"
    )
    return data_text, model_text, budget


def summary_card(plan: SweepPlan, summary: Summary, table: str, notes: str, pictures: str) -> str:
    """SUMMARY.md, in the style of a model card: what was run on what, the table, and the caveats."""
    found, done, total = summary.found, summary.done, len(plan.configurations) * len(plan.seeds)
    data_text, model_text, budget = what_was_run(found)
    runtime = sum(float(r.get("train_runtime_s", 0.0)) for results in found.values() for r in results.values())
    command = ["python -m recipes.sweep --config", str(plan.config_path)]
    command += (["--grid reduced"] if plan.grid == "reduced" else []) + list(plan.command_line)
    axes_lines = "".join(
        f"  * `{axis}`: {', '.join(item.label for item in items)}\n" for axis, items in plan.axes.items()
    )
    base_rows = "".join(f"| {key} | {format_label(value)} |\n" for key, value in sorted(plan.base_flags.items()))
    how = "one axis at a time from the base configuration" if plan.mode == "ablation" else "every combination"
    count = sum(c.kind == "configuration" for c in plan.configurations)
    with_baseline = ", each with its unpatched baseline (`--scorer none`, same seeds)" if plan.baseline else ""
    if len(plan.seeds) < 2:
        noise = "one seed, so no error bars"
    else:
        noise = (
            f"{len(plan.seeds)} seeds; intervals from few seeds are wide, and a difference within the seed noise is "
            "no evidence either way"
        )
    return f"""# Sweep `{plan.name}` ({plan.grid} grid)

{plan.description or "A sweep of recipe runs."}

## What was run

* mode: **{plan.mode}** ({how}): {count} configurations{with_baseline}
* axes:
{axes_lines.rstrip() or "  * none (the base configuration only)"}
* seeds: {", ".join(map(str, plan.seeds))}
* runs finished: {done} of {total}; their training time in total {runtime / 60:.1f} min

## Data

{data_text}.

## Model

{model_text}.

## Budget

{budget}. The flags every run shares (then each configuration's own, in the table):

| flag | value |
|---|---|
{base_rows}
## Results

{table}
{notes}
{pictures}## Caveats

* Small scale: {budget}, on small models. These runs check the pipeline and show the size of effects at this
  scale; they are not the papers' setups.
* Seed noise: {noise}.
* Unfinished runs are left out of the means (the seeds column says how many each has).

## Reproduce

```bash
{" ".join(command)}
```

Rerunning it skips the finished runs and resumes interrupted ones; `--report_only` rewrites this report.
"""
