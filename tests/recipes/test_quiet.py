"""recipes/quiet.py: the messages a run does not act on are filtered by their logger or warning category and their
text, only inside the block that prints them; anything else those loggers or calls print still shows.

test_recipes_finetune.py runs the command line and reads what it printed."""

from __future__ import annotations

import logging
import warnings

import pytest

from recipes import quiet

TORCHAO_LINE = "Failed to load /site-packages/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so: Could not load"
PYTREE_LINE = (
    "<enum 'KernelPreference'> is an Enum subclass and is now natively supported by torch.compile as an opaque"
)


class Kept(logging.Handler):
    """Keeps the messages of the records that reach it."""

    def __init__(self):
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def kept():
    handler = Kept()
    names = ("torchao", "torch.utils._pytree", "some.other.library")
    loggers = [logging.getLogger(name) for name in names]
    for logger in loggers:
        logger.addHandler(handler)
    yield handler, dict(zip(names, loggers))
    for logger in loggers:
        logger.removeHandler(handler)


def test_start_up_messages_are_dropped_by_logger_and_text_inside_the_block_only(kept):
    handler, loggers = kept
    with quiet.filtered(quiet.STARTUP_MESSAGES):
        loggers["torchao"].warning(TORCHAO_LINE)
        loggers["torch.utils._pytree"].warning("%s", PYTREE_LINE)
        loggers["torchao"].warning("Failed to load /site-packages/torchao/_C.abi3.so: missing")  # torchao's own ops
        loggers["some.other.library"].warning(TORCHAO_LINE)  # the same text from another logger
    loggers["torchao"].warning(TORCHAO_LINE)  # after the block
    assert handler.messages == [
        "Failed to load /site-packages/torchao/_C.abi3.so: missing",
        TORCHAO_LINE,
        TORCHAO_LINE,
    ]
    assert all(not logger.filters for logger in loggers.values())


def test_warnings_are_dropped_by_category_and_text_inside_the_block_only():
    peft_line = "fan_in_fan_out is set to False but the target module is `Conv1D`. Setting fan_in_fan_out to True."
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        with quiet.filtered(quiet.PEFT_MESSAGES + (quiet.UNPATCHED_BASE_MESSAGE,)):
            warnings.warn(peft_line, UserWarning)
            warnings.warn("`is_gradient_checkpointing` is deprecated and will be removed in v6.", FutureWarning)
            warnings.warn("Adapters saved from this model will name gpt2 as their base model, which is not patched")
            warnings.warn(peft_line, RuntimeWarning)  # another category
            warnings.warn("init='zero' is the papers' literal init")  # a real warning
        warnings.warn(peft_line, UserWarning)  # after the block
    assert [(type(w.message), str(w.message)) for w in shown] == [
        (RuntimeWarning, peft_line),
        (UserWarning, "init='zero' is the papers' literal init"),
        (UserWarning, peft_line),
    ]


def test_deepspeeds_cpu_note_is_dropped_only_where_torch_sees_no_accelerator(monkeypatch):
    import torch

    for available, dropped in ((False, True), (True, False)):
        monkeypatch.setattr(torch.accelerator, "is_available", lambda available=available: available)
        names = {message.source for message in quiet.startup_messages()}
        assert ("DeepSpeed" in names) is dropped


def test_the_filters_a_library_installs_inside_the_block_outlive_it_and_the_blocks_own_do_not():
    """A library imported inside the block may install warnings filters of its own (Accelerate's scheduler module
    ignores torch's lr_scheduler UserWarnings at import): they stay after the block; the block's own filters go."""
    with warnings.catch_warnings():  # this test's own changes undone
        before = list(warnings.filters)
        with quiet.filtered(quiet.PEFT_MESSAGES + (quiet.UNPATCHED_BASE_MESSAGE,)):
            warnings.filterwarnings("ignore", category=UserWarning, module=r"some\.library\.scheduler")
        left = [item for item in warnings.filters if item not in before]
        assert [(action, category, module.pattern) for action, _, category, module, _ in left] == [
            ("ignore", UserWarning, r"some\.library\.scheduler")
        ]
