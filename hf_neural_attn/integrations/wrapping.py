"""``wrap_once``: the one way the library replaces an attribute of another library (a method of a transformers class,
a function of one of its modules), ``register`` the one way it adds an entry to another library's registry (an Auto
class's mapping), and ``undo_all``, which puts every original back and takes every entry out again.

Each replacement is recorded, so that :func:`hf_neural_attn.integrations.uninstall` can undo them all, and a second
``wrap_once`` of the same attribute (a module imported twice, a plugin entry point vLLM calls in every process) does
nothing. The wrapped function is what ``make_wrapper`` is given whether the attribute is a plain function, a
``classmethod`` or a ``staticmethod``; the replacement is put back in the same kind of descriptor.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any

from ..compat.internals import forget_registered

# Set on every function wrap_once puts in place: how a second call (or a reader) tells ours from the original.
WRAPPED_MARK = "__hf_neural_attn_wrapped__"

_lock = threading.RLock()


@dataclasses.dataclass(frozen=True)
class Replacement:
    """One attribute of another library that the library replaced: ``owner.name`` was ``original`` (as it sat in
    ``vars(owner)``: a classmethod stays a classmethod) and is now ``replacement``."""

    owner: Any
    name: str
    original: Any
    replacement: Any

    def describe(self) -> str:
        owner = getattr(self.owner, "__qualname__", None) or getattr(self.owner, "__name__", repr(self.owner))
        module = getattr(self.owner, "__module__", None)
        return f"{module}.{owner}.{self.name}" if module and isinstance(self.owner, type) else f"{owner}.{self.name}"


_REPLACEMENTS: list[Replacement] = []


def _function_of(attribute: Any) -> Callable:
    return attribute.__func__ if isinstance(attribute, (classmethod, staticmethod)) else attribute


def is_wrapped(function: Any) -> bool:
    """Whether ``function`` (or the function a classmethod/staticmethod holds) was put in place by :func:`wrap_once`."""
    return bool(getattr(_function_of(function), WRAPPED_MARK, False))


def wrap_once(owner: Any, name: str, make_wrapper: Callable[[Callable], Callable]) -> bool:
    """Replace ``owner.name`` (a class's or a module's own attribute) by ``make_wrapper(original)``, unless it is
    already a wrapper of ours. Returns whether it replaced it.

    Raises:
        AttributeError: ``owner`` has no attribute ``name`` of its own (another release of that library moved it);
            nothing is replaced then.
    """
    with _lock:
        current = vars(owner).get(name)
        if current is None:
            raise AttributeError(
                f"hf_neural_attn expected {getattr(owner, '__name__', owner)!r} to define {name!r}, and it does not: "
                "this release of that library is not one the library was tested with. Please report it, with the "
                "library's version."
            )
        if is_wrapped(current):
            return False
        wrapper = make_wrapper(_function_of(current))
        setattr(wrapper, WRAPPED_MARK, True)
        replacement = type(current)(wrapper) if isinstance(current, (classmethod, staticmethod)) else wrapper
        setattr(owner, name, replacement)
        _REPLACEMENTS.append(Replacement(owner, name, current, replacement))
        return True


def replacements() -> list[Replacement]:
    """What :func:`wrap_once` replaced in this process and has not put back, oldest first."""
    with _lock:
        return list(_REPLACEMENTS)


_REGISTRATIONS: list[tuple[Any, Any]] = []  # (registry, key), oldest first


def register(registry: Any, key: Any, value: Any) -> None:
    """``registry.register(key, value, exist_ok=True)`` (transformers' Auto mappings, ``AutoConfig``'s model types),
    remembered so that :func:`undo_all` can take it out again."""
    with _lock:
        registry.register(key, value, exist_ok=True)
        # By identity: transformers' mappings are dicts, and two of them compare equal when their contents do.
        if not any(known is registry and known_key == key for known, known_key in _REGISTRATIONS):
            _REGISTRATIONS.append((registry, key))


def registered_keys() -> list[Any]:
    """The keys :func:`register` added and :func:`undo_all` has not taken out, oldest first."""
    with _lock:
        return [key for _, key in _REGISTRATIONS]


def undo_all() -> list[str]:
    """Put back every original :func:`wrap_once` replaced and take out every entry :func:`register` added, newest
    first; return what was undone. An attribute someone replaced again since (another library wrapping ours) is left
    to them: restoring it would drop their wrapper."""
    undone = []
    with _lock:
        while _REPLACEMENTS:
            replacement = _REPLACEMENTS.pop()
            if vars(replacement.owner).get(replacement.name) is replacement.replacement:
                setattr(replacement.owner, replacement.name, replacement.original)
                undone.append(replacement.describe())
        while _REGISTRATIONS:
            registry, key = _REGISTRATIONS.pop()
            forget_registered(registry, key)
            undone.append(f"{type(registry).__name__}[{getattr(key, '__name__', key)!r}]")
    return undone
