"""What one fine-tuning run carries from setup through training to its outputs (:class:`TrainingRun`)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

from recipes import checkpointing, modeling
from recipes.optimization import GateSchedule
from recipes.resources import PeakMemory
from recipes.tasks import Task


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
