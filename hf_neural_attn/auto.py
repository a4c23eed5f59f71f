"""Where every saved checkpoint's ``hf_neural_attn_loader.py`` imports :class:`PatchedCheckpointConfig` from.

The class lives in :mod:`hf_neural_attn.patched_config`; this name stays importable for the loader files already
written beside checkpoints (``from hf_neural_attn.auto import PatchedCheckpointConfig``).
"""

from .patched_config import PatchedCheckpointConfig

__all__ = ["PatchedCheckpointConfig"]
