"""The shapes a call of the patched attention comes in, as one table beside the paths (``ops.dispatch.PATHS``).

A call's shape says how it is cut before a path scores it; its path (``ops.dispatch.resolve_impl``) says how each
cut is scored. Four shapes show in the call itself (its keyword arguments, the module's base, torch's state) and are
told in one place, ``hf_neural_attn.attention.call_shape``; the fifth, a padded batch split into its sequences, is
the dispatcher's (``ops.dispatch.scored_attention``), because only the blocked paths gain from the split and only
outside ``torch.compile`` may the mask's values be read. This module imports nothing: the table is data.
"""

from __future__ import annotations

from dataclasses import dataclass

PAGED = "paged"
PACKED = "packed"
CONTEXT = "context"
ORDINARY = "ordinary"
PADDED = "padded"


@dataclass(frozen=True)
class CallShape:
    """One shape: how such a call looks (``what``), how it is served (``served``), and the one function that tells
    it (``told_by``)."""

    what: str
    served: str
    told_by: str


CALL_SHAPES: dict[str, CallShape] = {
    PAGED: CallShape(
        "the model's base keeps its keys in a serving engine's paged cache (a base in attention.PAGED_BASES: vLLM)",
        "the engine's function: the call's keys written to the cache, each sequence's read back, then the paged "
        "kernel or the keys-carried shapes below (hf_neural_attn.paged_attention)",
        "hf_neural_attn.attention.call_shape",
    ),
    PACKED: CallShape(
        "several sequences end to end in one row, batch 1 (cu_seq_lens_q / cu_seq_lens_k: continuous batching, "
        "packed training batches)",
        "one sequence at a time against its own keys, the decoding requests of an eval call as one padded batch "
        "(ops.packed; attention.decoding_attention); refused under context parallelism",
        "hf_neural_attn.attention.call_shape",
    ),
    CONTEXT: CallShape(
        "torch's context_parallel block is open: this process holds a slice of the sequence",
        "this process's queries against every process's keys, gathered (ops.context_parallel)",
        "hf_neural_attn.attention.call_shape",
    ),
    ORDINARY: CallShape(
        "(batch, heads, q_len, head_dim) queries against the call's own keys",
        "one call of the path resolve_impl picks (ops.dispatch.scored_attention)",
        "hf_neural_attn.attention.call_shape",
    ),
    PADDED: CallShape(
        "an ordinary call whose mask gives its rows different keys (padding), on a blocked path, not compiled",
        "one sequence at a time, each with only its own keys (ops.sequences.padded_sequences); the reference path, "
        "the kernels and scorers that are not softmax attention take the batch whole",
        "hf_neural_attn.ops.dispatch.scored_attention",
    ),
}
