"""What a fine-tuning run writes into ``--output_dir`` once it has trained: the model and its preprocessor,
``all_results.json``, ``training_history.json``, the plots, the model card and the lm-evaluation-harness scores; the
upload with ``--push_to_hub``; and the model files a checkpoint carries beside Accelerate's state."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import hf_neural_attn
from recipes import harness, qlora, report, scorer_plots
from recipes.checks import harness_tasks
from recipes.errors import RecipeError
from recipes.run_state import TrainingRun

logger = logging.getLogger("recipes")


def write_model_files(unwrapped, preprocessor, settings: dict[str, Any], step: str, folder: Path) -> None:
    """The model's config and preprocessor in a checkpoint's ``folder``: what recipes.export rebuilds the model from;
    and the checkpoint's README.md beside it (``step``: the checkpoint's name; ``settings``: the run's, as its
    trainer_state.json records them)."""
    model = qlora.transformers_model(unwrapped)  # a LoRA run's: the transformers model inside PEFT's wrapper
    model.config.architectures = [type(model).__name__]  # as the model's save_pretrained records it
    model.config.save_pretrained(folder)
    # A patched config writes a full checkpoint's card beside itself: this folder is none, its parent's card says so.
    (folder / report.CARD_FILE).unlink(missing_ok=True)
    preprocessor.save_pretrained(folder)
    patch = hf_neural_attn.patch_record(model) if hf_neural_attn.is_patched(model) else None
    card = report.checkpoint_card(settings, type(model).__name__, patch, step, exported=False)
    (folder.parent / report.CARD_FILE).write_text(card)


def write_outputs(state: TrainingRun) -> dict[str, Any]:
    """Save the model, its preprocessor, results, history, plots and model card; upload with --push_to_hub.
    Returns what all_results.json holds, plus the training and scorer histories."""
    args, accelerator, progress, task, bundle = state.args, state.accelerator, state.progress, state.task, state.bundle
    final = {k: v for k, v in progress.evaluations[-1].items() if k not in ("step", "elapsed_s")}
    # The fine-tuned model (patched: loadable with hf_neural_attn.from_pretrained), tokenizer or processor.
    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(state.model)
    state_dict = accelerator.get_state_dict(state.model)
    unwrapped.save_pretrained(
        args.output_dir,
        is_main_process=accelerator.is_main_process,
        save_function=accelerator.save,
        state_dict=state_dict,
    )
    plots = draw_scorer_plots(state, unwrapped) if state.track_scorers and accelerator.is_main_process else {}
    results = collect_results(state, type(qlora.transformers_model(unwrapped)).__name__, final, plots)
    history = {"train_loss": progress.train_loss, "evaluations": progress.evaluations}
    output = Path(args.output_dir)
    if accelerator.is_main_process:
        state.preprocessor.save_pretrained(args.output_dir)
        report.write_json(output / report.RESULTS_FILE, results)
        report.write_json(output / report.HISTORY_FILE, history)
        title = f"{args.task}: {report.describe_patch(bundle.patch)}"
        report.plot_training(history, task.primary_metric, output / report.PLOT_FILE, title)
        (output / report.CARD_FILE).write_text(report.model_card(results, output))
        logger.info("Final metrics: %s", final)
        logger.info(
            "Wrote the model, %s, %s and %s to %s", report.RESULTS_FILE, report.CARD_FILE, report.PLOT_FILE, output
        )
    accelerator.wait_for_everyone()
    if harness_tasks(args):
        # After everything else is written: a harness that fails now loses none of the run.
        results["lm_eval"] = evaluate_with_the_harness(state, unwrapped)
        if accelerator.is_main_process:
            report.write_json(output / report.RESULTS_FILE, results)
            (output / report.CARD_FILE).write_text(report.model_card(results, output))
    if args.with_tracking:
        accelerator.end_training()
    if args.push_to_hub and accelerator.is_main_process:
        report.push_to_hub(args.output_dir, args.hub_model_id, token=args.hub_token, private=args.hub_private_repo)
    accelerator.wait_for_everyone()
    return {**results, "history": history, "scorer_history": progress.scorer_history}


def draw_scorer_plots(state: TrainingRun, unwrapped) -> dict[str, Any]:
    """The scorer history and attention maps of a patched run (``recipes.scorer_plots``); what the card shows of
    them. A figure that fails to draw is logged, not raised: the model is saved already."""
    args, progress = state.args, state.progress
    started = time.time()
    plots: dict[str, Any] = {}
    try:
        plots = scorer_plots.draw(
            unwrapped,
            progress.scorer_history,
            state.probe,
            state.probe_described,
            Path(args.output_dir),
            args,
            tokenizer=state.task.token_labels(state.preprocessor),
            title=f"{args.task}: {report.describe_patch(state.bundle.patch)}, step {progress.completed_steps}",
        )
    except Exception:
        logger.exception("Drawing the scorer plots failed")
    logger.info("Scorer plots drawn in %.1f s", time.time() - started)
    return plots


def collect_results(
    state: TrainingRun, model_class: str, final: dict[str, float], plots: dict[str, Any]
) -> dict[str, Any]:
    """What all_results.json holds: the final metrics, the budget, the patch, the task, the model, the data, the
    settings and the pictures drawn."""
    args, accelerator, progress, task, bundle = state.args, state.accelerator, state.progress, state.task, state.bundle
    return {
        **final,
        "primary_metric": task.primary_metric,
        "greater_is_better": task.greater_is_better,
        "metric_names": task.metric_columns(),
        "train_loss": progress.train_loss[-1][1] if progress.train_loss else None,
        "train_steps": progress.completed_steps,
        "epochs": round(progress.completed_steps / state.updates_per_epoch, 4),
        "train_runtime_s": state.runtime_s,
        "peak_memory": state.peak_memory,
        "train_samples": len(state.data.train_dataset),
        "eval_samples": {name: len(dataset) for name, dataset in state.data.eval_datasets.items()},
        "num_processes": accelerator.num_processes,
        "total_train_batch_size": state.total_batch,
        "parameters": state.parameters,
        "patch": bundle.patch.to_dict() if bundle.patch is not None else None,
        "task": args.task,
        "task_kind": task.kind,
        "pipeline_tag": task.pipeline_tag,
        "model_class": model_class,
        "model_source": bundle.source,
        "base_model": bundle.base_model,
        "from_scratch": bundle.from_scratch,
        "data": vars(state.data.info),
        "settings": state.settings,
        "plots": plots,
        **task.extra_results(),
    }


def evaluate_with_the_harness(state: TrainingRun, unwrapped) -> dict[str, dict[str, float]] | None:
    """--lm_eval_tasks on the trained model, on the main process (None on the others). One process evaluates the
    model in memory; under several processes (whose model may be sharded) the main process reloads the checkpoint
    just saved, with hf_neural_attn.from_pretrained."""
    args, accelerator = state.args, state.accelerator
    scores = None
    if accelerator.is_main_process:
        model = unwrapped
        if accelerator.num_processes > 1:
            import hf_neural_attn

            model = hf_neural_attn.from_pretrained(args.output_dir).to(accelerator.device)
        limit = args.lm_eval_limit
        if limit is not None and limit >= 1 and float(limit).is_integer():
            limit = int(limit)  # the harness reads an int as a count and a float as a fraction
        started = time.time()
        try:
            scores = harness.evaluate_with_harness(
                model,
                state.preprocessor,
                harness_tasks(args),
                include_path=args.lm_eval_include_path,
                batch_size=args.lm_eval_batch_size or args.per_device_eval_batch_size,
                limit=limit,
                device=str(accelerator.device),
            )
        except Exception as error:  # the harness's own failure, after the run was written
            raise RecipeError(
                f"lm-evaluation-harness failed after training ({type(error).__name__}: {error}); the model, "
                f"{report.RESULTS_FILE} and the model card are in {args.output_dir} without its results."
            ) from error
        logger.info("lm-evaluation-harness (%.1f s): %s", time.time() - started, scores)
    accelerator.wait_for_everyone()
    return scores
