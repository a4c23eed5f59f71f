"""What the installed packages allow: Triton present or not, transformers' PEFT integration refusing the installed PEFT."""

from __future__ import annotations

import importlib.util

import pytest
import transformers as tf

# --- Installed packages ------------------------------------------------------------------------------------------


def transformers_refuses_installed_peft() -> str | None:
    """Why transformers' own PEFT integration (``add_adapter``, ``load_adapter``, Auto classes over an adapter folder)
    refuses the installed PEFT, or None. transformers 5.24 asks for peft>=0.22, newer than PyPI's newest when it came
    out; the library's own PEFT paths (``get_peft_model``, PEFT's classes) do not go through that check. The tests
    of the integration run in ``make test-oldest`` (transformers 5.18) then."""
    try:
        import peft
        from transformers.integrations.peft import MIN_PEFT_VERSION
    except ImportError:
        return None  # no peft: those tests skip themselves; an older transformers without the constant checks nothing
    from packaging.version import Version

    if Version(peft.__version__) < Version(MIN_PEFT_VERSION):
        return (
            f"transformers {tf.__version__}'s PEFT integration needs peft>={MIN_PEFT_VERSION}, found {peft.__version__}"
        )
    return None


HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed: pip install -e '.[dev]'")
