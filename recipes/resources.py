"""What a run costs beside its time: the peak memory of the process (and of the accelerator), for all_results.json.

On Linux the process's peak resident set size (``VmHWM``) is reset at the start of training (writing ``5`` to
``/proc/self/clear_refs``), so that a sweep running many runs in one process reports each run's own peak, not the
largest so far; elsewhere (or where the reset is refused) the peak is the process's since it started, and says so.
The peak counts everything the process holds: Python, torch and the data, not only the model's tensors.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

STATUS = Path("/proc/self/status")
CLEAR_REFS = Path("/proc/self/clear_refs")


class PeakMemory:
    """Call :meth:`start` where the measured part begins and :meth:`read` where it ends."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.since = "process start"

    def start(self) -> None:
        try:
            CLEAR_REFS.write_text("5")  # resets the peak RSS to the current RSS (Linux >= 4.0)
            self.since = "training start"
        except OSError:
            logger.info("Peak memory: the process's peak cannot be reset here; it counts from the process start.")
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def read(self) -> dict[str, float | str | None]:
        """``peak_rss_mib`` (None where /proc is not there), ``peak_accelerator_mib`` (CUDA's peak of allocated
        tensors; None elsewhere) and ``since`` (training start, or process start where it could not be reset)."""
        rss = None
        if STATUS.is_file():
            for line in STATUS.read_text().splitlines():
                if line.startswith("VmHWM:"):
                    rss = int(line.split()[1]) / 1024  # kB -> MiB
        accelerator = None
        if self.device.type == "cuda":
            accelerator = torch.cuda.max_memory_allocated(self.device) / 2**20
        return {"peak_rss_mib": rss, "peak_accelerator_mib": accelerator, "since": self.since}
