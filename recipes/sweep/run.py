"""Running a sweep's plan: each run not finished yet, in order, resuming an interrupted one from its checkpoint."""

from __future__ import annotations

import copy
import gc
import logging
import os
import time
from typing import Any

from recipes import checkpointing, finetune
from recipes.report import write_json
from recipes.sweep.plan import RUN_RECORD, SweepPlan

logger = logging.getLogger("recipes")


def is_main_process() -> bool:
    """Under ``accelerate launch`` every process plans and runs; only the first writes the sweep's own files."""
    return os.environ.get("RANK", "0") == "0"


def run_sweep(plan: SweepPlan) -> list[dict[str, Any]]:
    """Run what is not finished, in order (:func:`recipes.sweep.plan.check_run_folders` sets what is); returns what
    happened to each run: ``configuration``, ``seed``, ``output_dir`` and ``action`` (skipped, started, resumed
    from ...), with ``wall_s`` for the runs that ran."""
    log = []
    runs = plan.runs()
    for index, run in enumerate(runs, 1):
        entry = {"configuration": run.configuration, "seed": run.seed, "output_dir": str(run.output_dir)}
        if run.status == "done":
            logger.info(
                "Sweep run %d/%d %s seed %d: finished before, skipped", index, len(runs), run.configuration, run.seed
            )
            log.append({**entry, "action": "skipped"})
            continue
        latest = checkpointing.find_latest(run.output_dir)
        action = f"resumed from {latest.name}" if latest is not None else "started"
        logger.info("Sweep run %d/%d %s seed %d: %s", index, len(runs), run.configuration, run.seed, action)
        if is_main_process():
            run.output_dir.mkdir(parents=True, exist_ok=True)
            write_json(
                run.output_dir / RUN_RECORD,
                {
                    "sweep": str(plan.config_path or plan.name),
                    "grid": plan.grid,
                    "configuration": run.configuration,
                    "seed": run.seed,
                    "settings": run.key,
                },
            )
        started = time.time()
        finetune.run(copy.deepcopy(run.args))
        run.status = "done"
        log.append({**entry, "action": action, "wall_s": time.time() - started})
        gc.collect()
        try:
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except ImportError:
            pass
    return log
