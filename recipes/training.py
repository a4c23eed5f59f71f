"""One fine-tuning run, end to end (:func:`run`): setup (the accelerator, the model and data, the optimizer, a
restored checkpoint), the training loop with its logging, evaluations and checkpoints, then the outputs
(``recipes.outputs``). ``recipes.finetune`` is its command line; ``recipes.sweep`` runs it once per run of a plan.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import math
import os
import random
import time
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch

from recipes import checkpointing, harness, hub, modeling, qlora, quiet, report, scorer_plots
from recipes.args import public_settings
from recipes.checks import harness_tasks
from recipes.errors import RecipeError
from recipes.optimization import build_optimizer, gate_schedule
from recipes.outputs import write_model_files, write_outputs
from recipes.patch_flags import GATE_SETTINGS, describe_gated_scorers, patch_settings
from recipes.resources import PeakMemory
from recipes.run_state import TrainingRun
from recipes.tasks import Task, get_task

logger = logging.getLogger("recipes")

logger = logging.getLogger("recipes")

# Settings a resumed run must share with the run that wrote the checkpoint: what shapes the data order,
# the model and the optimisation; the patch's settings (scorer, layers, every scorer option) are added by
# resume_settings(). A resumed optimizer and scheduler keep their saved state, so a changed learning rate
# would silently not apply.
RESUME_RUN_SETTINGS = (
    "task",
    "seed",
    "validation_split_seed",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "num_processes",
    "max_train_steps",
    "model",
    "train_only_new_params",
    "learning_rate",
    "scorer_learning_rate",
    "weight_decay",
    "adam_beta1",
    "adam_beta2",
    "lr_scheduler_type",
    "num_warmup_steps",
    "min_learning_rate",
    "train_stride",
    *GATE_SETTINGS,
)


def resume_settings() -> tuple[str, ...]:
    """Every setting a checkpoint must share with the run resuming it."""
    return (*RESUME_RUN_SETTINGS, *patch_settings(), *qlora.QLORA_SETTINGS)


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
    from accelerate.utils import InitProcessGroupKwargs

    accelerator_present = (
        torch.accelerator.is_available() if hasattr(torch, "accelerator") else torch.cuda.is_available()
    )
    # Without any accelerator, processes started by `accelerate launch --multi_gpu` train on CPU over gloo.
    cpu = args.cpu or not accelerator_present
    kwargs: dict[str, Any] = {}
    if args.with_tracking:
        kwargs.update(log_with=args.report_to, project_dir=args.output_dir)
    deepspeed_launch = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    if deepspeed_launch and not accelerator_present and not args.cpu:
        # accelerate runs DeepSpeed only with cpu=False; on a machine without an accelerator it then lets DeepSpeed
        # join the processes (gloo, DeepSpeed's CPU accelerator) but keeps no backend of its own, and counts one
        # process on every rank: each rank would see the whole dataset. Naming the backend makes it one job.
        cpu = False
        kwargs["kwargs_handlers"] = [InitProcessGroupKwargs(backend="gloo")]
    return Accelerator(
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        cpu=cpu,
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


def tracker_config(settings: dict[str, Any]) -> dict[str, Any]:
    """TensorBoard hparams take scalars and strings only."""
    return {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in settings.items()}


def setup(args: argparse.Namespace) -> TrainingRun:
    """Check the inputs, build the model and data, the optimizer and scheduler, and restore a checkpoint."""
    task: Task = get_task(args.task)
    accelerator = start_accelerator(args)
    check_services(args, accelerator)  # everything that can be wrong with the inputs fails before training starts
    bundle, preprocessor, data = build_model_and_data(args, task, accelerator)
    parameters = modeling.count_parameters(bundle.model, bundle.widened_parameters)
    logger.info(
        "Model %s from %s; patch: %s; parameters: %s",
        type(bundle.model).__name__,
        bundle.source,
        report.describe_patch(bundle.patch),
        parameters,
    )
    resume_path = checkpointing.resolve_resume(args.resume_from_checkpoint, args.output_dir)
    state = prepare_training(args, task, accelerator, bundle, data)
    state.preprocessor, state.parameters = preprocessor, parameters
    # Before a checkpoint is loaded: a fixed gate keeps the value the model was built (or loaded) with.
    state.gates = gate_schedule(args, accelerator, state.model, state.optimizer)
    restore(state, resume_path)
    # Patched runs: the scorers' gates and norms at step 0 and every logging step, on one probe input.
    state.track_scorers = bundle.patch is not None and scorer_plots.supported(accelerator)
    if bundle.patch is not None and not state.track_scorers:
        logger.info("Sharded parameters (%s): no scorer history or attention maps.", accelerator.distributed_type)
    if state.gates is not None:
        logger.info("Gate schedule: %s, %d gate parameters", state.gates.describe(), len(state.gates.gates))
        state.gates.hold(state.progress.completed_steps)
    if state.track_scorers:
        state.probe, state.probe_described = scorer_plots.probe_inputs(data, task, args)
        if state.progress.completed_steps == 0 and not state.progress.scorer_history:
            record_scorers(state)
    return state


def start_accelerator(args: argparse.Namespace):
    """The run's Accelerator and logging; the gradient accumulation an Accelerate config sets wins over the flag.
    Logs the settings and seeds every generator."""
    from accelerate.utils import set_seed

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
    return accelerator


def check_services(args: argparse.Namespace, accelerator) -> None:
    """What the run needs from outside, before anything is loaded: the Hub (else offline mode), push access, the
    harness's tasks."""
    hub.check_hub(args)
    if args.push_to_hub:
        hub.check_push_access(args.hub_model_id, args.hub_token)
    if harness_tasks(args) and accelerator.is_main_process:
        try:
            harness.check_tasks(harness_tasks(args), args.lm_eval_include_path)
        except ValueError as error:
            raise RecipeError(f"--lm_eval_tasks: {error}") from None


def build_model_and_data(args: argparse.Namespace, task: Task, accelerator):
    """The model (patched), its preprocessor and the prepared data: the config and the raw data are checked before
    any weights load, and the labels the data has shape the model's head. Returns (bundle, preprocessor, data)."""
    import hf_neural_attn

    config = modeling.load_config(args, task)
    preprocessor = task.load_preprocessor(args, config)
    raw = task.load_raw(args)
    labels = task.check_raw(args, raw)
    bundle = modeling.build_model(args, task, config, preprocessor, labels)
    if args.gate_schedule not in (None, "learned") and not any(
        name.endswith(".gate") for name in hf_neural_attn.scorer_parameters(bundle.model)
    ):
        raise RecipeError(
            f"--gate_schedule {args.gate_schedule} holds the scorers' gates alpha, but the patch "
            f"({report.describe_patch(bundle.patch)}) has none: only {describe_gated_scorers()}, have gates. Drop "
            "--gate_schedule or use a gated scorer."
        )
    if args.gradient_checkpointing:
        # Non-reentrant: torch's recommended form (docs/recipes.md says how it fares under DeepSpeed ZeRO-3).
        # transformers 5.23 renamed gradient_checkpointing_enable (now deprecated) to activation_checkpointing_enable.
        non_reentrant = {"use_reentrant": False}
        if hasattr(bundle.model, "activation_checkpointing_enable"):
            bundle.model.activation_checkpointing_enable(activation_checkpointing_kwargs=non_reentrant)
        else:
            bundle.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=non_reentrant)
        bundle.model.config.use_cache = False
    data = task.prepare(args, raw, preprocessor, bundle.model.config, labels, accelerator)
    return bundle, preprocessor, data


def prepare_training(args: argparse.Namespace, task: Task, accelerator, bundle, data) -> TrainingRun:
    """The data loaders, the optimizer and its schedule, prepared by Accelerate with the model: a TrainingRun that
    has not started (its preprocessor, parameter count, gates and progress are set by :func:`setup`)."""
    from torch.utils.data import DataLoader
    from transformers import get_scheduler

    train_dataloader = accelerator.prepare(
        DataLoader(
            data.train_dataset,
            shuffle=True,
            collate_fn=data.train_collate,
            batch_size=args.per_device_train_batch_size,
        )
    )
    eval_dataloaders = {
        name: accelerator.prepare(
            DataLoader(dataset, collate_fn=data.eval_collate, batch_size=args.per_device_eval_batch_size)
        )
        for name, dataset in data.eval_datasets.items()
    }
    updates_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    max_train_steps = args.max_train_steps or args.num_train_epochs * updates_per_epoch
    optimizer = build_optimizer(bundle.model, args)
    # Accelerate steps a prepared scheduler once per process for every optimizer step.
    scheduler = get_scheduler(
        args.lr_scheduler_type,
        optimizer=optimizer,
        num_warmup_steps=args.num_warmup_steps * accelerator.num_processes,
        num_training_steps=max_train_steps * accelerator.num_processes,
        scheduler_specific_kwargs={"min_lr": args.min_learning_rate} if args.min_learning_rate is not None else None,
    )
    deepspeed_plugin = accelerator.state.deepspeed_plugin
    if deepspeed_plugin is not None and deepspeed_plugin.deepspeed_config.get("train_micro_batch_size_per_gpu") in (
        None,
        "auto",
    ):
        # accelerate reads DeepSpeed's micro-batch size from dataloaders prepared in the same call; these were
        # prepared above (the scheduler needs their length).
        deepspeed_plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = args.per_device_train_batch_size
    model, optimizer, scheduler = accelerator.prepare(bundle.model, optimizer, scheduler)
    return TrainingRun(
        args=args,
        task=task,
        accelerator=accelerator,
        bundle=bundle,
        data=data,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        train_dataloader=train_dataloader,
        eval_dataloaders=eval_dataloaders,
        updates_per_epoch=updates_per_epoch,
        max_train_steps=max_train_steps,
        num_epochs=math.ceil(max_train_steps / updates_per_epoch),
        total_batch=args.per_device_train_batch_size * accelerator.num_processes * args.gradient_accumulation_steps,
    )


def restore(state: TrainingRun, resume_path: Path | None) -> None:
    """The run's settings and progress: fresh, or restored from ``resume_path`` (whose settings must be the run's);
    starts the trackers."""
    args, accelerator = state.args, state.accelerator
    os.makedirs(args.output_dir, exist_ok=True)
    state.settings = public_settings(args)
    resume_key = {
        **{k: state.settings.get(k) for k in resume_settings()},
        "num_processes": accelerator.num_processes,
        "max_train_steps": state.max_train_steps,
        "model": state.bundle.source,
    }
    state.progress = checkpointing.TrainingProgress(settings=resume_key)
    if resume_path is not None:
        saved = checkpointing.read_progress(resume_path)
        checkpointing.check_resume_settings(saved.settings, resume_key)
        logger.info("Resuming from %s (step %d)", resume_path, saved.completed_steps)
        accelerator.load_state(str(resume_path), **qlora.resume_load_kwargs(args))
        state.progress, state.resumed = saved, True
    if args.with_tracking:
        accelerator.init_trackers("finetune", tracker_config(state.settings))


def record_scorers(state: TrainingRun) -> None:
    """Add this step's scorer statistics to the history. A patch the statistics cannot handle (they compare with
    the unpatched attention, which e.g. QANA's narrower keys do not have) stops the history and the pictures with a
    warning: like a figure that fails to draw, it must not lose the run."""
    try:
        scorer_plots.record(state.progress, state.accelerator.unwrap_model(state.model), state.probe)
    except (ValueError, RuntimeError, NotImplementedError) as error:
        logger.warning("No scorer history or attention maps for this patch: %s", error)
        state.track_scorers = False


def evaluate(state: TrainingRun) -> dict[str, float]:
    """Evaluate now; the metrics join the run's history (and the tracker)."""
    args, progress = state.args, state.progress
    metrics = state.task.evaluate(state.model, state.eval_dataloaders, state.accelerator, args)
    # elapsed_s: the run's wall-clock time at this evaluation, earlier evaluations included (curves against time).
    elapsed = round(time.time() - state.started, 3)
    progress.evaluations.append({"step": progress.completed_steps, "elapsed_s": elapsed, **metrics})
    logger.info("Step %d evaluation: %s", progress.completed_steps, metrics)
    if args.with_tracking:
        state.accelerator.log({f"eval/{k}": v for k, v in metrics.items()}, step=progress.completed_steps)
    return metrics


def save_checkpoint(state: TrainingRun, name: str) -> None:
    accelerator, progress = state.accelerator, state.progress
    progress.pending_loss = accelerator.gather(state.running[None]).sum(0).tolist()
    progress.runtime_s = time.time() - state.started
    model_files = functools.partial(
        write_model_files, accelerator.unwrap_model(state.model), state.preprocessor, progress.settings, name
    )
    checkpointing.save_checkpoint(
        accelerator,
        state.args.output_dir,
        name,
        progress,
        model_files,
        state_hooks=(qlora.set_aside_torchao_weights,),
        safe_serialization=qlora.safetensors_checkpoints(state.args),
    )
    if accelerator.is_main_process:
        checkpointing.prune_checkpoints(state.args.output_dir, state.args.checkpoints_total_limit)
    accelerator.wait_for_everyone()


def log_training_loss(state: TrainingRun, step: int) -> str:
    """Log the mean loss since the last log; returns it formatted for the progress bar."""
    accelerator = state.accelerator
    total, count = accelerator.gather(state.running[None]).sum(0).tolist()
    state.running.zero_()
    mean_loss = total / count
    state.progress.train_loss.append([step, mean_loss])
    learning_rate = state.scheduler.get_last_lr()[0]
    if state.args.with_tracking:
        accelerator.log({"train/loss": mean_loss, "train/learning_rate": learning_rate}, step=step)
    if state.track_scorers:
        record_scorers(state)
    return f"loss={mean_loss:.4f}, lr={learning_rate:.2e}"


def train_micro_batch(state: TrainingRun, batch: dict[str, Any], epoch: int) -> None:
    """One micro-batch: forward and backward; at the end of an accumulation, the clipped optimizer step (a held
    gate gets no update). Adds its loss to the running sum."""
    args, accelerator, progress, model = state.args, state.accelerator, state.progress, state.model
    reseed(args.seed, progress.micro_steps)
    if state.gates is not None:
        state.gates.hold(progress.completed_steps)
    with accelerator.accumulate(model):
        loss = model(**state.task.training_inputs(batch, epoch, args)).loss
        accelerator.backward(loss)
        if accelerator.sync_gradients and state.gates is not None:
            state.gates.drop_gradients(progress.completed_steps)  # a held gate: no update, not clipped
        if accelerator.sync_gradients and args.max_grad_norm:
            # All of model.parameters() (frozen ones have no gradient): under FSDP Accelerate then
            # clips with the sharded model's own clip_grad_norm_.
            accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        state.optimizer.step()
        state.scheduler.step()
        state.optimizer.zero_grad()
    progress.batches_in_epoch += 1
    progress.micro_steps += 1
    one = torch.ones((), dtype=torch.float64, device=state.running.device)
    state.running += torch.stack([loss.detach().double(), one])


def train(state: TrainingRun) -> TrainingRun:
    """The training loop: optimizer steps up to the budget, with logging, evaluation and checkpoints."""
    from tqdm.auto import tqdm

    args, accelerator, progress, model = state.args, state.accelerator, state.progress, state.model
    logger.info("***** Running training *****")
    logger.info("  Task = %s; examples = %d; epochs = %d", args.task, len(state.data.train_dataset), state.num_epochs)
    logger.info(
        "  Batch size per device = %d; total (parallel, accumulation) = %d",
        args.per_device_train_batch_size,
        state.total_batch,
    )
    logger.info("  Optimizer steps = %d (%d per epoch)", state.max_train_steps, state.updates_per_epoch)
    step_checkpoints = int(args.checkpointing_steps) if (args.checkpointing_steps or "").isdigit() else None
    bar = tqdm(
        total=state.max_train_steps,
        initial=progress.completed_steps,
        desc="Training",
        disable=not accelerator.is_local_main_process,
    )
    state.running = torch.zeros(2, dtype=torch.float64, device=accelerator.device)
    if accelerator.is_main_process and progress.pending_loss:
        state.running += torch.tensor(progress.pending_loss, dtype=torch.float64, device=accelerator.device)
    state.started = time.time() - progress.runtime_s
    state.memory = PeakMemory(accelerator.device)
    state.memory.start()
    if args.eval_at_start and not state.resumed:
        evaluate(state)
    model.train()
    while progress.completed_steps < state.max_train_steps:
        epoch = progress.epoch
        state.train_dataloader.set_epoch(epoch)
        batches = state.train_dataloader
        if progress.batches_in_epoch:
            batches = accelerator.skip_first_batches(state.train_dataloader, progress.batches_in_epoch)
        finished_epoch = True
        for batch in batches:
            train_micro_batch(state, batch, epoch)
            if not accelerator.sync_gradients:
                continue
            progress.completed_steps += 1
            step = progress.completed_steps
            if state.gates is not None:  # logs, evaluations and checkpoints see the value of the next step
                state.gates.hold(step)
            bar.update(1)
            if step % args.logging_steps == 0 or step == state.max_train_steps:
                bar.set_postfix_str(log_training_loss(state, step))
            if args.eval_steps and step % args.eval_steps == 0:
                evaluate(state)
            if step_checkpoints and step % step_checkpoints == 0:
                save_checkpoint(state, f"step_{step}")
            if step >= state.max_train_steps:
                finished_epoch = False
                break
        if finished_epoch or progress.batches_in_epoch >= len(state.train_dataloader):  # also when the budget ends
            progress.epoch += 1
            progress.batches_in_epoch = 0
            if not args.eval_steps and progress.completed_steps < state.max_train_steps:
                evaluate(state)
            if args.checkpointing_steps == "epoch":
                save_checkpoint(state, f"epoch_{epoch}")
    bar.close()
    if not progress.evaluations or progress.evaluations[-1]["step"] != progress.completed_steps:
        evaluate(state)
    state.runtime_s = time.time() - state.started
    state.peak_memory = state.memory.read()
    return state


def run(args: argparse.Namespace) -> dict[str, Any]:
    """One fine-tuning run, end to end: setup, train, write the outputs."""
    quiet.import_quietly()
    return write_outputs(train(setup(args)))
