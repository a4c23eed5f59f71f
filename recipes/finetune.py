#!/usr/bin/env python
"""Fine-tune a model with hf_neural_attn's attention patch, and evaluate it: causal LM (WikiText), GLUE, CIFAR.

    accelerate launch recipes/finetune.py                      # offline demo: baseline vs QANA, side by side
    accelerate launch recipes/finetune.py --model_name_or_path gpt2 --task clm --scorer qana --h 4
    accelerate launch recipes/finetune.py recipes/configs/qana_gpt2_sst2.yaml
    python recipes/finetune.py --help

The flags follow the Hugging Face ``*_no_trainer.py`` example scripts; ``docs/recipes.md`` has the full guide.
A run writes to ``--output_dir``: the model (loadable with ``hf_neural_attn.from_pretrained``), its tokenizer or
image processor, ``all_results.json``, ``training_history.json``, a model card ``README.md`` and
``training_curves.png``; a patched run adds ``scorer_history.json``, ``scorer_history.png`` and
``attention_maps.png`` (see ``recipes/scorer_plots.py``); ``--checkpointing_steps`` adds resumable ``step_N`` /
``epoch_N`` checkpoints.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: import the sibling modules as the `recipes` package
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import argparse
import json
import logging
import math
import os
import random
import time
import zlib
from typing import Any

import numpy as np
import torch

from recipes import checkpointing, hub, modeling, report, scorer_plots
from recipes.args import RecipeError, parse_args
from recipes.tasks import Task, get_task

logger = logging.getLogger("recipes")

# Settings a resumed run must share with the run that wrote the checkpoint: what shapes the data order,
# the model (patch options included) and the optimisation. A resumed optimizer and scheduler keep their
# saved state, so a changed learning rate would silently not apply.
RESUME_SETTINGS = (
    "task",
    "seed",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "num_processes",
    "max_train_steps",
    "model",
    "scorer",
    "layers",
    "h",
    "proj_dim",
    "mode",
    "depth",
    "activation",
    "scorer_init",
    "impl",
    "train_only_new_params",
    "learning_rate",
    "scorer_learning_rate",
    "weight_decay",
    "lr_scheduler_type",
    "num_warmup_steps",
)
SECRET_SETTINGS = ("hub_token",)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry: no arguments runs the offline demo (baseline and patched side by side)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if not argv:
            from recipes.compare import run_demo

            run_demo()
        else:
            run(parse_args(argv))
    except RecipeError as error:
        print(f"finetune.py: error: {error}", file=sys.stderr)
        return 2
    return 0


def setup_logging(accelerator) -> None:
    import datasets
    import transformers

    logging.basicConfig(
        format="%(asctime)s - %(levelname)s - %(name)s - %(message)s", datefmt="%m/%d/%Y %H:%M:%S", level=logging.INFO
    )
    main_process = accelerator.is_local_main_process
    logger.setLevel(logging.INFO if main_process else logging.ERROR)
    datasets.utils.logging.set_verbosity_warning() if main_process else datasets.utils.logging.set_verbosity_error()
    transformers.utils.logging.set_verbosity_warning() if main_process else transformers.utils.logging.set_verbosity_error()
    if not main_process:
        datasets.utils.logging.disable_progress_bar()


def make_accelerator(args: argparse.Namespace):
    from accelerate import Accelerator, DataLoaderConfiguration

    accelerator_present = (
        torch.accelerator.is_available() if hasattr(torch, "accelerator") else torch.cuda.is_available()
    )
    kwargs: dict[str, Any] = {}
    if args.with_tracking:
        kwargs.update(log_with=args.report_to, project_dir=args.output_dir)
    return Accelerator(
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        # Without any accelerator, processes started by `accelerate launch --multi_gpu` train on CPU over gloo.
        cpu=args.cpu or not accelerator_present,
        # The shuffling order of each epoch is a function of (seed, epoch): the same on every process and
        # after a resume.
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=args.seed),
        **kwargs,
    )


def reseed(seed: int, micro_step: int) -> None:
    """Seed every RNG from (seed, micro-batch index) before each forward pass.

    Dropout masks then depend on where training is, not on how it got there: a resumed run draws the same
    masks as an uninterrupted one, whatever the data loaders consumed from the global RNG meanwhile.
    """
    value = zlib.crc32(f"{seed}:{micro_step}".encode())
    random.seed(value)
    np.random.seed(value)
    torch.manual_seed(value)


def build_optimizer(model, args: argparse.Namespace):
    """AdamW; no weight decay on biases, norms and gates (1-d parameters); the new parameters may get their own LR."""
    import hf_neural_attn

    scorer_names = set(hf_neural_attn.scorer_parameters(model))
    groups: dict[tuple[bool, bool], list] = {}
    for name, parameter in model.named_parameters():
        if parameter.requires_grad:
            groups.setdefault((name in scorer_names, parameter.ndim >= 2), []).append(parameter)
    param_groups = []
    for (is_scorer, decay), parameters in sorted(groups.items()):
        group = {"params": parameters, "weight_decay": args.weight_decay if decay else 0.0}
        if is_scorer and args.scorer_learning_rate is not None:
            group["lr"] = args.scorer_learning_rate
        param_groups.append(group)
    if not param_groups:
        raise RecipeError("The model has no trainable parameters.")
    return torch.optim.AdamW(param_groups, lr=args.learning_rate)


def public_settings(args: argparse.Namespace) -> dict[str, Any]:
    return {key: value for key, value in vars(args).items() if key not in SECRET_SETTINGS}


def tracker_config(settings: dict[str, Any]) -> dict[str, Any]:
    """TensorBoard hparams take scalars and strings only."""
    return {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in settings.items()}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """One fine-tuning run, end to end. Returns what all_results.json holds, plus the training history."""
    from accelerate.utils import set_seed
    from torch.utils.data import DataLoader
    from tqdm.auto import tqdm
    from transformers import get_scheduler

    task: Task = get_task(args.task)
    accelerator = make_accelerator(args)
    setup_logging(accelerator)
    if accelerator.gradient_accumulation_steps != args.gradient_accumulation_steps:
        # An Accelerate config (DeepSpeed's, for one) can set its own value, which wins over the flag.
        logger.warning(
            "The Accelerate config sets gradient accumulation to %d steps, overriding "
            "--gradient_accumulation_steps %d; training and the recorded settings use %d.",
            accelerator.gradient_accumulation_steps,
            args.gradient_accumulation_steps,
            accelerator.gradient_accumulation_steps,
        )
        args.gradient_accumulation_steps = accelerator.gradient_accumulation_steps
    logger.info("Run settings: %s", json.dumps(public_settings(args), default=str))
    logger.info("%s", accelerator.state)
    set_seed(args.seed)

    # Everything that can be wrong with the inputs fails here, before training starts.
    hub.check_hub(args)
    config = modeling.load_config(args)
    if args.task == "image":
        preprocessor = modeling.load_image_processor(args, config)
    else:
        preprocessor = modeling.load_tokenizer(args)
    raw = task.load_raw(args)
    labels = task.check_raw(args, raw)
    bundle = modeling.build_model(args, config, preprocessor, labels)
    model = bundle.model
    data = task.prepare(args, raw, preprocessor, model.config, labels, accelerator)
    parameters = modeling.count_parameters(model)
    logger.info(
        "Model %s from %s; patch: %s; parameters: %s",
        type(model).__name__,
        bundle.source,
        report.describe_patch(bundle.patch),
        parameters,
    )
    resume_path = checkpointing.resolve_resume(args.resume_from_checkpoint, args.output_dir)

    train_dataloader = DataLoader(
        data.train_dataset,
        shuffle=True,
        collate_fn=data.train_collate,
        batch_size=args.per_device_train_batch_size,
    )
    eval_dataloaders = {
        name: DataLoader(dataset, collate_fn=data.eval_collate, batch_size=args.per_device_eval_batch_size)
        for name, dataset in data.eval_datasets.items()
    }
    train_dataloader = accelerator.prepare(train_dataloader)
    eval_dataloaders = {name: accelerator.prepare(loader) for name, loader in eval_dataloaders.items()}

    updates_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    max_train_steps = args.max_train_steps or args.num_train_epochs * updates_per_epoch
    num_epochs = math.ceil(max_train_steps / updates_per_epoch)
    optimizer = build_optimizer(model, args)
    # Accelerate steps a prepared scheduler once per process for every optimizer step.
    scheduler = get_scheduler(
        args.lr_scheduler_type,
        optimizer=optimizer,
        num_warmup_steps=args.num_warmup_steps * accelerator.num_processes,
        num_training_steps=max_train_steps * accelerator.num_processes,
    )
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)

    os.makedirs(args.output_dir, exist_ok=True)
    settings = public_settings(args)
    resume_key = {
        **{k: settings.get(k) for k in RESUME_SETTINGS},
        "num_processes": accelerator.num_processes,
        "max_train_steps": max_train_steps,
        "model": bundle.source,
    }
    progress = checkpointing.TrainingProgress(settings=resume_key)
    if resume_path is not None:
        saved = checkpointing.read_progress(resume_path)
        checkpointing.check_resume_settings(saved.settings, resume_key)
        logger.info("Resuming from %s (step %d)", resume_path, saved.completed_steps)
        accelerator.load_state(str(resume_path))
        progress = saved

    if args.with_tracking:
        accelerator.init_trackers("finetune", tracker_config(settings))

    total_batch = args.per_device_train_batch_size * accelerator.num_processes * args.gradient_accumulation_steps
    logger.info("***** Running training *****")
    logger.info("  Task = %s; examples = %d; epochs = %d", args.task, len(data.train_dataset), num_epochs)
    logger.info(
        "  Batch size per device = %d; total (parallel, accumulation) = %d",
        args.per_device_train_batch_size,
        total_batch,
    )
    logger.info("  Optimizer steps = %d (%d per epoch)", max_train_steps, updates_per_epoch)

    def evaluate_now() -> dict[str, float]:
        metrics = task.evaluate(model, eval_dataloaders, accelerator, args)
        record = {"step": progress.completed_steps, **metrics}
        progress.evaluations.append(record)
        logger.info("Step %d evaluation: %s", progress.completed_steps, metrics)
        if args.with_tracking:
            accelerator.log({f"eval/{k}": v for k, v in metrics.items()}, step=progress.completed_steps)
        return metrics

    def checkpoint(name: str) -> None:
        progress.pending_loss = accelerator.gather(running[None]).sum(0).tolist()
        progress.runtime_s = time.time() - started
        checkpointing.save_checkpoint(accelerator, args.output_dir, name, progress)
        if accelerator.is_main_process:
            checkpointing.prune_checkpoints(args.output_dir, args.checkpoints_total_limit)
        accelerator.wait_for_everyone()

    # Patched runs: the scorers' gates and norms at step 0 and every logging step, on one probe input.
    track_scorers = bundle.patch is not None and scorer_plots.supported(accelerator)
    if bundle.patch is not None and not track_scorers:
        logger.info("Sharded parameters (%s): no scorer history or attention maps.", accelerator.distributed_type)
    probe, probe_described = scorer_plots.probe_inputs(data, task, args) if track_scorers else (None, "")
    if track_scorers and progress.completed_steps == 0 and not progress.scorer_history:
        scorer_plots.record(progress, accelerator.unwrap_model(model), probe)

    step_checkpoints = int(args.checkpointing_steps) if (args.checkpointing_steps or "").isdigit() else None
    bar = tqdm(
        total=max_train_steps,
        initial=progress.completed_steps,
        desc="Training",
        disable=not accelerator.is_local_main_process,
    )
    # Loss since the last log: this process's sum and micro-batch count. A checkpoint stores the totals over
    # all processes, so a resumed run logs the same means as an uninterrupted one.
    running = torch.zeros(2, dtype=torch.float64, device=accelerator.device)
    if accelerator.is_main_process and progress.pending_loss:
        running += torch.tensor(progress.pending_loss, dtype=torch.float64, device=accelerator.device)
    started = time.time() - progress.runtime_s
    if args.eval_at_start and resume_path is None:
        evaluate_now()
    model.train()
    while progress.completed_steps < max_train_steps:
        epoch = progress.epoch
        train_dataloader.set_epoch(epoch)
        batches = train_dataloader
        if progress.batches_in_epoch:
            batches = accelerator.skip_first_batches(train_dataloader, progress.batches_in_epoch)
        finished_epoch = True
        for batch in batches:
            reseed(args.seed, progress.micro_steps)
            with accelerator.accumulate(model):
                loss = model(**task.training_inputs(batch, epoch, args)).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients and args.max_grad_norm:
                    # All of model.parameters() (frozen ones have no gradient): under FSDP Accelerate then
                    # clips with the sharded model's own clip_grad_norm_.
                    accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            progress.batches_in_epoch += 1
            progress.micro_steps += 1
            running += torch.stack([loss.detach().double(), torch.ones((), dtype=torch.float64, device=running.device)])
            if not accelerator.sync_gradients:
                continue
            progress.completed_steps += 1
            step = progress.completed_steps
            bar.update(1)
            if step % args.logging_steps == 0 or step == max_train_steps:
                total, count = accelerator.gather(running[None]).sum(0).tolist()
                running.zero_()
                mean_loss = total / count
                progress.train_loss.append([step, mean_loss])
                learning_rate = scheduler.get_last_lr()[0]
                bar.set_postfix(loss=f"{mean_loss:.4f}", lr=f"{learning_rate:.2e}")
                if args.with_tracking:
                    accelerator.log({"train/loss": mean_loss, "train/learning_rate": learning_rate}, step=step)
                if track_scorers:
                    scorer_plots.record(progress, accelerator.unwrap_model(model), probe)
            if args.eval_steps and step % args.eval_steps == 0:
                evaluate_now()
            if step_checkpoints and step % step_checkpoints == 0:
                checkpoint(f"step_{step}")
            if step >= max_train_steps:
                finished_epoch = False
                break
        if finished_epoch or progress.batches_in_epoch >= len(train_dataloader):  # also when the budget ends an epoch
            progress.epoch += 1
            progress.batches_in_epoch = 0
            if not args.eval_steps and progress.completed_steps < max_train_steps:
                evaluate_now()
            if args.checkpointing_steps == "epoch":
                checkpoint(f"epoch_{epoch}")
    bar.close()

    if not progress.evaluations or progress.evaluations[-1]["step"] != progress.completed_steps:
        evaluate_now()
    final = {k: v for k, v in progress.evaluations[-1].items() if k != "step"}
    runtime = time.time() - started

    # The fine-tuned model (patched: loadable with hf_neural_attn.from_pretrained), tokenizer or processor.
    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model)
    state_dict = accelerator.get_state_dict(model)
    unwrapped.save_pretrained(
        args.output_dir,
        is_main_process=accelerator.is_main_process,
        save_function=accelerator.save,
        state_dict=state_dict,
    )
    plots: dict[str, Any] = {}
    if track_scorers and accelerator.is_main_process:
        plots_started = time.time()
        try:
            plots = scorer_plots.draw(
                unwrapped,
                progress.scorer_history,
                probe,
                probe_described,
                Path(args.output_dir),
                args,
                tokenizer=None if args.task == "image" else preprocessor,
                title=f"{args.task}: {report.describe_patch(bundle.patch)}, step {progress.completed_steps}",
            )
        except Exception:  # the model is saved: a figure that fails to draw must not lose the run
            logger.exception("Drawing the scorer plots failed")
        logger.info("Scorer plots drawn in %.1f s", time.time() - plots_started)
    results = {
        **final,
        "primary_metric": task.primary_metric,
        "greater_is_better": task.greater_is_better,
        "metric_names": task.metric_names() + [k for k in ("eval_loss",) if k in final],
        "train_loss": progress.train_loss[-1][1] if progress.train_loss else None,
        "train_steps": progress.completed_steps,
        "epochs": round(progress.completed_steps / updates_per_epoch, 4),
        "train_runtime_s": runtime,
        "train_samples": len(data.train_dataset),
        "eval_samples": {name: len(dataset) for name, dataset in data.eval_datasets.items()},
        "num_processes": accelerator.num_processes,
        "total_train_batch_size": total_batch,
        "parameters": parameters,
        "patch": bundle.patch,
        "task": args.task,
        "task_kind": task.kind,
        "pipeline_tag": task.pipeline_tag,
        "model_class": type(unwrapped).__name__,
        "model_source": bundle.source,
        "base_model": bundle.base_model,
        "from_scratch": bundle.from_scratch,
        "data": vars(data.info),
        "settings": settings,
        "plots": plots,
    }
    if task.kind == "clm":
        results.update(block_size=task.block, stride=task.stride)
    history = {"train_loss": progress.train_loss, "evaluations": progress.evaluations}
    if accelerator.is_main_process:
        preprocessor.save_pretrained(args.output_dir)
        output = Path(args.output_dir)
        report.write_json(output / report.RESULTS_FILE, results)
        report.write_json(output / "training_history.json", history)
        title = f"{args.task}: {report.describe_patch(bundle.patch)}"
        report.plot_training(history, task.primary_metric, output / report.PLOT_FILE, title)
        (output / report.CARD_FILE).write_text(report.model_card(results, output))
        logger.info("Final metrics: %s", {k: final[k] for k in final})
        logger.info(
            "Wrote the model, %s, %s and %s to %s", report.RESULTS_FILE, report.CARD_FILE, report.PLOT_FILE, output
        )
    accelerator.wait_for_everyone()
    if args.with_tracking:
        accelerator.end_training()
    if args.push_to_hub and accelerator.is_main_process:
        report.push_to_hub(args.output_dir, args.hub_model_id, token=args.hub_token, private=args.hub_private_repo)
    accelerator.wait_for_everyone()
    return {**results, "history": history, "scorer_history": progress.scorer_history}


if __name__ == "__main__":
    sys.exit(main())
