"""The recipe tasks, one module each, found by name in :data:`TASKS`: adding a task is one module and one line here.

* ``clm.py``: causal language modelling (WikiText; the embedded Python documentation offline), perplexity;
* ``glue.py``: the nine GLUE tasks with their official metrics;
* ``image.py``: image classification (CIFAR), accuracy;
* ``text.py``: what the text tasks share (text files, the tokenizer, the embedded GPT-2);
* ``base.py``: the :class:`~recipes.tasks.base.Task` interface they implement and the loading helpers they share.

Each task checks its data flags, loads its data (local files or folders, a Hub dataset, or for the causal LM an
embedded corpus that ships with Python), checks its columns and labels before anything is trained, picks its model
head and preprocessor, preprocesses the data, and evaluates a model on it with the task's official metrics (offline
`evaluate` modules in ``recipes/metrics/``). The rest of the recipes ask the task and never branch on its name.
"""

from __future__ import annotations

import argparse

from recipes.errors import RecipeError
from recipes.tasks.base import Task
from recipes.tasks.clm import CausalLMTask
from recipes.tasks.glue import GLUE_TASKS, GlueTask
from recipes.tasks.image import ImageTask

# --task name -> the class that serves it; the command line's --task choices, in this order.
TASKS: dict[str, type[Task]] = {"clm": CausalLMTask, **{name: GlueTask for name in GLUE_TASKS}, "image": ImageTask}
DEFAULT_TASK = "clm"


def get_task(name: str) -> Task:
    """A fresh task object for ``--task name``; an unknown name is a RecipeError listing the known ones."""
    if name not in TASKS:
        raise RecipeError(f"Unknown task {name!r}; choose {describe_tasks()}.")
    return TASKS[name](name)


def describe_tasks() -> str:
    """The known tasks in words, grouped by the class that serves them: ``clm, one of the GLUE tasks [...], or
    image``."""
    served: dict[type[Task], list[str]] = {}
    for name, task_class in TASKS.items():
        served.setdefault(task_class, []).append(name)
    parts = [task_class.describe_names(names) for task_class, names in served.items()]
    return parts[0] if len(parts) == 1 else f"{', '.join(parts[:-1])}, or {parts[-1]}"


def check_args(args: argparse.Namespace) -> None:
    """The checks of the data flags that depend on ``--task``: a dataset another task builds itself is refused, then
    the task checks its own flags."""
    task = get_task(args.task)
    for task_class in dict.fromkeys(TASKS.values()):
        use = task_class.embedded_datasets.get(args.dataset_name)
        if use is not None and not isinstance(task, task_class):
            raise RecipeError(use)
    task.check_args(args)


def harness_task_names() -> list[str]:
    """The tasks lm-evaluation-harness can evaluate after training (``--lm_eval_tasks``)."""
    return [name for name, task_class in TASKS.items() if task_class.harness_evaluates]


__all__ = ["DEFAULT_TASK", "TASKS", "Task", "check_args", "describe_tasks", "get_task", "harness_task_names"]
