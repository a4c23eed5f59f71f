"""The transformers releases this library runs on, in one place.

pyproject.toml's range is what pip enforces. The floor is checked again when the library is imported, for
environments pip did not resolve (``pip install --no-deps``, transformers changed afterwards), because below it
the failures are hard to read. What the suite met on older releases: 5.0-5.8 keep ViT's heads on an inner
module (``AttributeError`` when patching ViT); 5.9-5.12's Auto classes read a ``config_class`` from every class
mapped to them, which the patched-checkpoint loaders lack; GPT-2 before 5.16 drops ``encoder_attention_mask``
(cross-attention ignores encoder padding, patched or not); ``AutoImageProcessor`` before 5.18 needs torchvision
even for a PIL processor (the recipes' image task). A feature that needs a later release than the floor asks
:func:`transformers_at_least` and says which one.
"""

from __future__ import annotations

import transformers
from packaging.version import Version

# Keep equal to the floor of "transformers>=..." in pyproject.toml (tests/architecture/test_versions.py checks it); CI
# runs the core tests on exactly this release (`make test-oldest`).
MIN_TRANSFORMERS = "5.18"


def transformers_at_least(version: str, installed: str | None = None) -> bool:
    """Whether the installed transformers (or ``installed``) is ``version`` or later, as pip compares them."""
    return Version(installed or transformers.__version__) >= Version(version)


def check_transformers_version(installed: str | None = None) -> None:
    """Raise ``ImportError`` naming the needed release if transformers is older than :data:`MIN_TRANSFORMERS`."""
    installed = installed or transformers.__version__
    if not transformers_at_least(MIN_TRANSFORMERS, installed):
        raise ImportError(
            f"hf_neural_attn needs transformers>={MIN_TRANSFORMERS}, found {installed}: "
            f'pip install "transformers>={MIN_TRANSFORMERS}"'
        )
