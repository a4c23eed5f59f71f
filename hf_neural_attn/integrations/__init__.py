"""The one room for what hf_neural_attn changes in other libraries, each change a row of one table.

* :mod:`.installer`: the table of what ``import hf_neural_attn`` installs (``INTEGRATIONS``), and the opt-out:
  ``HF_NEURAL_ATTN_NO_INTEGRATIONS`` before the import (``1`` for every optional row, or the names of some rows), or
  :func:`uninstall` after it (:func:`install` undoes it).
* :mod:`.wrapping`: ``wrap_once`` and ``register``, the one way a method of another library is replaced or an entry
  added to its registry, each remembered so that it can be undone.
* :mod:`.import_hooks`: run a function once a module is imported, by whoever imports it.
* transformers: :mod:`.attention_registry` (names in the attention registries: the patched attention function, the
  family probe), :mod:`.auto_classes` (AutoConfig and the Auto classes), :mod:`.transformers_loading` (a model
  class's own ``from_pretrained``, ``save_pretrained`` and ``post_init``), :mod:`.transformers_hub` (``push_to_hub``'s
  card), :mod:`.continuous_batching`; the library's tensor-parallel styles (made in ``hf_neural_attn.parallel.tensor``,
  registered by the installer);
* DeepSpeed: :mod:`.deepspeed_ulysses` (Ulysses' registration refuses a patched model);
* :mod:`.vllm`: vLLM, as a ``vllm.general_plugins`` entry point.

The private names of other libraries the rest of the library reads are behind the accessors of
``hf_neural_attn.compat.internals``, on the ground floor (this folder imports the whole library; the floors below
could not import it). ``tests/architecture/test_architecture.py`` checks that no module outside this folder changes
another library and none outside it and ``compat/`` reads their private names. This file imports nothing at its top.
"""

from __future__ import annotations

import importlib

_FROM_INSTALL = ("INTEGRATIONS", "OPT_OUT_VARIABLE", "enabled_rows", "install", "installed", "uninstall")


def __getattr__(name: str):
    if name in _FROM_INSTALL:
        return getattr(importlib.import_module(f"{__name__}.installer"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_FROM_INSTALL})
