"""pytest fixtures shared by the tests; the helpers themselves live in the ``helpers`` package (tests/helpers/, one
module per subject: models, scorers, checkpoints, references, paths, installed, processes)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from durations_by_file import FILE_SECONDS, slowest_files_first
from helpers.models import CORE_FAMILIES
from helpers.scorers import FUSED_SCORERS

from hf_neural_attn.ops import dispatch
from hf_neural_attn.ops.triton import launch

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs the files on two pytest-xdist workers, one per core of the 2-core machines the suite is
    # sized for. A worker with two intra-op threads beside another busy worker stalls far more than it gains (the
    # threads spin waiting for a core), so each worker and the processes its tests start use one thread; a test
    # that needs another count sets it for its own process.
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """The slowest files first (tests/file_seconds.json, written by tests/durations_by_file.py --json). With
    ``--dist loadfile --no-loadscope-reorder`` (`make test`) the xdist workers take the files in this order, so the
    long ones that start processes do not come last, leaving one worker to run them alone while the other idles."""
    seconds = json.loads(FILE_SECONDS.read_text()) if FILE_SECONDS.exists() else {}
    items[:] = slowest_files_first(items, seconds)


@pytest.fixture(params=CORE_FAMILIES)
def family(request) -> str:
    """The name of each core family (FAMILY_CASES rows with core=True)."""
    return request.param


@pytest.fixture(params=FUSED_SCORERS)
def scorer_name(request) -> str:
    """The name of each scorer with a fused form (helpers.scorers.FUSED_SCORERS)."""
    return request.param


@pytest.fixture
def interpreter(monkeypatch):
    """Triton's CPU interpreter, with 4 x 4 tiles forward and 8 x 4 backward.

    ``TRITON_INTERPRET=1`` must be set when a ``@triton.jit`` function is decorated. Our kernels are
    imported lazily, so setting it here is early enough for them. But transformers imports
    ``torch._dynamo``, which imports triton, before any test module runs, so triton.language's own jitted
    helpers (``tl.zeros``, ``tl.sum``, ...) were decorated for compilation, and calling them from an
    interpreted kernel raises. Those calls are routed to the interpreter here, as they would be had the
    variable been set before Python started (running ``TRITON_INTERPRET=1 pytest`` needs no routing).
    """
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(launch, "BLOCK_SIZES", (4, 4))
    # Backward tiles differ from forward ones, as on a GPU: row statistics must not depend on the tiling.
    monkeypatch.setattr(launch, "BACKWARD_BLOCK_SIZES", (8, 4))
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    import hf_neural_attn.ops.triton.common as kernels

    if not isinstance(kernels.forward_kernel, InterpretedFunction):
        pytest.skip("the Triton kernels were imported without TRITON_INTERPRET=1 in this process")
    if isinstance(tl.zeros, JITFunction):
        interpreted = {}

        def call_in_interpreter(self, *args, **kwargs):
            if self.fn not in interpreted:
                interpreted[self.fn] = InterpretedFunction(self.fn)
            return interpreted[self.fn](*args, **kwargs)

        monkeypatch.setattr(JITFunction, "__call__", call_in_interpreter)


@pytest.fixture
def triton_calls(monkeypatch):
    """Counts calls that reach the Triton path, so a silent fallback cannot pass for a kernel result."""
    calls = []

    original = dispatch.PATHS["triton"]

    def spy(*args, **kwargs):
        calls.append(args[1].shape)
        return original(*args, **kwargs)

    monkeypatch.setitem(dispatch.PATHS, "triton", spy)
    return calls


@pytest.fixture
def paths_taken(monkeypatch):
    """The compute paths (keys of dispatch.PATHS) that served each attention call, in order."""
    taken = []
    for name, path in list(dispatch.PATHS.items()):

        def spy(*args, _name=name, _path=path, **kwargs):
            taken.append(_name)
            return _path(*args, **kwargs)

        monkeypatch.setitem(dispatch.PATHS, name, spy)
    return taken


@pytest.fixture(scope="module")
def hub_server():
    """A Hub-compatible server on 127.0.0.1 (tests/hub_server.py), one per test module; a request it does not know
    fails the module's last test at teardown."""
    from hub_server import HubServer

    server = HubServer().start()
    yield server
    server.stop()
    assert not server.unknown_requests, f"Hub endpoints tests/hub_server.py does not answer: {server.unknown_requests}"
