"""The one room for what hf_neural_attn changes in other libraries, and for every private name of theirs it reads.

* :mod:`.installer`: the table of what ``import hf_neural_attn`` installs (``INTEGRATIONS``), and the opt-out:
  ``HF_NEURAL_ATTN_NO_INTEGRATIONS=1`` before the import, or :func:`uninstall` after it (:func:`install` undoes it).
* :mod:`.wrapping`: ``wrap_once`` and ``register``, the one way a method of another library is replaced or an entry
  added to its registry, each remembered so that it can be undone.
* :mod:`.internals`: every private name of transformers and torch the library reads, behind one accessor each.
* :mod:`.import_hooks`: run a function once a module is imported, by whoever imports it.
* transformers: :mod:`.attention_registry` (the attention function's name), :mod:`.auto_classes` (AutoConfig and the
  Auto classes), :mod:`.transformers_loading` (a model class's own ``from_pretrained``, ``save_pretrained`` and
  ``post_init``), :mod:`.transformers_hub` (``push_to_hub``'s card), :mod:`.continuous_batching`;
* torch, transformers and DeepSpeed parallelism: :mod:`.parallelism` (tensor-parallel plans and styles, context
  parallelism, the refusal of Ulysses);
* :mod:`.vllm`: vLLM, as a ``vllm.general_plugins`` entry point.

``tests/architecture/test_architecture.py`` checks that no module outside this folder assigns into another library or
reads its private names. This file imports nothing at its top, so that any floor of the library can use the accessors.
"""

from __future__ import annotations

import importlib

_FROM_INSTALL = ("INTEGRATIONS", "OPT_OUT_VARIABLE", "install", "installed", "uninstall")


def __getattr__(name: str):
    if name in _FROM_INSTALL:
        return getattr(importlib.import_module(f"{__name__}.installer"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_FROM_INSTALL})
