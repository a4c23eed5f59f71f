"""recipes/hub.py and the Hub upload: a Hub model without network fails fast, --push_to_hub uploads the run folder
(the Hub client replaced by a recording one: nothing leaves the machine)."""

from __future__ import annotations

from pathlib import Path

import pytest
from recipes_helpers import (  # fresh_accelerate_state, one_thread: autouse fixtures
    clm_flags,
    finetune_in_process,
    fresh_accelerate_state,  # noqa: F401
    one_thread,  # noqa: F401
    tiny_recipe_assets,
)

from recipes import report
from recipes.args import RecipeError


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return tiny_recipe_assets(tmp_path_factory.mktemp("recipe_assets"))


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


def test_push_to_hub_uploads_the_output_folder(assets, tmp_path, monkeypatch):
    import huggingface_hub

    calls = []

    class RecordingApi:
        def __init__(self, token=None):
            calls.append(("init", token))

        def whoami(self):
            calls.append(("whoami",))
            return {"name": "someone", "orgs": [], "auth": {"accessToken": {"role": "write"}}}

        def create_repo(self, repo_id, **kwargs):
            calls.append(("create_repo", repo_id, kwargs))

        def upload_folder(self, repo_id, folder_path, **kwargs):
            calls.append(
                ("upload_folder", repo_id, folder_path, sorted(p.name for p in Path(folder_path).iterdir()), kwargs)
            )

    from recipes import hub

    monkeypatch.setattr(huggingface_hub, "HfApi", RecordingApi)
    monkeypatch.setattr(hub, "is_offline", lambda: False)
    monkeypatch.setattr(hub, "_reachable", True)
    out = tmp_path / "push"
    finetune_in_process(
        out,
        *clm_flags(assets, "--push_to_hub", "--hub_model_id", "someone/tiny-qana", "--hub_token", "hf_test"),
        *("--checkpointing_steps", "2"),
    )
    assert calls[:2] == [("init", "hf_test"), ("whoami",)]  # checked before training
    assert calls[2] == ("init", "hf_test")
    assert calls[3][:2] == ("create_repo", "someone/tiny-qana")
    _, repo, folder, files, kwargs = calls[4]
    assert repo == "someone/tiny-qana" and Path(folder) == out
    assert {
        "README.md",
        "config.json",
        "model.safetensors",
        "all_results.json",
        report.PLOT_FILE,
        "tokenizer_config.json",
    } <= set(files)
    assert "step_*" in kwargs["ignore_patterns"] and "step_2" in files
    card = (out / "README.md").read_text()
    assert 'hf_neural_attn.from_pretrained("someone/tiny-qana")' in card
    assert "hf_test" not in (out / "all_results.json").read_text(), "the token leaked into the results"
