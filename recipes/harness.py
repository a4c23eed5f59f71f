"""Evaluation with EleutherAI's lm-evaluation-harness (``lm_eval``), on the model in memory.

The harness's ``HFLM`` takes a model object, so a patched model is evaluated as it is: no save and reload, no
``trust_remote_code``. The same function serves a saved checkpoint (load it with ``hf_neural_attn.from_pretrained``
first) and the recipes' ``--lm_eval_tasks``::

    import hf_neural_attn
    from recipes.harness import evaluate_with_harness

    model = hf_neural_attn.from_pretrained("outputs/clm-qana")
    results = evaluate_with_harness(model, tokenizer, ["wikitext", "hellaswag"])

Task names are the harness's own (its ``wikitext`` downloads WikiText-2 from the Hub). ``include_path`` adds a
folder of task YAML files, which is how a task runs offline: a ``dataset_path: json`` task over a local file
(``tests/recipes/test_harness.py`` writes one).

Why the harness's ``wikitext`` numbers differ from the recipes' perplexity: the recipes report *token*
perplexity, ``exp`` of the mean loss per token of the model's tokenizer, over sliding windows of
``--block_size``. The harness's ``word_perplexity`` divides the same kind of total log-likelihood by the number of
*words* of each document (``byte_perplexity`` by bytes, ``bits_per_byte`` in bits), scoring each whole document
in rolling windows of the model's ``max_length``. Words are longer than tokens, so word perplexity is much
larger; only the per-byte numbers compare across tokenizers.
"""

from __future__ import annotations

import math
import os
from typing import Any

HARNESS_INSTALL_HINT = "lm-evaluation-harness is not installed: pip install 'hf-neural-attn[recipes]' (or lm-eval)"


def import_harness():
    """``lm_eval``'s entry points, or an ImportError with the install hint."""
    try:
        from lm_eval import simple_evaluate
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager
    except ImportError as error:
        raise ImportError(HARNESS_INSTALL_HINT) from error
    return simple_evaluate, HFLM, TaskManager


def evaluate_with_harness(
    model,
    tokenizer,
    tasks: list[str],
    *,
    include_path: str | None = None,
    include_defaults: bool | None = None,
    batch_size: int = 8,
    max_length: int | None = None,
    limit: float | None = None,
    device: str | None = None,
) -> dict[str, dict[str, float]]:
    """Run the harness's ``tasks`` on ``model`` (a transformers causal LM, patched or not) with ``tokenizer``.

    Args:
        include_path: a folder of extra task definitions (YAML), e.g. local-data tasks for offline runs.
        include_defaults: also index the harness's own tasks (thousands of files, which takes seconds); None (the
            default) indexes them only when ``include_path`` does not define every task asked for.
        max_length: the context the harness gives the model (default: the model's ``max_position_embeddings`` or
            ``n_positions``).
        limit: evaluate only this many documents per task (or this fraction), as the harness's ``--limit``.
        device: where the harness puts inputs (default: the model's device).

    Returns:
        task -> metric -> value: the harness's own metric names (``word_perplexity``, ``acc``, ``acc_norm``, ...),
        with its filter suffix (``,none``) dropped; standard errors as ``<metric>_stderr`` where it gives one.
    """
    simple_evaluate, HFLM, _ = import_harness()
    manager = task_manager(tasks, include_path, include_defaults)
    model.eval()
    if max_length is None:
        config = model.config
        max_length = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    device = device or str(next(model.parameters()).device)
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, max_length=max_length, device=device)
    output = simple_evaluate(model=lm, tasks=list(tasks), task_manager=manager, limit=limit, log_samples=False)
    return {task: _metrics(values) for task, values in output["results"].items()}


def task_manager(tasks: list[str], include_path: str | None = None, include_defaults: bool | None = None):
    """The harness's ``TaskManager`` for ``tasks``: over ``include_path`` alone when it defines them all (indexing
    the harness's own thousands of task files takes seconds), else with the harness's tasks too.

    Raises:
        ValueError: ``include_path`` is not a folder.
    """
    _, _, TaskManager = import_harness()
    if include_path is not None and not os.path.isdir(include_path):
        raise ValueError(f"include_path {include_path!r} is not a folder of harness task definitions (YAML).")
    if include_path and include_defaults is not True:
        manager = TaskManager(include_path=include_path, include_defaults=False)
        if include_defaults is False or set(tasks) <= set(manager.all_tasks):
            return manager
    return TaskManager(include_path=include_path)


def check_tasks(tasks: list[str], include_path: str | None = None) -> None:
    """Make sure the harness can run ``tasks``, before a run trains: each names a task (or group) the harness knows,
    and its data loads (offline, ``HF_HUB_OFFLINE=1``, only data already on this machine does). This loads the
    tasks' data once, which takes as long as the harness itself takes to start them.

    Raises:
        ValueError: naming the tasks that are unknown or whose data cannot be loaded, and why.
    """
    manager = task_manager(tasks, include_path)
    unknown = [name for name in tasks if not manager.match_tasks([name])]
    if unknown:
        where = f" (or in {include_path})" if include_path else ""
        raise ValueError(
            f"lm-evaluation-harness has no task {', '.join(map(repr, unknown))}{where}: `lm-eval ls tasks` lists them."
        )
    try:
        manager.load(list(tasks))
    except Exception as error:  # the harness and datasets raise many kinds; any means the task cannot run here
        offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "") or os.environ.get("HF_DATASETS_OFFLINE")
        unreachable = _unreachable(error)
        hint = (
            " In offline mode a task's data must already be on this machine: use a task over local files "
            "(--lm_eval_include_path), or run online once to cache it."
            if offline and unreachable
            else ""
        )
        what = f"the data of {', '.join(tasks)}" if unreachable else ", ".join(tasks)
        message = str(error).strip().splitlines()[0].rstrip(".") if str(error).strip() else type(error).__name__
        raise ValueError(f"lm-evaluation-harness cannot load {what}: {message}.{hint}") from None


def _unreachable(error: BaseException) -> bool:
    """Whether ``error`` (or an error it was raised from) says that data could not be reached: a connection error
    (what datasets and the Hub clients raise in offline mode too), or a Hub file neither cached nor downloadable. A
    task definition's own error (a template, a missing local file, a bad key) is not."""
    from huggingface_hub.errors import LocalEntryNotFoundError

    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, (ConnectionError, LocalEntryNotFoundError)):
            return True
        error = error.__cause__ or error.__context__
    return False


def _metrics(values: dict[str, Any]) -> dict[str, float]:
    """The numeric metrics of one task's harness results, names without the filter suffix."""
    metrics = {}
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or name == "sample_len":
            continue
        metric, _, _filter = name.partition(",")
        if isinstance(value, float) and math.isnan(value):
            continue
        metrics[metric] = float(value)
    return metrics
