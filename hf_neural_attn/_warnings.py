"""Warnings that point at the user's line, however deep in the library (or in transformers) they are raised."""

from __future__ import annotations

import os
import sys
import warnings

import transformers

_LIBRARY_DIRS = tuple(os.path.dirname(os.path.abspath(path)) + os.sep for path in (__file__, transformers.__file__))


def warn_user(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` with the warning attributed to the first caller outside hf_neural_attn and transformers.

    A fixed ``stacklevel`` counts frames, which any refactoring or a call through transformers' Auto classes
    (user -> AutoModel.from_pretrained -> our loader -> ...) shifts; this finds the caller instead.
    """
    level, frame = 2, sys._getframe(1)  # stacklevel 2 is warn_user's caller
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_LIBRARY_DIRS):
        frame = frame.f_back
        level += 1
    warnings.warn(message, category, stacklevel=level)
