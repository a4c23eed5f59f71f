"""The recipes' one error type: every room of ``recipes/`` raises it, so it lives below all of them; and how a command
reports it."""

from __future__ import annotations

import json
import os
import sys
import time

# Exit code of a command that refuses its inputs (as argparse's usage errors).
REFUSED = 2


class RecipeError(ValueError):
    """A problem with the run's inputs, reported before any training starts."""


def refuse(command: str, error: RecipeError) -> int:
    """Print ``error`` as ``command``'s one-line refusal (``finetune.py: error: ...``) and return :data:`REFUSED`.

    Under ``accelerate launch`` with several processes (torch's elastic agent, torchrun, starts them) every process
    refuses alike, and the launcher then fails the job its own way: torch's ``ChildFailedError``, listing each
    process's exit code 2, and exit code 1. The message is also written where the agent reads why a process failed
    (the file ``TORCHELASTIC_ERROR_FILE`` names), so that summary shows it rather than a pointer to torch's docs.
    """
    message = f"{command}: error: {error}"
    print(message, file=sys.stderr)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        try:
            with open(error_file, "w") as handle:
                json.dump({"message": message, "timestamp": int(time.time())}, handle)
        except OSError:
            pass  # the message is printed already; the launcher then shows its own
    return REFUSED
