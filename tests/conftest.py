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


@pytest.fixture(scope="module")
def hub_server():
    """A Hub-compatible server on 127.0.0.1 (tests/hub_server.py), one per test module; a request it does not know
    fails the module's last test at teardown."""
    from hub_server import HubServer

    server = HubServer().start()
    yield server
    server.stop()
    assert not server.unknown_requests, f"Hub endpoints tests/hub_server.py does not answer: {server.unknown_requests}"
