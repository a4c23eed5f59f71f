"""recipes/hub.py without network: a Hub model fails fast. (--push_to_hub through a Hub-compatible server on
127.0.0.1: tests/integrations/test_hub_http.py.)"""

from __future__ import annotations

import pytest
from recipes_helpers import (  # fresh_accelerate_state, one_thread: autouse fixtures
    finetune_in_process,
    fresh_accelerate_state,  # noqa: F401
    one_thread,  # noqa: F401
)

from recipes.errors import RecipeError


def test_a_hub_model_without_network_fails_fast_and_clearly(tmp_path, monkeypatch):
    import time

    import datasets.config
    import huggingface_hub.constants

    from recipes import hub

    # Whatever the run switches to offline mode is restored after the test.
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", False)
    monkeypatch.setattr(hub, "_reachable", None)
    started = time.time()
    with pytest.raises(RecipeError, match="Could not load the model config from 'hf-neural-attn-tests/no-such-model'"):
        finetune_in_process(
            tmp_path / "out", "--task", "clm", "--model_name_or_path", "hf-neural-attn-tests/no-such-model"
        )
    # No network here: one failed connection decides, instead of the Hub clients' ~20 s of retries.
    # (With network the repository does not exist: the Hub answers 404 just as fast.)
    assert time.time() - started < 10
