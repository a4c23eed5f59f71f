"""What a run leaves behind: ``all_results.json``, the model card (README.md), the training plot, and the Hub
upload; and the evaluation curves of several runs (``recipes.compare``'s plot). The card asks the run's task
(``recipes.tasks``) for its Hub names, its label and its own rows."""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import hf_neural_attn
from hf_neural_attn.scorers import SCORERS
from recipes import qlora
from recipes.patch_flags import BASELINE
from recipes.tasks import Task, get_task

logger = logging.getLogger(__name__)

RESULTS_FILE = "all_results.json"
HISTORY_FILE = "training_history.json"
PLOT_FILE = "training_curves.png"
CARD_FILE = "README.md"
THIS_FOLDER = "path/to/this/folder"  # the loading code's source in a card of a local folder
EXPORT_FOLDER = "path/to/the/export"  # ... in a checkpoint's card: the folder recipes.export writes
# Folders and files of a run that are not part of the model repository.
HUB_IGNORE_PATTERNS = ["step_*", "epoch_*", ".*", "runs/*", "finetune/*", "*.partial/*"]

METRIC_LABELS = {
    "perplexity": "perplexity",
    "eval_loss": "eval loss",
    "accuracy": "accuracy",
    "accuracy_mm": "accuracy (mismatched)",
    "f1": "F1",
    "matthews_correlation": "Matthews correlation",
    "pearson": "Pearson",
    "spearmanr": "Spearman",
    "combined_score": "combined score",
}
# The y axes of the plots (readable_y_axis): a perplexity axis is logarithmic where the curves span this factor or more
# (a run from scratch starts near the vocabulary size's perplexity), else linear. A logarithmic axis ends and is
# labelled at round values m x 10^k, m from LOG_LABEL_MANTISSAS, placed in this order (1, 2 and 5 first) where they
# keep LABEL_GAP label heights from the labels placed before them.
LOG_AXIS_FROM = 10.0
LOG_LABEL_MANTISSAS = (1, 2, 5, 3, 1.5, 4, 7, 1.2, 2.5, 6, 8, 9)
LABEL_GAP = 1.8
# The run settings the model card's training table shows (where they are set).
CARD_TRAINING_SETTINGS = (
    "learning_rate",
    "scorer_learning_rate",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "weight_decay",
    "lr_scheduler_type",
    "num_warmup_steps",
    "seed",
)


def read_json(path: Path) -> dict[str, Any] | None:
    """A run's JSON output, or None where it is not there (a process that does not share the main one's disk)."""
    return json.loads(path.read_text()) if path.is_file() else None


def write_json(path: str | os.PathLike, values: dict[str, Any]) -> None:
    with open(path, "w") as handle:
        json.dump(values, handle, indent=2, default=str)
        handle.write("\n")


def format_value(value: Any) -> str:
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return str(value)
        return f"{value:.4f}" if abs(value) < 1000 else f"{value:.1f}"
    return str(value)


# ------------------------------------------------------------------------------------------------ plot


def plot_training(history: dict[str, Any], metric: str, path: str | os.PathLike, title: str) -> None:
    """Training loss and the evaluation metric over optimizer steps, one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (loss_axis, metric_axis) = plt.subplots(1, 2, figsize=(10, 4), layout="constrained")
    losses = history.get("train_loss", [])
    if losses:
        loss_axis.plot([s for s, _ in losses], [v for _, v in losses], color="tab:blue", linewidth=1.2)
    loss_axis.set(title="training loss", xlabel="step", ylabel="loss")
    readable_y_axis(loss_axis, [v for _, v in losses], log=False)
    points = [(e["step"], e[metric]) for e in history.get("evaluations", []) if metric in e]
    heading = f"evaluation {METRIC_LABELS.get(metric, metric)}"
    if points:
        metric_axis.plot(*zip(*points), marker="o", color="tab:orange")
        heading += f" ({last_value(points)})"
    metric_axis.set(title=heading, xlabel="step", ylabel=metric)
    # Perplexity spans orders of magnitude early in training.
    readable_y_axis(metric_axis, [v for _, v in points], log=metric == "perplexity")
    for axis in (loss_axis, metric_axis):
        axis.grid(alpha=0.3)
    figure.suptitle(title)
    figure.savefig(path, dpi=100)
    plt.close(figure)


def last_value(points: list[tuple[int, float]]) -> str:
    """The last point of a curve in words, for a legend or title: ``14.07 at step 240``."""
    step, value = points[-1]
    return f"{value:.4g} at step {step}"


def readable_y_axis(axis, values: list[float], log: bool) -> None:
    """Fit ``axis``'s y range to ``values`` (every value drawn on it) and label it so that the labels span them.

    The axis ends at round values just beyond the lowest and the highest value, both labelled, so the curves' whole
    range, their last values included, lies between labels. ``log``: logarithmic where the values span
    ``LOG_AXIS_FROM`` times or more (else linear, which reads better over a narrow range). Labels stay ``LABEL_GAP``
    label heights apart."""
    import matplotlib
    from matplotlib.font_manager import FontProperties
    from matplotlib.ticker import FixedLocator, FuncFormatter, MaxNLocator, NullFormatter

    finite = [float(v) for v in values if math.isfinite(v) and (v > 0 or not log)]
    if not finite:
        return
    low, high = min(finite), max(finite)
    label_points = FontProperties(size=matplotlib.rcParams["ytick.labelsize"]).get_size_in_points()
    labels_that_fit = axis.get_window_extent().height / (LABEL_GAP * label_points * axis.figure.dpi / 72)
    if log and high >= LOG_AXIS_FROM * low:
        axis.set_yscale("log")
        ticks = _log_ticks(low, high, labels_that_fit)
        axis.yaxis.set_minor_formatter(NullFormatter())  # the minor ticks are the grid's
    else:
        pad = 0.03 * (high - low) or 0.05 * abs(high) or 0.5
        locator = MaxNLocator(nbins=max(2, min(8, int(labels_that_fit) - 1)), steps=[1, 2, 2.5, 5, 10])
        ticks = sorted(locator.tick_values(low - pad, high + pad))  # from at or below low - pad to at or above high
    axis.set_ylim(ticks[0], ticks[-1])
    axis.yaxis.set_major_locator(FixedLocator(ticks))
    axis.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:.10g}"))


def _log_ticks(low: float, high: float, labels_that_fit: float) -> list[float]:
    """The labelled values of a logarithmic axis over ``low``..``high``: its ends, round values just beyond them,
    then the values m x 10^k in ``LOG_LABEL_MANTISSAS``'s order where they keep a label's room from those placed."""
    margin = 10 ** (0.02 * math.log10(high / low))
    bottom, top = _round_value(low / margin, up=False), _round_value(high * margin, up=True)
    room = math.log10(top / bottom) / labels_that_fit  # a label's room, in decades
    ticks = [bottom, top]
    for mantissa in LOG_LABEL_MANTISSAS:
        for exponent in range(math.floor(math.log10(bottom)), math.ceil(math.log10(top)) + 1):
            value = float(f"{mantissa}e{exponent}")
            if bottom < value < top and all(abs(math.log10(value / tick)) >= room for tick in ticks):
                ticks.append(value)
    return sorted(ticks)


def _round_value(value: float, up: bool) -> float:
    """The nearest m x 10^k (m in ``LOG_LABEL_MANTISSAS``, or 10) at or above (``up``) or at or below ``value`` > 0."""
    exponent = math.floor(math.log10(value))
    scaled = value / 10**exponent
    mantissas = [*LOG_LABEL_MANTISSAS, 10]
    if up:
        chosen = min(m for m in mantissas if m >= scaled * (1 - 1e-9))
    else:
        chosen = max(m for m in mantissas if m <= scaled * (1 + 1e-9))
    return float(f"{chosen}e{exponent}")


def plot_evaluation_curves(
    histories: dict[str, list[dict[str, Any] | None]], metric: str, path: str | os.PathLike, title: str
) -> None:
    """The evaluation curves of several runs in one plot: run label -> its training histories, one per seed (None
    for a seed not finished). A run of several seeds is drawn as the mean over them with a band from the lowest to
    the highest seed, at the steps every seed evaluated. The legend gives each curve's last value."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4.5), layout="constrained")
    banded, drawn = False, []
    for label, runs in histories.items():
        curves = [{e["step"]: e[metric] for e in h["evaluations"] if metric in e} for h in runs if h is not None]
        steps = sorted(set.intersection(*(set(curve) for curve in curves))) if curves else []
        if not steps:
            continue
        values = [[curve[step] for curve in curves] for step in steps]
        means = [sum(v) / len(v) for v in values]
        legend = label if len(curves) == 1 else f"{label} (mean of {len(curves)} seeds)"
        (line,) = axis.plot(steps, means, marker="o", label=f"{legend}: {last_value(list(zip(steps, means)))}")
        drawn += means
        if len(curves) > 1:
            lowest, highest = [min(v) for v in values], [max(v) for v in values]
            axis.fill_between(steps, lowest, highest, color=line.get_color(), alpha=0.2)
            banded, drawn = True, drawn + lowest + highest
    axis.set(
        title=title + (" (band: min–max over seeds)" if banded else ""),
        xlabel="step",
        ylabel=METRIC_LABELS.get(metric, metric),
    )
    readable_y_axis(axis, drawn, log=metric == "perplexity")  # perplexity spans orders of magnitude early on
    axis.grid(alpha=0.3, which="both")
    axis.legend()
    figure.savefig(path, dpi=100)
    plt.close(figure)


# ------------------------------------------------------------------------------------------ comparison


def no_difference_note(no_difference_below: float) -> str:
    """What "no difference" means in a one-seed comparison (``recipes.compare --no_difference_below``)."""
    return (
        f'Changes smaller than {no_difference_below:g}% of the baseline\'s value read "no difference": one run per '
        "model cannot tell them from seed noise (a different seed, or only a different floating-point summation "
        "order, moves a result by about that much). Set the threshold with --no_difference_below, ideally to the "
        "spread of a few baseline runs with different seeds. One seed gives no error bar: --seeds N (N >= 2) "
        "repeats both runs over N seeds and reports mean ± std and a confidence interval of the difference."
    )


def describe_gate_schedule(schedule: str | None, warmup_steps: int | None) -> str:
    """``--gate_schedule`` in words, for logs and the model card."""
    if schedule == "fixed":
        return "fixed (held at its initial value, never learned)"
    if schedule == "warmup":
        return f"warmup (held at min(1, step/{warmup_steps}) for {warmup_steps} steps, then learned from 1)"
    return "learned"


def as_patch_record(patch: hf_neural_attn.PatchRecord | Mapping[str, Any] | None) -> hf_neural_attn.PatchRecord | None:
    """A run's patch as a record: ``all_results.json`` holds it as the mapping ``PatchRecord.to_dict`` writes."""
    if patch is None or isinstance(patch, hf_neural_attn.PatchRecord):
        return patch
    return hf_neural_attn.PatchRecord.from_dict(patch, source="the run's all_results.json", filename="patch")


def describe_patch(patch: hf_neural_attn.PatchRecord | Mapping[str, Any] | None) -> str:
    """A patch in one line, for titles and logs: ``qana, h=4, layers=[0, 1]``; the options named are those the
    scorer's config names itself by (``summary_options``)."""
    record = as_patch_record(patch)
    if record is None:
        return "none (baseline)"
    summary = SCORERS[record.scorer].config_class.summary_options
    parts = [record.scorer, *(f"{label}={record.options.get(option)}" for option, label in summary)]
    parts.append(f"layers={list(record.layers)}")
    return ", ".join(parts)


# ------------------------------------------------------------------------------------------ model card


def model_card(results: dict[str, Any], output_dir: str | os.PathLike) -> str:
    """The model card (README.md) in the Hub's format: YAML metadata with a model-index, then the text. Everything
    comes from ``results`` (what all_results.json holds) and the run's task."""
    from huggingface_hub import ModelCard, ModelCardData

    settings, data = results["settings"], results["data"]
    task = get_task(settings["task"])
    patch = as_patch_record(results.get("patch"))
    metric_names = [m for m in results["metric_names"] if isinstance(results.get(m), (int, float))]
    index_metrics = [m for m in metric_names if m != "eval_loss"]  # the task's metrics, for the model-index
    # A patched run is a full patched checkpoint: transformers' Auto classes load it (with the library imported, or
    # trust_remote_code=True through its loader file), so library_name says transformers, as for any remote-code
    # checkpoint, and the tags name the library, the scorer and custom_code (docs/api.md). A baseline is plain.
    # A LoRA run's folder is PEFT's adapter: PEFT loads it, onto the base (patched, and quantized as in training).
    kind = results["task_kind"]
    lora = qlora.describe_lora(settings)
    # The library's tags for a patched checkpoint; a LoRA run's adapter folder holds no loader file of its own, so
    # only the library's name and the scorer's, as on the library's own adapter cards.
    if patch is None:
        tags = [kind, "baseline"]
    else:
        library_tags = hf_neural_attn.checkpoint_tags(patch.scorer)
        patch_tags = [hf_neural_attn.LIBRARY_NAME, patch.scorer] if lora else library_tags
        tags = [*patch_tags, kind, "nonlinear-attention"]
    tags += qlora.hub_tags(settings)
    card_data = ModelCardData(
        base_model=results.get("base_model"),
        datasets=[data["dataset_name"]] if data["hub_dataset"] else None,
        library_name="peft" if lora else "transformers",
        metrics=index_metrics,
        model_name=Path(output_dir).resolve().name if not settings.get("hub_model_id") else settings["hub_model_id"],
        pipeline_tag=results["pipeline_tag"],
        tags=tags,
        eval_results=_eval_results(results, task, index_metrics) or None,
    )
    metric_rows = "| metric | value |\n|---|---|\n" + "".join(
        f"| {METRIC_LABELS.get(m, m)} (`{m}`) | {format_value(results[m])} |\n" for m in metric_names
    )
    origin = (
        f"trained from scratch ({results.get('model_source')})"
        if results.get("from_scratch")
        else f"fine-tuned from **{results.get('base_model') or results.get('model_source')}**"
    )
    change = (
        f"with its attention scoring replaced by `hf_neural_attn` ({describe_patch(patch)})"
        if patch
        else ("as an unpatched baseline (attention unchanged) for `hf_neural_attn` comparisons")
    )
    change += _how_adapted(settings)
    title = f"{results['model_class']} with {describe_patch(patch)} — {task.dataset_label}"
    content = f"""---
{card_data.to_yaml()}
---

# {title}

This model was {origin} {change}, with the `recipes/finetune.py` recipe.

## Attention patch

{_patch_rows(results, patch)}
## Data

{_data_text(data)}

## Results

{metric_rows}
## Training

{_training_rows(results, task)}
![training curves]({PLOT_FILE})
{harness_section(results.get("lm_eval"))}{scorer_section(results.get("plots"))}
## How to load

{_loading_snippet(results, task, patch)}"""
    # Round-trip through ModelCard so the metadata is validated the way the Hub validates it.
    return str(ModelCard(content))


def _how_adapted(settings: dict[str, Any]) -> str:
    """The card's words for LoRA adapters and a quantized base, where the run had them (else nothing)."""
    adapted = [
        f"{label} ({text})"
        for label, text in (
            ("LoRA adapters", qlora.describe_lora(settings)),
            ("the base quantized", qlora.describe_quantization(settings)),
        )
        if text
    ]
    return ", through " + " on ".join(adapted) if adapted else ""


def _eval_results(results: dict[str, Any], task: Task, metrics: list[str]) -> list:
    """The model-index entries of the task's finite metrics, under the task's Hub type and name."""
    from huggingface_hub import EvalResult

    data = results["data"]
    entries = []
    for name in metrics:
        if not math.isfinite(float(results[name])):
            continue
        mismatched = name.endswith("_mm")  # MNLI's mismatched accuracy: its own split
        entries.append(
            EvalResult(
                task_type=task.pipeline_tag,
                task_name=task.hub_task_name,
                dataset_type=data["dataset_name"] if data["hub_dataset"] else "local",
                dataset_name=data["dataset_name"]
                + (f" ({data['dataset_config']})" if data.get("dataset_config") else ""),
                dataset_config=data.get("dataset_config"),
                dataset_split="validation_mismatched" if mismatched else data.get("eval_split"),
                metric_type=name[: -len("_mm")] if mismatched else name,
                metric_name=METRIC_LABELS.get(name, name),
                metric_value=float(results[name]),
            )
        )
    return entries


def _loading_snippet(
    results: dict[str, Any], task: Task, patch: hf_neural_attn.PatchRecord | None, repo: str | None = None
) -> str:
    """The card's "How to load": the model (with the library where it is patched) and its preprocessor, from ``repo``
    (default: the run's Hub repo, else this folder)."""
    repo = repo or results["settings"].get("hub_model_id") or THIS_FOLDER
    processor_class, processor_name = task.preprocessor_class, task.preprocessor_noun
    if qlora.describe_lora(results["settings"]):
        return _adapter_loading_snippet(results, task, patch, repo)
    if patch:
        imports = f"import hf_neural_attn\nfrom transformers import {processor_class}"
        model_line = f'model = hf_neural_attn.from_pretrained("{repo}")  # {results["model_class"]}, patch re-applied'
        install = f"```bash\npip install {hf_neural_attn.LIBRARY_NAME}\n```\n\n"
    else:
        imports = f"from transformers import {processor_class}, {results['model_class']}"
        model_line = f'model = {results["model_class"]}.from_pretrained("{repo}")  # baseline: no patch'
        install = ""
    return (
        f"{install}```python\n{imports}\n\n{model_line}\n"
        f'{processor_name} = {processor_class}.from_pretrained("{repo}")\n```\n'
    )


def _adapter_loading_snippet(
    results: dict[str, Any], task: Task, patch: hf_neural_attn.PatchRecord | None, repo: str
) -> str:
    """How to load a LoRA run's adapter: the base as the run loaded it (quantized the same way), patched as the run
    patched it, then PEFT's adapter (the LoRA matrices and the trained scorers) onto it."""
    settings = results["settings"]
    base = settings.get("model_name_or_path")
    imports, transformers_names, quantization = qlora.quantization_snippet(settings)
    keywords = f", quantization_config={quantization}" if quantization else ""
    model_class = results["model_class"]
    names = ", ".join(dict.fromkeys([task.preprocessor_class, model_class, *transformers_names]))
    lines = [*imports, "import hf_neural_attn", "from peft import PeftModel", f"from transformers import {names}", ""]
    if patch and settings.get("scorer") == BASELINE:  # the run fine-tuned a patched checkpoint: it loads patched
        lines.append(f'base = hf_neural_attn.from_pretrained("{base}"{keywords})')
    else:
        lines.append(f'base = {model_class}.from_pretrained("{base}"{keywords})')
        lines += qlora.kernel_snippet(settings, "base")
        if patch:
            options = "".join(f", {key}={value!r}" for key, value in patch.options.items())
            lines.append(f'hf_neural_attn.patch_model(base, "{patch.scorer}", layers={list(patch.layers)}{options})')
    lines.append(f'model = PeftModel.from_pretrained(base, "{repo}")  # LoRA and the trained scorers')
    lines.append(f'{task.preprocessor_noun} = {task.preprocessor_class}.from_pretrained("{repo}")')
    code = "\n".join(lines)
    return f"```bash\npip install {hf_neural_attn.LIBRARY_NAME} peft\n```\n\n```python\n{code}\n```\n"


def checkpoint_card(
    settings: dict[str, Any], model_class: str, patch: hf_neural_attn.PatchRecord | None, step: str, exported: bool
) -> str:
    """The README.md of a run's training-state checkpoint ``step`` (``step_N``, ``epoch_N``): what it is, how to export
    its model and how to load that; or, ``exported``, of the folder ``python -m recipes.export`` made of it.
    ``settings``: the run's, as its ``trainer_state.json`` records them; ``model_class``: the transformers class."""
    run_settings = {**settings, "model_name_or_path": settings.get("model"), "hub_model_id": None}
    where = THIS_FOLDER if exported else EXPORT_FOLDER
    loading = _loading_snippet(
        {"settings": run_settings, "model_class": model_class}, get_task(settings["task"]), patch, where
    )
    what = export_kind(settings, patch)
    if exported:
        return (
            f"# {model_class} at {step} of a recipes run\n\n`python -m recipes.export` wrote this folder from the run's "
            f"training-state checkpoint `{step}`: {what}.\n\n## How to load\n\n{loading}"
        )
    quantized = ""
    if settings.get("torchao"):  # qlora.set_aside_torchao_weights
        quantized = f" (the base's torchao weights apart, in torchao's safetensors layout: `{qlora.TORCHAO_WEIGHTS}`)"
    elif qlora.describe_quantization(settings):
        quantized = ", with the quantization states of the base's weights beside them,"
    return f"""# Training state at {step} of a recipes run

This folder is a **training-state checkpoint**, not a model checkpoint: Accelerate's `save_state` wrote the model's
weights in the training backend's own layout{quantized} and the optimizer, scheduler and random states;
`trainer_state.json` holds the run's progress and settings. `--resume_from_checkpoint` resumes the run from it.
`model_files/` holds the model's config and preprocessor. Neither folder loads with `from_pretrained`.

## How to export its model

```bash
python -m recipes.export path/to/{step} {EXPORT_FOLDER}
```

writes {what}.

## How to load the export

{loading}"""


def export_kind(settings: dict[str, Any], patch: hf_neural_attn.PatchRecord | None) -> str:
    """What ``python -m recipes.export`` makes of a checkpoint of a run with ``settings``, in words: the kind of folder
    the run's final output is."""
    if qlora.describe_lora(settings):
        return (
            "PEFT's adapter (`adapter_config.json`, `adapter_model.safetensors`): the LoRA matrices and the modules "
            "trained in full (the scorers, a new head), without the base's weights, as the run's final output is"
        )
    quantization = qlora.describe_quantization(settings)
    kind = "a full patched checkpoint" if patch else "a full transformers checkpoint"
    if quantization:
        return f"{kind} whose base weights stay quantized ({quantization}), as the run's final output is"
    return kind


def _patch_rows(results: dict[str, Any], patch: hf_neural_attn.PatchRecord | None) -> str:
    """The card's patch table: scorer, layers, every option, the new parameters, the gate schedule."""
    settings = results["settings"]
    rows = "| setting | value |\n|---|---|\n"
    if not patch:
        return rows + "| scorer | none (unpatched baseline) |\n" + _trained_rows(settings)
    rows += f"| scorer | `{patch.scorer}` |\n| layers | {list(patch.layers)} |\n"
    for key, value in patch.options.items():
        rows += f"| {key} | {value} |\n"
    rows += f"| new parameters | {results['parameters']['added_by_patch']:,} |\n"
    if settings.get("gate_schedule") not in (None, "learned"):
        schedule = describe_gate_schedule(settings["gate_schedule"], settings.get("gate_warmup_steps"))
        rows += f"| gate α schedule | {schedule} |\n"
    return rows + _trained_rows(settings)


def _trained_rows(settings: dict[str, Any]) -> str:
    """The card's rows on the base's weights (quantized or not) and on what trained (all, the new parameters, LoRA)."""
    quantization, lora = qlora.describe_quantization(settings), qlora.describe_lora(settings)
    rows = f"| base weights | {quantization or 'full precision'} |\n"
    if lora:
        return rows + f"| LoRA | {lora} |\n| trained | LoRA adapters and the new parameters |\n"
    trained = "new parameters only" if settings.get("train_only_new_params") else "all parameters"
    return rows + f"| trained | {trained} |\n"


def describe_training(settings: dict[str, Any]) -> str:
    """What a run with ``settings`` trained and on which base's weights, in words (``recipes.compare``'s header)."""
    lora = qlora.describe_lora(settings)
    patched = settings.get("scorer", BASELINE) != BASELINE
    if lora:
        trained = f"LoRA adapters ({lora})" + (" and the new parameters" if patched else "")
    else:
        trained = "the new parameters only" if settings.get("train_only_new_params") else "all parameters"
    return f"{trained}; base weights {qlora.describe_quantization(settings) or 'in full precision'}"


def _training_rows(results: dict[str, Any], task: Task) -> str:
    """The card's training table: the budget, the optimisation settings, and the task's own rows."""
    settings = results["settings"]
    rows = "| setting | value |\n|---|---|\n"
    rows += f"| steps | {results['train_steps']} |\n| processes | {results['num_processes']} |\n"
    rows += f"| total batch size | {results['total_train_batch_size']} |\n"
    rows += "".join(f"| {k} | {settings.get(k)} |\n" for k in CARD_TRAINING_SETTINGS if settings.get(k) is not None)
    return rows + "".join(f"| {name} | {value} |\n" for name, value in task.card_training_rows(results, settings))


def _data_text(data: dict[str, Any]) -> str:
    """The card's data line: the dataset (a Hub link) or the local files, its config and the evaluation split."""
    text = (
        f"[{data['dataset_name']}](https://huggingface.co/datasets/{data['dataset_name']})"
        if data["hub_dataset"]
        else f"{data['dataset_name']}" + (f": {', '.join(map(str, data['files']))}" if data.get("files") else "")
    )
    if data.get("dataset_config"):
        text += f", config `{data['dataset_config']}`"
    return text + f"; evaluated on `{data.get('eval_split')}`."


def harness_section(scores: dict[str, dict[str, float]] | None) -> str:
    """Markdown of the lm-evaluation-harness results (``--lm_eval_tasks``; empty without them)."""
    if not scores:
        return ""
    rows = "".join(
        f"| {task} | {metric} | {format_value(value)} |\n"
        for task, metrics in scores.items()
        for metric, value in metrics.items()
        if not metric.endswith("_stderr")
    )
    return (
        "\n## lm-evaluation-harness\n\n| task | metric | value |\n|---|---|---|\n" + rows + "\n"
        "The harness's own metrics. Its `word_perplexity` divides a document's log-likelihood by its number of words "
        "(`byte_perplexity` and `bits_per_byte` by its bytes), scoring whole documents in rolling windows; the "
        "perplexity under Results is per token of this model's tokenizer, over windows of the block size. Only the "
        "per-byte numbers compare across tokenizers.\n"
    )


def scorer_section(plots: dict[str, Any] | None, prefix: str = "", heading: str = "##") -> str:
    """Markdown showing a patched run's scorer history and attention maps (empty when it drew none).

    ``prefix``: the run folder relative to where the markdown lives (``"qana/"`` in a comparison report).
    """
    if not plots:
        return ""
    text = f"\n{heading} What the new scorers do\n\n"
    if plots.get("scorer_history"):
        text += (
            f"![scorer gates and norms over training]({prefix}{plots['scorer_history']})\n\n"
            "For each patched layer, at step 0 and every logging step: the gate α (mean over heads; the band spans "
            "the heads), the norm of the new parameters (gate excluded), and how far the attention on a probe "
            "input is from the unpatched model's (total-variation distance, 0 = the same maps; from the second "
            "patched layer on it includes the earlier layers' changes). The numbers are in "
            f"`{prefix}scorer_history.json`.\n\n"
        )
    if plots.get("attention_maps"):
        text += (
            f"![attention maps, patched vs unpatched]({prefix}{plots['attention_maps']})\n\n"
            f"Attention layer {plots['attention_layer']}, every head, on {plots['attention_input']} (rows: "
            "queries, columns: keys): the fine-tuned patched model (top), the same weights with plain dot-product "
            "attention, i.e. the patch's scorers removed (middle), and the difference (bottom). Mean "
            f"total-variation distance between the two maps' rows: {plots['attention_change']:.4f}.\n"
        )
    return text


# ------------------------------------------------------------------------------------------------ Hub


def push_to_hub(output_dir: str | os.PathLike, repo_id: str, token: str | None = None, private: bool = False) -> Any:
    """Upload the output folder (model, tokenizer/processor, card, results, plot) to a Hub model repo."""
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
    logger.info("Uploading %s to https://huggingface.co/%s", output_dir, repo_id)
    return api.upload_folder(
        repo_id=repo_id,
        folder_path=str(output_dir),
        repo_type="model",
        commit_message="End of training",
        ignore_patterns=HUB_IGNORE_PATTERNS,
    )
