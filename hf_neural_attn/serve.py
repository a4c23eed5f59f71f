"""``python -m hf_neural_attn.serve PATH [flags]``: transformers' own server (``transformers serve``) with the library
imported, so a patched checkpoint is served with its scorers.

Every flag is ``transformers serve``'s (``--continuous-batching``, ``--port``, ``--attn-implementation``, ...;
``python -m hf_neural_attn.serve --help`` lists them): this module imports the library and hands the command line
over, nothing else. With the library imported the checkpoint's config is the library's own class (no remote code to
trust), and the class the server names from ``config.architectures`` loads the checkpoint patched
(:mod:`hf_neural_attn.integrations.transformers_loading`). Plain ``transformers serve --trust-remote-code PATH`` serves it
patched as well: the checkpoint's loader file imports the library. See docs/serving.md.
"""

from __future__ import annotations

import sys

# Nothing of the library to import by name: running this module imports the package first, whose import is what
# makes the difference (patched checkpoints' config class registered, transformers' from_pretrained routed).

PROG = "python -m hf_neural_attn.serve"


def main(argv: list[str] | None = None) -> None:
    """Run ``transformers serve`` with ``argv`` (default: this process's arguments)."""
    import typer
    from transformers.cli.serve import Serve

    # An app of the one command, which typer then runs without naming it: the flags are transformers serve's.
    app = typer.Typer(add_completion=False)
    app.command()(Serve)
    app(args=sys.argv[1:] if argv is None else argv, prog_name=PROG)


if __name__ == "__main__":
    main()
