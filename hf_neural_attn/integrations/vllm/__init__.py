"""vLLM serves patched checkpoints with their scorers: a vLLM plugin (``pip install 'hf-neural-attn[vllm]'``).

vLLM loads :func:`register` in each of its processes through the ``vllm.general_plugins`` entry point that this
package declares, so ``vllm serve PATH``, its OpenAI server and ``LLM(model=PATH)`` need no import of the library in
the user's code. What it sets up:

1. ``import hf_neural_attn``: a patched checkpoint's config.json reads as the library's config class, with its
   record (no remote code to trust);
2. vLLM's architecture resolution sends a patched config to :class:`~.model.PatchedTransformersForCausalLM`, vLLM's
   Transformers modeling backend with the scorers (:mod:`.routing`); unpatched models resolve as before;
3. a patched model whose base implementation is vLLM's reads its keys from vLLM's paged cache (:mod:`.paged`).

docs/serving.md says what is served, what is refused and what it costs.
"""

from __future__ import annotations

_registered = False


def register() -> None:
    """The ``vllm.general_plugins`` entry point: vLLM calls it in each of its processes, perhaps several times."""
    global _registered
    if _registered:
        return
    from . import paged, routing

    routing.install()
    paged.register()
    _registered = True
