"""DeepSpeed's Ulysses registration refuses a patched model (the ``"Ulysses refusal"`` row of ``INTEGRATIONS``).

accelerate's ``sp_size`` calls ``UlyssesSPAttentionHF.register_with_transformers``, which wraps the model's attention
function to trade the sequence for the heads; the scorers cannot follow (``hf_neural_attn.parallel.sequence``). Here
that call refuses a patched model, or the library's implementation named as the core, in the library's words before
DeepSpeed sets anything up.
"""

from __future__ import annotations

import functools
from types import ModuleType

from ..compat.internals import attn_implementation_of
from ..parallel.sequence import SEQUENCE_PARALLEL_REFUSAL
from .wrapping import wrap_once


def install(ulysses: ModuleType, *, attn_implementation: str) -> None:
    """Wrap ``ulysses.UlyssesSPAttentionHF.register_with_transformers`` so that it refuses a model whose config runs
    ``attn_implementation``, or that implementation named as the core. Another DeepSpeed layout is left alone (the
    check at the first scored call still refuses)."""
    hub = getattr(ulysses, "UlyssesSPAttentionHF", None)
    if not isinstance(vars(hub).get("register_with_transformers") if hub is not None else None, classmethod):
        return

    def refusing(original):
        @functools.wraps(original)
        def register_with_transformers(
            cls, model_name_or_path, core_attn_implementation, sequence_parallel_size, *args, **kwargs
        ):
            config = getattr(model_name_or_path, "config", None)
            patched = config is not None and attn_implementation_of(config) == attn_implementation
            if sequence_parallel_size != 1 and (patched or core_attn_implementation == attn_implementation):
                raise ValueError(SEQUENCE_PARALLEL_REFUSAL)
            return original(cls, model_name_or_path, core_attn_implementation, sequence_parallel_size, *args, **kwargs)

        return register_with_transformers

    wrap_once(hub, "register_with_transformers", refusing)
