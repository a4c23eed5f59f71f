"""Processes and servers the tests start: CPU process groups over gloo, a free port, a server's health, a compile of
the Triton kernels for a GPU."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
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


# What every script compile_kernels_for_gpu runs starts with: the kernel folder and the fused-term contract it imports
# (ops/terms.py) imported alone, not through hf_neural_attn (no transformers): a bare parent package over the ops
# folder, whose own __init__ is not run; and compile_sm90, which compiles one kernel for an H100 (sm_90): bf16
# tensors, fp32 for the pointers in FP32, int32 for those in INT_POINTERS, int32 for the integer arguments.
KERNEL_COMPILE_PRELUDE = """
import importlib, inspect, sys, types
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

parent = types.ModuleType("standalone_ops")
parent.__path__ = [sys.argv[1]]
sys.modules["standalone_ops"] = parent
INTS = {"H", "GROUPS", "M", "N", "D", "HID", "REQUESTS", "TOKENS", "PAGE"}
FP32 = {"ROW_MAX", "ROW_SUM", "DELTA", "DGATE_PARTIAL", "DWO_PARTIAL", "GATE", "WO", "QV", "QB", "QC", "MASK"}
INT_POINTERS = {"BLOCK_TABLE", "SEQ_LENS", "QUERY_START"}


def kernels(module):
    return importlib.import_module("standalone_ops.triton." + module)


def compile_sm90(fn, constexprs, warps):
    signature = {}
    for name in inspect.signature(fn.fn).parameters:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name == "drop_threshold":
            signature[name] = "u32"  # round(p * 2**32) is above 2**31 - 1 from p = 0.5 on
        elif name in INTS or name.islower():  # sizes, strides, seeds and the like
            signature[name] = "fp32" if name in ("scaling", "drop_scale") else "i32"
        else:
            signature[name] = "*i32" if name in INT_POINTERS else "*fp32" if name in FP32 else "*bf16"
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    assert compiled.asm["cubin"], fn.__name__
"""


def compile_kernels_for_gpu(script: str, ops_folder: Path, cache: Path) -> str:
    """Run :data:`KERNEL_COMPILE_PRELUDE` then ``script`` (Python that compiles Triton kernels for a GPU, which this
    machine need not have, with the prelude's ``kernels`` and ``compile_sm90``) in a fresh interpreter, with the
    library's ``ops`` folder as its argument, Triton's cache in ``cache`` and its CPU interpreter off (a kernel
    decorated under ``TRITON_INTERPRET=1`` does not compile). Asserts that it exited 0 and returns its output."""
    env = {**os.environ, "TRITON_CACHE_DIR": str(cache)}
    env.pop("TRITON_INTERPRET", None)
    finished = subprocess.run(
        [sys.executable, "-c", KERNEL_COMPILE_PRELUDE + script, str(ops_folder)],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert finished.returncode == 0, finished.stderr[-3000:]
    return finished.stdout
