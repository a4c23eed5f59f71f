"""pytest fixtures shared by the tests; the helpers themselves live in ``helpers.py``."""

from __future__ import annotations

import pytest
from helpers import FACTORIES, SCORER_NAMES


@pytest.fixture(params=list(FACTORIES))
def family(request) -> str:
    return request.param


@pytest.fixture(params=SCORER_NAMES)
def scorer_name(request) -> str:
    return request.param
