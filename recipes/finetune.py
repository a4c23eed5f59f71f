#!/usr/bin/env python
"""Fine-tune a model with hf_neural_attn's attention patch, and evaluate it: causal LM (WikiText), GLUE, CIFAR.

Run from the repository root, as a module:

    accelerate launch -m recipes.finetune --model_name_or_path gpt2 --task clm --scorer qana --h 4
    accelerate launch -m recipes.finetune recipes/configs/qana_gpt2_sst2.yaml
    python -m recipes.finetune --help
    accelerate launch -m recipes.compare                     # the offline demo: baseline vs QANA, side by side
    python -m recipes.sweep --config recipes/sweeps/qana_ablations.yaml --grid reduced   # ablations over seeds

The flags follow the Hugging Face ``*_no_trainer.py`` example scripts; ``docs/recipes.md`` has the full guide.
A run writes to ``--output_dir``: the model (loadable with ``hf_neural_attn.from_pretrained``), its tokenizer or
image processor, ``all_results.json``, ``training_history.json``, a model card ``README.md`` and
``training_curves.png``; a patched run adds ``scorer_history.json``, ``scorer_history.png`` and
``attention_maps.png`` (see ``recipes/scorer_plots.py``); ``--checkpointing_steps`` adds resumable ``step_N`` /
``epoch_N`` checkpoints.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import sys
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from recipes import checkpointing, harness, hub, modeling, qlora, report, scorer_plots
from recipes.args import build_parser, parse_args
from recipes.checks import harness_tasks
from recipes.errors import RecipeError, refuse
from recipes.patch_flags import GATE_SETTINGS, describe_gated_scorers, patch_settings
from recipes.resources import PeakMemory
from recipes.tasks import Task, get_task

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
SECRET_SETTINGS = ("hub_token",)


def resume_settings() -> tuple[str, ...]:
    """Every setting a checkpoint must share with the run resuming it."""
    return (*RESUME_RUN_SETTINGS, *patch_settings(), *qlora.QLORA_SETTINGS)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry. Without arguments it prints the usage (the offline demo is recipes/compare.py)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv:
        build_parser().print_usage(sys.stderr)
        print(
            "finetune.py: give the run's flags or a config file (--help lists them); "
            "`accelerate launch -m recipes.compare` runs the offline demo.",
            file=sys.stderr,
        )
        return 2
    try:
        run(parse_args(argv))
    except RecipeError as error:
        return refuse("finetune.py", error)
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


def build_optimizer(model, args: argparse.Namespace):
    """AdamW; no weight decay on biases, norms and gates (1-d parameters); the new parameters may get their own LR."""
    import hf_neural_attn

    scorer_names = set(hf_neural_attn.scorer_parameters(model))
    groups: dict[tuple[bool, bool], list] = {}
    for name, parameter in model.named_parameters():
        if parameter.requires_grad:
            # The whole tensor's rank: under DeepSpeed ZeRO-3 every parameter's own is its 1-d empty placeholder's.
            matrix = len(hf_neural_attn.full_shape(parameter)) >= 2
            groups.setdefault((name in scorer_names, matrix), []).append(parameter)
    param_groups = []
    for (is_scorer, decay), parameters in sorted(groups.items()):
        group = {"params": parameters, "weight_decay": args.weight_decay if decay else 0.0}
        if is_scorer and args.scorer_learning_rate is not None:
            group["lr"] = args.scorer_learning_rate
        param_groups.append(group)
    if not param_groups:
        raise RecipeError("The model has no trainable parameters.")
    return torch.optim.AdamW(param_groups, lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2))


class GateSchedule:
    """Holds the scorers' per-head gates alpha where ``--gate_schedule`` says so (fixed, or warmup).

    * fixed: every gate keeps its initial value for the whole run;
    * warmup: alpha = min(1, step / N) while ``step`` (completed optimizer steps) < N, so alpha is 0 for the first
      step; at step N it is set to 1 and from then on trained like any parameter, its Adam state cleared so that
      the optimizer starts fresh for it.

    The gates stay trainable (``requires_grad`` is never toggled: DDP only synchronises the parameters that required
    a gradient when it wrapped the model, and FSDP flattens by that flag). While a gate is held, its gradient is
    dropped (``.grad = None``) before clipping and ``optimizer.step()``: AdamW skips a parameter without a gradient,
    weight decay included, and clipping does not count it. The held value is written under ``torch.no_grad()``
    before every forward pass and after every optimizer step (so logs and checkpoints show it), and it depends only
    on the number of completed steps: a resumed run holds exactly what an uninterrupted one would.
    """

    def __init__(self, schedule: str, warmup_steps: int | None, gates: dict[str, Any], optimizer) -> None:
        self.schedule = schedule
        self.warmup_steps = warmup_steps
        self.gates = gates
        self.optimizer = optimizer
        with torch.no_grad():
            self.initial = {name: gate.detach().clone() for name, gate in gates.items()}

    def held(self, step: int) -> bool:
        """Whether the gates are held (not learned) for the optimizer step that follows ``step`` completed ones."""
        return self.schedule == "fixed" or (self.schedule == "warmup" and step < self.warmup_steps)

    @torch.no_grad()
    def hold(self, step: int) -> None:
        """Write the value the schedule prescribes after ``step`` completed optimizer steps, if any."""
        if self.schedule == "fixed":
            for name, gate in self.gates.items():
                gate.copy_(self.initial[name])
        elif self.schedule == "warmup" and step <= self.warmup_steps:
            for gate in self.gates.values():
                gate.fill_(min(1.0, step / self.warmup_steps))
            if step == self.warmup_steps:  # the end of the warmup: learned from 1.0 on, with fresh Adam moments
                optimizer = getattr(self.optimizer, "optimizer", self.optimizer)  # Accelerate's wrapper
                for gate in self.gates.values():
                    optimizer.state.pop(gate, None)

    def drop_gradients(self, step: int) -> None:
        """Before clipping and the optimizer step: no update for a held gate."""
        if self.held(step):
            for gate in self.gates.values():
                gate.grad = None

    def describe(self) -> str:
        return report.describe_gate_schedule(self.schedule, self.warmup_steps)


def gate_schedule(args: argparse.Namespace, accelerator, model, optimizer) -> GateSchedule | None:
    """The run's GateSchedule, or None for --gate_schedule learned; refuses a patch without gates."""
    import hf_neural_attn

    if args.gate_schedule in (None, "learned"):
        return None
    if str(getattr(accelerator.distributed_type, "value", accelerator.distributed_type)).upper() == "DEEPSPEED":
        raise RecipeError(
            f"--gate_schedule {args.gate_schedule} is not supported under DeepSpeed, whose optimizer keeps its own "
            "copies of the weights and gradients; use DDP or FSDP, or --gate_schedule learned."
        )
    gates = {
        name: parameter
        for name, parameter in hf_neural_attn.scorer_parameters(accelerator.unwrap_model(model)).items()
        if name.endswith(".gate")
    }
    if not gates:
        raise RecipeError(
            f"--gate_schedule {args.gate_schedule} holds the scorers' gates alpha, but this patch has none (only "
            f"{describe_gated_scorers()}, have gates; under FSDP1 the parameters must keep their names: "
            "use_orig_params). Drop --gate_schedule or use a gated scorer."
        )
    return GateSchedule(args.gate_schedule, args.gate_warmup_steps, gates, optimizer)


def public_settings(args: argparse.Namespace) -> dict[str, Any]:
    return {key: value for key, value in vars(args).items() if key not in SECRET_SETTINGS}


def tracker_config(settings: dict[str, Any]) -> dict[str, Any]:
    """TensorBoard hparams take scalars and strings only."""
    return {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in settings.items()}


@dataclass
class TrainingRun:
    """Everything one run carries from setup through training to its outputs."""

    args: argparse.Namespace
    task: Task
    accelerator: Any
    bundle: modeling.ModelBundle
    data: Any
    model: Any
    optimizer: Any
    scheduler: Any
    train_dataloader: Any
    eval_dataloaders: dict[str, Any]
    updates_per_epoch: int
    max_train_steps: int
    num_epochs: int
    total_batch: int
    preprocessor: Any = None  # the tokenizer or image processor, saved beside the model
    parameters: dict[str, int] = field(default_factory=dict)  # modeling.count_parameters
    settings: dict[str, Any] = field(default_factory=dict)  # the run's public settings
    progress: checkpointing.TrainingProgress = field(default_factory=checkpointing.TrainingProgress)
    resumed: bool = False  # restored from a checkpoint
    track_scorers: bool = False
    gates: GateSchedule | None = None  # --gate_schedule fixed or warmup
    probe: Any = None
    probe_described: str = ""
    # Loss since the last log: this process's sum and micro-batch count. A checkpoint stores the totals over
    # all processes, so a resumed run logs the same means as an uninterrupted one.
    running: Any = None
    started: float = 0.0
    runtime_s: float = 0.0
    memory: PeakMemory | None = None
    peak_memory: dict[str, Any] = field(default_factory=dict)  # PeakMemory.read at the end of training


def setup(args: argparse.Namespace) -> TrainingRun:
    """Check the inputs, build the model and data, the optimizer and scheduler, and restore a checkpoint."""
    task: Task = get_task(args.task)
    accelerator = start_accelerator(args)
    check_services(args, accelerator)  # everything that can be wrong with the inputs fails before training starts
    bundle, preprocessor, data = build_model_and_data(args, task, accelerator)
    parameters = modeling.count_parameters(bundle.model)
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
    unwrapped = accelerator.unwrap_model(state.model)

    def write_model_files(folder: Path) -> None:  # what recipes.export rebuilds the model from
        unwrapped.config.architectures = [type(unwrapped).__name__]  # as the model's save_pretrained records it
        unwrapped.config.save_pretrained(folder)
        state.preprocessor.save_pretrained(folder)

    checkpointing.save_checkpoint(accelerator, state.args.output_dir, name, progress, write_model_files)
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


def run(args: argparse.Namespace) -> dict[str, Any]:
    """One fine-tuning run, end to end: setup, train, write the outputs."""
    return write_outputs(train(setup(args)))


if __name__ == "__main__":
    sys.exit(main())
