"""Processes and servers the tests start: CPU process groups over gloo, a free port, a server's health."""

from __future__ import annotations

import os
import socket
import urllib.request
from collections.abc import Callable
from pathlib import Path

import torch


def launch_processes(worker: Callable[[int, str], dict], root: Path, world: int = 2) -> dict:
    """Run ``worker(rank, root)`` on ``world`` CPU processes joined over gloo (as torchrun would set them up: its
    environment variables, which transformers reads, one thread each) and return what process 0's call returned.
    ``worker`` must be a module-level function (the processes are spawned)."""
    import torch.multiprocessing as mp

    mp.start_processes(_process_main, args=(worker, str(root), world), nprocs=world, start_method="spawn")
    return torch.load(Path(root) / "results.pt")


def _process_main(rank: int, worker: Callable[[int, str], dict], root: str, world: int) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    # A collective that one process never reaches fails after the timeout instead of hanging the suite.
    dist.init_process_group(
        "gloo", init_method=f"file://{root}/init", rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )
    results = worker(rank, root)
    if rank == 0:
        torch.save(results, f"{root}/results.pt")
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    """A TCP port on 127.0.0.1 nothing listens on, for a server a test starts."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def healthy(url: str) -> bool:
    """Whether the server at ``url`` answers its ``/health`` endpoint (transformers serve's and vLLM's) with 200."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
            return response.status == 200
    except OSError:
        return False
