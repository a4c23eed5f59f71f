"""What the benchmark scripts share: SmolLM-135M's shape, the ``--device`` check, the scorers' options, the output
files' names, the machine's description, and which attention path the library's dispatch rule picked for a model's
calls.

The scripts run as ``python benchmarks/<script>.py``, which puts this folder first on ``sys.path``: they import
this module as ``common``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import sys

# HuggingFaceTB/SmolLM-135M's config (LlamaConfig fields): 30 layers x 576, 9 query heads on 3 kv heads of 64, vocab
# 49152. Its weights are not needed for timing, and the Hub is not reachable here.
SMOLLM_135M = {
    "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
    "num_key_value_heads": 3, "vocab_size": 49152, "tie_word_embeddings": True, "rope_theta": 10000.0,
}  # fmt: skip


def check_device(parser: argparse.ArgumentParser, device: str, *, present: bool = True) -> None:
    """Refuse a ``--device`` other than cpu, cuda or cuda:N; with ``present``, also a CUDA device torch does not
    see (a run that would fail at its first model, or time nothing)."""
    if not (device == "cpu" or device.startswith("cuda")):
        parser.error(f"--device {device!r}: use cpu, cuda or cuda:N")
    if present and device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            sys.exit(f"--device {device}, but torch.cuda.is_available() is False (torch {torch.__version__}).")


def scorer_options(scorer: str, proj_dim: int | None) -> dict:
    """``patch_model``'s options besides ``h``: ``--proj_dim`` for Neural Attention, else each at its default."""
    return {"proj_dim": proj_dim} if scorer == "neural" and proj_dim else {}


def device_suffix(device: str, dtype: str) -> str:
    """What the output files' names add on CUDA or in another dtype than fp32 (``_cuda_bf16``); nothing else."""
    return "" if device == "cpu" and dtype == "fp32" else f"_{device.split(':')[0]}_{dtype}"


def describe_machine(device: str) -> str:
    """The processor or GPU the run used, with the versions that decide what it measures."""
    import torch
    import transformers

    versions = f"torch {torch.__version__}, transformers {transformers.__version__}"
    if device.startswith("cuda"):
        try:
            import triton

            versions += f", triton {triton.__version__}"
        except ImportError:
            versions += ", no triton"
        return f"{torch.cuda.get_device_name(torch.device(device))}, {versions}"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as handle:
            cpu = next(line.split(":", 1)[1].strip() for line in handle if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} cores, {versions} (CPU)"


@contextlib.contextmanager
def recording_paths():
    """Record the path of each call of the library's dispatch rule (``hf_neural_attn.ops.dispatch.resolve_impl``,
    which turns a scorer's ``impl`` and a call's shapes into a path) made inside the block; yields the list of paths
    it fills. The rule is put back when the block ends, raised or not.

    Eager calls only: under ``torch.compile`` the rule runs while Dynamo traces, and a recording there is a side
    effect the compiled model replays and guards on, so it would recompile at every step (seen on CPU). The rule reads
    a call's shapes, dtype, device and mask, not whether ``torch.compile`` traces it, so an eager forward records the
    paths the compiled model runs too.
    """
    from hf_neural_attn.ops import dispatch

    original, paths = dispatch.resolve_impl, []

    def recorded(*args, **kwargs):
        paths.append(original(*args, **kwargs))
        return paths[-1]

    dispatch.resolve_impl = recorded
    try:
        yield paths
    finally:
        dispatch.resolve_impl = original


def paths_taken(paths: list[str]) -> str:
    """The distinct paths :func:`recording_paths` recorded, joined by ``+`` (``unknown`` if no call reached the
    rule)."""
    return "+".join(sorted(set(paths))) or "unknown"
