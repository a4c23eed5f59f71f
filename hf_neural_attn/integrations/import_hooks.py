"""Run a function right after a module is imported, whoever imports it, without importing it first.

``import hf_neural_attn`` must stay cheap (transformers' modeling stack takes seconds to import), yet some of what
the library sets up belongs to ``transformers.modeling_utils``: a transformers model class's own ``from_pretrained``
has to know a patched checkpoint by the time anyone calls it. :func:`after_import` runs a callback at once when
the module is already imported, and otherwise when its import finishes, from a finder on ``sys.meta_path`` that
wraps the module's loader (the post-import hook pattern of PEP 369, which Python never adopted).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import threading
from collections.abc import Callable
from types import ModuleType

_lock = threading.RLock()
_pending: dict[str, list[Callable[[ModuleType], None]]] = {}


def after_import(name: str, callback: Callable[[ModuleType], None]) -> None:
    """Call ``callback(module)`` once module ``name`` is imported: now if it is, else right after its import."""
    with _lock:
        module = sys.modules.get(name)
        if module is None:
            _pending.setdefault(name, []).append(callback)
            if _FINDER not in sys.meta_path:
                sys.meta_path.insert(0, _FINDER)
            return
    callback(module)


def constant_when_compiled(module_name: str, function_name: str) -> None:
    """Make ``module_name.function_name`` (a cached lookup whose result never changes in a process) a constant to
    torch.compile, once torch._dynamo is imported (a second's import: torch.compile does it before it traces).
    Without this, Dynamo traces through the cache on every compile and warns that it ignores the cache wrapper.
    The module must be imported (whole: a module still running its top has not defined the function yet). Callers
    must reach the function through its module's global name, which this rebinds."""

    def mark(dynamo: ModuleType) -> None:
        module = sys.modules[module_name]
        cached = getattr(module, function_name)

        def constant(*args):
            return cached(*args)

        constant.__name__ = constant.__qualname__ = function_name
        constant.__doc__ = cached.__doc__
        setattr(module, function_name, dynamo.assume_constant_result(constant))

    after_import("torch._dynamo", mark)


def _run_callbacks(name: str, module: ModuleType) -> None:
    with _lock:
        callbacks = _pending.pop(name, [])
        if not _pending and _FINDER in sys.meta_path:
            sys.meta_path.remove(_FINDER)
    for callback in callbacks:
        callback(module)


class _Loader(importlib.abc.Loader):
    """The module's own loader, then the callbacks."""

    def __init__(self, loader: importlib.abc.Loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        _run_callbacks(module.__name__, module)

    def __getattr__(self, name: str):  # get_source, get_code, is_package, ... as the wrapped loader has them
        return getattr(self.loader, name)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a module someone waits for, it asks the other finders and wraps the loader."""

    _searching = threading.local()

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in _pending or getattr(self._searching, "name", None) == fullname:
            return None
        self._searching.name = fullname
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._searching.name = None
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _Loader(spec.loader)
        return spec


_FINDER = _Finder()
