"""Data and metrics of each task kind, one module each, found by name in :data:`TASKS`.

* ``clm.py``: causal language modelling (WikiText; the embedded Python documentation offline), perplexity;
* ``glue.py``: the nine GLUE tasks with their official metrics;
* ``image.py``: image classification (CIFAR), accuracy;
* ``base.py``: the :class:`~recipes.tasks.base.Task` interface they implement and the loading helpers they share.

Each task loads its data (local files or folders, a Hub dataset, or for the causal LM an embedded corpus that
ships with Python), checks its columns and labels before anything is trained, preprocesses it, and evaluates a
model on it with the task's official metrics (offline `evaluate` modules in ``recipes/metrics/``).
"""

from __future__ import annotations

from recipes.args import GLUE_TASKS, RecipeError
from recipes.tasks.base import Task
from recipes.tasks.clm import CausalLMTask
from recipes.tasks.glue import GlueTask
from recipes.tasks.image import ImageTask

# --task name -> the class that serves it (recipes.args.TASKS lists the same names, for the command line).
TASKS: dict[str, type[Task]] = {"clm": CausalLMTask, **{name: GlueTask for name in GLUE_TASKS}, "image": ImageTask}


def get_task(name: str) -> Task:
    """A fresh task object for ``--task name``; an unknown name is a RecipeError listing the known ones."""
    if name not in TASKS:
        raise RecipeError(f"Unknown task {name!r}; choose clm, one of the GLUE tasks {list(GLUE_TASKS)}, or image.")
    return TASKS[name](name)
