"""What a run would print that it does not act on, filtered where it is printed, so that real warnings stand out.

Each message is named by where it comes from (a logger's name, or a warning's category) and by how it begins (a
regular expression), and is filtered only around the import or call that prints it (:func:`filtered`); anything else
those loggers or calls print still shows. docs/recipes.md ("What a run prints") lists them.

* ``STARTUP_MESSAGES``: printed by other libraries when they are imported. :func:`import_quietly` imports those
  libraries, as every run imports them anyway (transformers' model code imports its quantizers, and those torchao;
  transformers' training utilities import PEFT, and PEFT bitsandbytes; Accelerate's ``unwrap_model`` imports DeepSpeed
  wherever it is installed), with these messages filtered.
* ``PEFT_MESSAGES``: warnings of ``get_peft_model`` about what PEFT itself settles (``qlora.add_lora``).
* ``UNPATCHED_BASE_MESSAGE``: the library's warning that an adapter names an unpatched base as its base model; the run's
  model card loads the adapter onto the patched base by hand, as the warning asks (``qlora.add_lora``).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Message:
    """A message a run does not act on: its ``source`` (a logger's name, or a ``Warning`` subclass), the regular
    expression its text begins with, and why the run can ignore it."""

    source: str | type[Warning]
    pattern: str
    why: str


STARTUP_MESSAGES = (
    Message(
        "torchao",
        r"Failed to load \S*_C_(mxfp8|cutlass_90a)\S*: ",
        "torchao's kernels for MX formats and Hopper's cutlass, built for CUDA: no --torchao scheme of the recipes "
        "runs them, and a CPU build of torch cannot load them",
    ),
    Message(
        "torch.utils._pytree",
        r"<enum '\w+'> is an Enum subclass and is now natively supported by torch\.compile",
        "torch's deprecation notice to torchao, which registers its Enums with pytree at import",
    ),
    Message(
        "bitsandbytes.backends.cpu.ops",
        r"Failed to load CPU gemm_4bit_forward from kernels-community",
        "the optional kernel of bitsandbytes' repacked 4-bit CPU path, which the recipes turn off "
        "(hf_neural_attn.keep_4bit_trainable)",
    ),
)
# Only where torch sees no accelerator either: on a machine with one, DeepSpeed not finding it is news.
NO_ACCELERATOR_MESSAGES = (
    Message("DeepSpeed", r"Setting accelerator to CPU\.", "DeepSpeed found no GPU, and neither did torch"),
)
PEFT_MESSAGES = (
    Message(
        UserWarning,
        r"fan_in_fan_out is set to False but the target module is `Conv1D`\. Setting fan_in_fan_out to True\.",
        "PEFT sets fan_in_fan_out itself for GPT-2's Conv1D layers",
    ),
    Message(
        FutureWarning,
        r"`is_gradient_checkpointing` is deprecated",
        "PEFT calls transformers' old name for the property; nothing the run can change",
    ),
)
UNPATCHED_BASE_MESSAGE = Message(
    UserWarning,
    r"Adapters saved from this model will name \S.* as their base model, which is not patched",
    "the run's model card loads the adapter onto the base patched by hand, as the warning asks",
)
# Imported by import_quietly where installed, in this order (transformers' model code brings torchao in).
NOISY_IMPORTS = ("transformers.modeling_utils", "peft", "deepspeed")


class _Drop(logging.Filter):
    """Drops the records whose message matches one of ``patterns`` (at its start)."""

    def __init__(self, patterns: list[str]):
        super().__init__()
        self.patterns = [re.compile(pattern) for pattern in patterns]

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(pattern.match(message) for pattern in self.patterns)


@contextlib.contextmanager
def filtered(messages: tuple[Message, ...]) -> Iterator[None]:
    """Within the block, ``messages`` are not shown: a logger's by a filter on that logger, a warning by a warnings
    filter of its category and text. Other records of those loggers, and other warnings, pass. Afterwards those
    filters are gone, and whatever filters the block installed stay."""
    by_logger: dict[str, list[str]] = {}
    for message in messages:
        if isinstance(message.source, str):
            by_logger.setdefault(message.source, []).append(message.pattern)
    drops = [(logging.getLogger(name), _Drop(patterns)) for name, patterns in by_logger.items()]
    # Only these filters are taken away again, not the whole list put back as warnings.catch_warnings does: the
    # libraries imported in the block install filters of their own (Accelerate's on torch's lr_scheduler warnings),
    # which must outlive it. An "ignore" leaves no entry in the warnings registries, so none goes stale.
    before = list(warnings.filters)
    for message in messages:
        if not isinstance(message.source, str):
            warnings.filterwarnings("ignore", message=message.pattern, category=message.source)
    added = [item for item in warnings.filters if item not in before]
    for logger, drop in drops:
        logger.addFilter(drop)
    try:
        yield
    finally:
        for logger, drop in drops:
            logger.removeFilter(drop)
        for item in added:
            with contextlib.suppress(ValueError):  # the block may have reset the filters itself
                warnings.filters.remove(item)


def startup_messages() -> tuple[Message, ...]:
    """The start-up messages filtered on this machine: NO_ACCELERATOR_MESSAGES only where torch sees no accelerator."""
    import torch

    accelerator = getattr(torch, "accelerator", None)
    found = accelerator.is_available() if accelerator is not None else torch.cuda.is_available()
    return STARTUP_MESSAGES + (() if found else NO_ACCELERATOR_MESSAGES)


def import_quietly() -> None:
    """Import the installed ``NOISY_IMPORTS`` with their start-up messages filtered; a no-op once they are imported.
    An import that fails is left to the code that needs the library, which says so in its own words."""
    with filtered(startup_messages()):
        for name in NOISY_IMPORTS:
            if importlib.util.find_spec(name.split(".")[0]) is None:
                continue
            try:
                importlib.import_module(name)
            except ImportError:
                continue
