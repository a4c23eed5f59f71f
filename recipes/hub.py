"""Knowing quickly whether the Hugging Face Hub can be reached.

Without network, the Hub clients retry a failed connection for about 20 seconds before giving up. A run that
needs Hub files (a model or dataset named by its Hub id) first checks in well under a second: with
``HF_HUB_OFFLINE=1`` it does not try at all; otherwise one TCP connection to the Hub with a short timeout
decides. If that fails, the run switches the Hub clients to offline mode, so files already in the local cache
still load and anything else fails at once with a clear message.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
from urllib.parse import urlparse

logger = logging.getLogger(__name__)

_reachable: bool | None = None


def is_offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def hub_reachable(timeout: float = 3.0) -> bool:
    """One TCP connection to the Hub endpoint (cached for the process)."""
    global _reachable
    if _reachable is None:
        from huggingface_hub import constants

        endpoint = urlparse(constants.ENDPOINT)
        port = endpoint.port or (443 if endpoint.scheme == "https" else 80)
        try:
            with socket.create_connection((endpoint.hostname, port), timeout=timeout):
                _reachable = True
        except OSError:
            _reachable = False
    return _reachable


def go_offline() -> None:
    """Switch huggingface_hub, transformers and datasets to offline mode (cached files only) for this process."""
    import datasets.config
    import huggingface_hub.constants

    os.environ["HF_HUB_OFFLINE"] = "1"  # for worker processes started later
    huggingface_hub.constants.HF_HUB_OFFLINE = True
    datasets.config.HF_HUB_OFFLINE = True
    datasets.config.HF_DATASETS_OFFLINE = True


def hub_resources(args: argparse.Namespace) -> list[str]:
    """The Hub ids this run would download from (local paths excluded): the model's, then the task's data."""
    from .tasks import get_task

    names = [
        args.model_name_or_path,
        args.config_name,
        args.tokenizer_name,
        getattr(args, "image_processor_name", None),
    ]
    needed = [name for name in names if name and not os.path.exists(name)]
    return needed + get_task(args.task).hub_data(args)


def check_hub(args: argparse.Namespace) -> None:
    """Before loading anything: go offline at once if the run needs the Hub and the Hub is not there."""
    needed = hub_resources(args)
    if not needed:
        return
    if is_offline():
        logger.info("Offline mode (HF_HUB_OFFLINE): %s must be in the local cache.", ", ".join(needed))
        return
    if not hub_reachable():
        logger.warning(
            "The Hugging Face Hub is not reachable: continuing offline, so %s must be in the local cache.",
            ", ".join(needed),
        )
        go_offline()


def check_push_access(repo_id: str, token: str | None) -> None:
    """``--push_to_hub``, before training: the Hub must be reachable and the token (``--hub_token`` or the
    logged-in one) valid, with write access to the repository's namespace. A failed upload would otherwise show
    up only after the whole run."""
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub.errors import HfHubHTTPError, LocalTokenNotFoundError

    from .errors import RecipeError

    if is_offline():
        raise RecipeError("--push_to_hub needs the Hugging Face Hub, but offline mode is on (HF_HUB_OFFLINE=1).")
    if not hub_reachable():
        raise RecipeError(
            f"--push_to_hub: the Hugging Face Hub ({constants.ENDPOINT}) is not reachable from this machine. "
            "Train without --push_to_hub and upload the output folder later."
        )
    try:
        # Looked up on the module, so that a test can stand in for the client.
        info = huggingface_hub.HfApi(token=token).whoami()
    except LocalTokenNotFoundError as error:
        raise RecipeError(
            "--push_to_hub: not logged in to the Hugging Face Hub. Run `hf auth login` or pass --hub_token."
        ) from error
    except HfHubHTTPError as error:
        status = getattr(getattr(error, "response", None), "status_code", None)
        if status == 401:
            raise RecipeError(
                "--push_to_hub: the Hub rejected the token (invalid or expired). Log in again with `hf auth login` "
                "or pass a valid --hub_token."
            ) from error
        raise RecipeError(f"--push_to_hub: could not check the Hub token: {error}") from error
    except OSError as error:  # connection failures after the reachability check
        raise RecipeError(f"--push_to_hub: could not reach the Hugging Face Hub: {error}") from error
    access = ((info.get("auth") or {}).get("accessToken") or {}).get("role")
    if access == "read":
        raise RecipeError("--push_to_hub: the Hub token is read-only; use a token with write access.")
    namespace = repo_id.split("/", 1)[0] if "/" in repo_id else info.get("name")
    allowed = {info.get("name")} | {org.get("name") for org in info.get("orgs") or []}
    if namespace not in allowed:
        raise RecipeError(
            f"--push_to_hub: the token belongs to {info.get('name')!r}, which cannot create repositories under "
            f"{namespace!r} (its namespaces: {sorted(n for n in allowed if n)}). Check --hub_model_id."
        )
