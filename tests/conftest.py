"""pytest fixtures shared by the tests; the helpers themselves live in ``helpers.py``."""

from __future__ import annotations

import pytest
from helpers import CORE_FAMILIES, SCORER_NAMES


@pytest.fixture(params=CORE_FAMILIES)
def family(request) -> str:
    """The name of each core family (FAMILY_CASES rows with core=True)."""
    return request.param


@pytest.fixture(params=SCORER_NAMES)
def scorer_name(request) -> str:
    return request.param
