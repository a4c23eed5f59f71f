"""Sequence parallelism (DeepSpeed's Ulysses, accelerate's ``sp_size``): refused, by name.

Ulysses trades the sequence for the heads around the attention function it wraps; the scorers' per-query inputs and
per-head parameters are not traded with them. The integrations refuse it where DeepSpeed registers a model
(``integrations/deepspeed_ulysses.py``, a row of ``INTEGRATIONS``); :func:`check_no_sequence_parallelism` catches, at
the first scored call, a run whose registration they did not see (one that named the model by path).
"""

from __future__ import annotations

import torch

from ..compat.internals import ulysses_sequence_parallel_group

SEQUENCE_PARALLEL_REFUSAL = (
    "hf_neural_attn does not support DeepSpeed's Ulysses sequence parallelism (accelerate's sp_size): Ulysses trades "
    "the sequence for the heads around the attention function it wraps, and the scorers' per-query inputs and "
    "per-head parameters are not traded with them. For long sequences use context parallelism instead (torch's "
    "context_parallel, accelerate's cp_size), which hf_neural_attn supports; for memory, tensor parallelism, FSDP2 "
    'or ZeRO-3 (docs/api.md ("Tensor, context and sequence parallelism")).'
)


# Read once per trace under torch.compile: traced, the lookup in sys.modules would guard on its length, and every
# import after the first call (any lazy import in transformers) would compile the model again.
@torch.compiler.assume_constant_result
def _sequence_parallel_size() -> int:
    group = ulysses_sequence_parallel_group()
    return 1 if group is None else torch.distributed.get_world_size(group=group)


def check_no_sequence_parallelism() -> None:
    """Refuse to score while DeepSpeed's sequence-parallel groups are set up: the sequence is split over the
    processes."""
    if _sequence_parallel_size() > 1:
        raise ValueError(SEQUENCE_PARALLEL_REFUSAL)
