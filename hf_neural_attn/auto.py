"""Where every saved checkpoint's ``hf_neural_attn_loader.py`` imports :class:`PatchedCheckpointConfig` from.

The Auto-class registration lives in :mod:`hf_neural_attn.loading.auto`; this name stays importable for the loader
files already written beside checkpoints (``from hf_neural_attn.auto import PatchedCheckpointConfig``).
"""

from .loading.auto import PatchedCheckpointConfig

__all__ = ["PatchedCheckpointConfig"]
