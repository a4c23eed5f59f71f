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

    figure, (loss_axis, metric_axis) = plt.subplots(1, 2, figsize=(10, 4))
    losses = history.get("train_loss", [])
    if losses:
        loss_axis.plot([s for s, _ in losses], [v for _, v in losses], color="tab:blue", linewidth=1.2)
    loss_axis.set(title="training loss", xlabel="step", ylabel="loss")
    points = [(e["step"], e[metric]) for e in history.get("evaluations", []) if metric in e]
    if points:
        metric_axis.plot(*zip(*points), marker="o", color="tab:orange")
    metric_axis.set(title=f"evaluation {METRIC_LABELS.get(metric, metric)}", xlabel="step", ylabel=metric)
    if metric == "perplexity":  # spans orders of magnitude early in training
        _log_scale(metric_axis)
    for axis in (loss_axis, metric_axis):
        axis.grid(alpha=0.3)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def _log_scale(axis) -> None:
    from matplotlib.ticker import FormatStrFormatter

    axis.set_yscale("log")
    axis.yaxis.set_major_formatter(FormatStrFormatter("%g"))
    axis.yaxis.set_minor_formatter(FormatStrFormatter("%g"))


def plot_evaluation_curves(
    histories: dict[str, list[dict[str, Any] | None]], metric: str, path: str | os.PathLike, title: str
) -> None:
    """The evaluation curves of several runs in one plot: run label -> its training histories, one per seed (None
    for a seed not finished). A run of several seeds is drawn as the mean over them with a band from the lowest to
    the highest seed, at the steps every seed evaluated."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4.5))
    banded = False
    for label, runs in histories.items():
        curves = [{e["step"]: e[metric] for e in h["evaluations"] if metric in e} for h in runs if h is not None]
        steps = sorted(set.intersection(*(set(curve) for curve in curves))) if curves else []
        if not steps:
            continue
        values = [[curve[step] for curve in curves] for step in steps]
        legend = label if len(curves) == 1 else f"{label} (mean of {len(curves)} seeds)"
        (line,) = axis.plot(steps, [sum(v) / len(v) for v in values], marker="o", label=legend)
        if len(curves) > 1:
            lowest, highest = [min(v) for v in values], [max(v) for v in values]
            axis.fill_between(steps, lowest, highest, color=line.get_color(), alpha=0.2)
            banded = True
    axis.set(
        title=title + (" (band: min–max over seeds)" if banded else ""),
        xlabel="step",
        ylabel=METRIC_LABELS.get(metric, metric),
    )
    if metric == "perplexity":  # spans orders of magnitude early in training
        _log_scale(axis)
    axis.grid(alpha=0.3, which="both")
    axis.legend()
    figure.tight_layout()
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


def _loading_snippet(results: dict[str, Any], task: Task, patch: hf_neural_attn.PatchRecord | None) -> str:
    """The card's "How to load": the model (with the library where it is patched) and its preprocessor."""
    repo = results["settings"].get("hub_model_id") or "path/to/this/folder"
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
