"""Running a sweep's plan: each run not finished yet, in order, resuming an interrupted one from its checkpoint.

Several sweep processes may run the same plan side by side (e.g. one per core, each with ``OMP_NUM_THREADS=1``):
each claims a run by creating ``sweep_run.lock`` in its folder, and skips the runs another live process holds. A lock
left by a process that died on this machine is taken over. Under ``accelerate launch`` (several ranks run every run
together) there is no claiming.
"""

from __future__ import annotations

import copy
import gc
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any

from recipes import checkpointing, training
from recipes.report import RESULTS_FILE, write_json
from recipes.sweep.plan import RUN_LOCK, RUN_RECORD, Run, RunStatuses, SweepPlan

logger = logging.getLogger("recipes")


def is_main_process() -> bool:
    """Under ``accelerate launch`` every process plans and runs; only the first writes the sweep's own files."""
    return os.environ.get("RANK", "0") == "0"


def distributed() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def claim(run: Run) -> bool:
    """Take ``run`` for this process; False if another live sweep process holds it (or finished it meanwhile)."""
    if distributed():
        return True
    run.output_dir.mkdir(parents=True, exist_ok=True)
    lock = run.output_dir / RUN_LOCK
    me = f"{socket.gethostname()} {os.getpid()}"
    for _ in range(2):
        try:
            descriptor = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            if not stale(lock):
                return False
            lock.unlink(missing_ok=True)
            continue
        with os.fdopen(descriptor, "w") as file:
            file.write(me)
        if (run.output_dir / RESULTS_FILE).is_file():  # another process finished it after this one planned
            release(run)
            return False
        return True
    return False


def stale(lock: Path) -> bool:
    """Whether a lock's process is gone: on this machine, a pid no longer running (elsewhere: never stale)."""
    try:
        host, pid = lock.read_text().split()
    except (OSError, ValueError):
        return False  # being written right now, or not ours to judge
    return host == socket.gethostname() and not process_alive(int(pid))


def release(run: Run) -> None:
    if not distributed():
        (run.output_dir / RUN_LOCK).unlink(missing_ok=True)


def run_sweep(plan: SweepPlan, statuses: RunStatuses) -> list[dict[str, Any]]:
    """Run what is not finished, in order (``statuses``: :func:`recipes.sweep.plan.check_run_folders`'); returns what
    happened to each run: ``configuration``, ``seed``, ``output_dir`` and ``action`` (skipped, started, resumed
    from ...), with ``wall_s`` for the runs that ran."""
    log = []
    runs = plan.runs()
    for index, run in enumerate(runs, 1):
        entry = {"configuration": run.configuration, "seed": run.seed, "output_dir": str(run.output_dir)}
        if statuses[run.configuration, run.seed] == "done":
            logger.info(
                "Sweep run %d/%d %s seed %d: finished before, skipped", index, len(runs), run.configuration, run.seed
            )
            log.append({**entry, "action": "skipped"})
            continue
        if not claim(run):
            logger.info(
                "Sweep run %d/%d %s seed %d: another sweep process runs it, skipped",
                index,
                len(runs),
                run.configuration,
                run.seed,
            )
            log.append({**entry, "action": "skipped (another process)"})
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
        try:
            training.run(copy.deepcopy(run.args))
        finally:
            release(run)
        log.append({**entry, "action": action, "wall_s": time.time() - started})
        gc.collect()
        try:
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except ImportError:
            pass
    return log
