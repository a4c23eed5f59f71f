"""Context parallelism as a patched model meets it: whether torch's ``context_parallel`` block is open, and what the
scorers refuse under one, by name.

torch's ``context_parallel`` (what accelerate's ``cp_size`` runs) shards the sequence over the processes and swaps
``scaled_dot_product_attention`` for a ring version. The patched attention asks :func:`context_parallel_shards` on
every call; under a block it scores through ``hf_neural_attn.ops.context_parallel.attention_across_ranks`` (every
process's keys gathered), and what that cannot make right is refused here or there, by name.
"""

from __future__ import annotations

import torch
from torch import nn

from ..compat.internals import torch_context_parallel
from ..ops.context_parallel import CONTEXT_PARALLEL_HELP, ContextShards
from ..scorers import Scorer


def context_parallel_shards() -> ContextShards | None:
    """torch's ``context_parallel`` as it stands now (the block is open: torch has swapped
    ``scaled_dot_product_attention`` for its ring version), or None.

    Raises:
        RuntimeError: it is open, and its mesh cannot be read (a torch whose layout this does not know): never a
            silent local-only score.
    """
    state = torch_context_parallel()
    if state is None:
        return None
    mesh, load_balanced = state
    if mesh is None or load_balanced is None:
        raise RuntimeError(
            "hf_neural_attn found torch's context parallelism active but cannot read its mesh from this torch "
            f"({torch.__version__}), so it cannot score across the processes; it refuses rather than score each "
            f"process's keys alone. Run without context parallelism ({CONTEXT_PARALLEL_HELP})."
        )
    return ContextShards(mesh, load_balanced)


def check_context_parallel_scorer(scorer: Scorer) -> None:
    """Refuse a scorer whose outputs mix queries (NSEA) under context parallelism: each process holds some of them."""
    if scorer.mixes_queries:
        raise ValueError(
            f"hf_neural_attn cannot run the {scorer.name!r} scorer under context parallelism: each of its outputs "
            "depends on every query, and each process holds a slice of the queries. Run it without context "
            f"parallelism ({CONTEXT_PARALLEL_HELP})."
        )


def packed_call_refused() -> ValueError:
    """The error for a packed call (``cu_seq_lens_q``: several sequences in one row) under context parallelism: each
    process holds a slice of the row, and the sequences' bounds are the whole row's."""
    return ValueError(
        "hf_neural_attn cannot score a packed call (cu_seq_lens_q / cu_seq_lens_k: several sequences in one row) "
        "under context parallelism: each process holds a slice of the row, which the sequences' bounds do not "
        f"describe. Pass the sequences as a batch, or run packed calls without context parallelism ({CONTEXT_PARALLEL_HELP})."
    )


def refuse_unscored_under_context_parallelism(implementation: str, module: nn.Module) -> None:
    """A module the patch does not score runs its base implementation; under context parallelism only SDPA's is
    swapped for torch's ring, so an eager base would attend within each process's slice: refused."""
    if implementation != "sdpa":
        raise ValueError(
            f"hf_neural_attn cannot run {type(module).__name__}, a module it does not score, on the {implementation!r} "
            "base under context parallelism: torch's context parallelism replaces SDPA only, so it would attend "
            "within each process's slice of the sequence. Set the model's base to SDPA "
            f"(model.set_attn_implementation('sdpa')), or patch every layer ({CONTEXT_PARALLEL_HELP})."
        )
