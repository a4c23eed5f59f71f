"""The Hub over HTTP: pushes and loads by repo id through huggingface_hub's and transformers' own code, against the
Hub-compatible server of tests/hub_server.py on 127.0.0.1; and the cards the Hub shows.

huggingface_hub reads ``HF_ENDPOINT`` at import, so the clients run in subprocesses (tests/hub_steps.py), a few
steps each; the pushed files are then read back from the server over HTTP, the cards parsed with huggingface_hub's
``ModelCard``. Logits of a model loaded by repo id equal the pushed model's (≤ 1e-6; they are identical in practice).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hub_server import TOKEN
from hub_steps import (
    ADAPTER,
    BASE,
    FULL_PUSHES,
    LOCAL_BASE_ADAPTER,
    OWN_CARD,
    OWN_CARD_TEXT,
    PRIVATE,
    PRIVATE_NO_TOKEN,
    QANA_LLAMA,
    RECIPE_BASE,
    RECIPE_BASELINE,
    RECIPE_RUN,
    REVISIONS,
    SAVED_AND_PUSHED,
    SHARDED,
)
from huggingface_hub import ModelCard

from recipes import report

pytestmark = [pytest.mark.spawns, pytest.mark.server]

ROOT = Path(__file__).resolve().parents[2]
SAME_LOGITS = 1e-6  # a checkpoint loads as the model that was pushed


def run_steps(hub_server, home: Path, *steps: str, prelude: str = "", timeout: int = 300) -> dict:
    """Run ``hub_steps`` steps in one subprocess talking to ``hub_server``; their results by name."""
    code = f"{prelude}import hub_steps; hub_steps.main()"
    process = subprocess.run(
        [sys.executable, "-c", code, *steps],
        env=hub_server.client_env(home),
        cwd=ROOT,
        stdin=subprocess.DEVNULL,  # as a script or CI runs: transformers' "run the custom code? [y/N]" reads EOF
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert process.returncode == 0, process.stderr[-5000:]
    return json.loads(process.stdout.strip().splitlines()[-1])


def succeeded(result: dict) -> dict:
    assert "error" not in result, result.get("error")
    return result


def pushed_card(hub_server, repo_id: str, revision: str = "main") -> ModelCard:
    """The repo's README.md, downloaded from the server, as huggingface_hub reads a card."""
    return ModelCard(hub_server.download(repo_id, "README.md", revision).decode())


@pytest.fixture(scope="module")
def library_session(hub_server, tmp_path_factory) -> dict:
    """One subprocess with the library: every push and load of the tests below that need it."""
    home = tmp_path_factory.mktemp("hf_home")
    return run_steps(
        hub_server,
        home,
        "full_checkpoints",
        "revisions",
        f"save_pretrained_push={home / 'saved'}",
        "own_card",
        f"adapters={home / 'local-base'}",
        f"private_repos={home / 'hub'}",
    )


@pytest.mark.hub
def test_push_to_hub_then_load_by_repo_id_with_the_library_and_the_auto_class(hub_server, library_session):
    results = succeeded(library_session["full_checkpoints"])
    for repo, family, _, _, shard_size, _ in FULL_PUSHES:
        result = results[repo]
        assert result["library_difference"] <= SAME_LOGITS and result["auto_class_difference"] <= SAME_LOGITS, result
        assert result["records_equal"], result
        assert (
            result["classes"][0]
            == result["classes"][1]
            == ("GPT2LMHeadModel" if family == "gpt2" else "LlamaForCausalLM")
        )
        assert {"config.json", "hf_neural_attn_loader.py", "README.md"} <= set(result["files"])
        weights = [name for name in result["files"] if name.endswith(".safetensors")]
        if shard_size:  # max_shard_size went through push_to_hub: shards and their index, loaded as one model
            assert len(weights) > 1 and "model.safetensors.index.json" in result["files"]
        else:
            assert weights == ["model.safetensors"]
    config = json.loads(hub_server.download(SHARDED, "config.json"))
    assert config["hf_neural_attn"]["layers"] == [1] and config["model_type"] == "hf_neural_attn"


@pytest.mark.hub
def test_revision_loads_the_weights_of_an_earlier_commit(hub_server, library_session):
    result = succeeded(library_session["revisions"])
    first, second = result["commits"]
    assert first != second and hub_server.commit_ids(REVISIONS)[-2:] == [first, second]
    assert result["first_at_first"] <= SAME_LOGITS
    assert result["second_at_main"] <= SAME_LOGITS
    assert result["second_at_first"] > 1e-3, "the two pushes must hold different weights for the test to mean much"
    # The second push found the card of the first on the repo: kept, not rewritten.
    assert pushed_card(hub_server, REVISIONS, first).content == pushed_card(hub_server, REVISIONS, second).content


@pytest.mark.hub
def test_adapters_push_and_load_by_repo_id(hub_server, library_session):
    result = succeeded(library_session["adapters"])
    assert result["difference"] <= SAME_LOGITS and result["class"] == "LlamaForCausalLM"
    files = set(hub_server.files(ADAPTER))
    assert files == {".gitattributes", "README.md", "hf_neural_attn_adapter.json", "hf_neural_attn_adapter.safetensors"}
    assert json.loads(hub_server.download(ADAPTER, "hf_neural_attn_adapter.json"))["base_model_name_or_path"] == BASE
    assert [message for message in result["warnings"] if "local folder" in message and "only this machine" in message]
    assert "hf_neural_attn_adapter.safetensors" in hub_server.files(LOCAL_BASE_ADAPTER)


@pytest.mark.hub
def test_a_private_repo_without_a_token_is_a_clear_error_and_leaves_nothing_half_written(hub_server, library_session):
    result = succeeded(library_session["private_repos"])
    for key in ("library_without_token", "auto_class_without_token"):
        error = result[key]
        assert error is not None and error["type"] == "OSError", error
        # transformers' own words: the repo is not one it may read, and a private repo needs a token.
        assert PRIVATE in error["message"] and "private repository" in error["message"] and "token" in error["message"]
    # The failed loads left nothing in the Hub cache: no weights, no config, no partial download.
    assert result["cached_after_errors"] == result["cached_before_loads"]
    assert not [name for name in result["cached_after_errors"] if name.startswith(("blobs/", "snapshots/"))]
    push = result["push_without_token"]
    assert push is not None and "401" in push["message"], push
    assert PRIVATE_NO_TOKEN not in hub_server.repos  # refused before anything was created or uploaded
    assert result["with_token"] <= SAME_LOGITS


@pytest.mark.hub
def test_without_the_library_the_auto_classes_refuse_by_name(hub_server, library_session, tmp_path):
    succeeded(library_session["full_checkpoints"])  # the repo loaded here was pushed there
    result = run_steps(
        hub_server, tmp_path, "without_the_library", prelude="import hub_steps; hub_steps.block_the_library(); "
    )
    result = succeeded(result["without_the_library"])
    assert result["library_importable"] == {
        "type": "ModuleNotFoundError",
        "message": "No module named 'hf_neural_attn'",
    }
    # transformers' generic remote-code refusal: the checkpoint's auto_map names the loader file.
    auto_class = result["auto_class"]
    assert auto_class["type"] == "ValueError", auto_class
    assert QANA_LLAMA in auto_class["message"] and "trust_remote_code=True" in auto_class["message"]
    # With trust_remote_code=True, transformers runs the loader file's imports check: it names the package.
    trusted = result["auto_class_trust_remote_code"]
    assert trusted["type"] == "ImportError", trusted
    assert "requires the following packages" in trusted["message"] and "hf_neural_attn" in trusted["message"]
    # The plain class builds the model the config asks for, whose attention implementation nothing registered.
    plain = result["plain_class"]
    assert plain["type"] == "ValueError" and 'attn_implementation="hf_neural_attn"' in plain["message"], plain


@pytest.mark.hub
def test_recipe_push_to_hub_uploads_the_run_which_loads_by_repo_id(hub_server, tmp_path):
    """recipes.finetune --push_to_hub: the token check before training (recipes/hub.py, against this server), the
    upload of the run folder, its card, and the pushed run loaded back by repo id."""
    result = succeeded(run_steps(hub_server, tmp_path, f"recipe_push={tmp_path}")["recipe_push"])
    assert result["patched"] and result["difference"] <= SAME_LOGITS
    assert "GET /api/whoami-v2" in hub_server.requests  # --hub_token checked before training
    pushed = set(hub_server.files(RECIPE_RUN))
    expected = {"README.md", "config.json", "model.safetensors", "all_results.json", report.PLOT_FILE}
    assert expected | {"tokenizer_config.json", "hf_neural_attn_loader.py"} <= pushed
    assert "step_2" in result["local_files"] and not [name for name in pushed if name.startswith("step_")]
    assert TOKEN not in hub_server.download(RECIPE_RUN, "all_results.json").decode(), "the token leaked"

    card = pushed_card(hub_server, RECIPE_RUN)
    assert card.data.library_name == "transformers" and card.data.base_model == RECIPE_BASE
    assert card.data.tags[:3] == ["hf-neural-attn", "qana", "custom_code"]
    assert card.data.pipeline_tag == "text-generation"
    assert "pip install hf-neural-attn" in card.text and f'hf_neural_attn.from_pretrained("{RECIPE_RUN}")' in card.text
    # A baseline run is a plain transformers checkpoint: no library tag, nothing of the library to import.
    baseline = pushed_card(hub_server, RECIPE_BASELINE)
    assert baseline.data.library_name == "transformers" and baseline.data.base_model == RECIPE_BASE
    assert "hf-neural-attn" not in baseline.data.tags and "import hf_neural_attn" not in baseline.text


# ---------------------------------------------------------------------------------------------- the cards


def assert_full_checkpoint_card(card: ModelCard, scorer: str, pipeline_tag: str, where: str, auto_class: str):
    """The Hub metadata and loading snippet of a full patched checkpoint's card (hf_neural_attn.model_cards)."""
    assert card.data.library_name == "transformers"
    assert card.data.tags[:3] == ["hf-neural-attn", scorer, "custom_code"]
    assert card.data.pipeline_tag == pipeline_tag
    assert "pip install hf-neural-attn" in card.text and "import hf_neural_attn" in card.text
    assert f'hf_neural_attn.from_pretrained("{where}")' in card.text
    assert f'{auto_class}.from_pretrained("{where}")' in card.text


@pytest.mark.hub
def test_cards_of_full_checkpoints_pushed_by_push_to_hub(hub_server, library_session):
    succeeded(library_session["full_checkpoints"])
    for repo, _, scorer, _, _, base_model in FULL_PUSHES:
        card = pushed_card(hub_server, repo)
        assert_full_checkpoint_card(card, scorer, "text-generation", repo, "AutoModelForCausalLM")
        assert card.data.base_model == base_model  # None for a model built from a config
        assert "automatically generated" not in card.text  # transformers' template gave way


@pytest.mark.hub
def test_save_pretrained_with_push_to_hub_pushes_the_same_card(hub_server, library_session):
    assert succeeded(library_session["save_pretrained_push"])["difference"] <= SAME_LOGITS
    card = pushed_card(hub_server, SAVED_AND_PUSHED)
    assert_full_checkpoint_card(card, "neural", "text-generation", SAVED_AND_PUSHED, "AutoModelForCausalLM")
    assert card.data.base_model == BASE


@pytest.mark.hub
def test_a_card_already_on_the_repo_is_kept_and_tagged(hub_server, library_session):
    succeeded(library_session["own_card"])
    card = pushed_card(hub_server, OWN_CARD)
    assert card.text.strip() == OWN_CARD_TEXT.strip()
    assert card.data.tags == ["hf-neural-attn", "qana", "custom_code"]  # patch_model's model_tags


@pytest.mark.hub
def test_adapter_card_on_the_hub(hub_server, library_session):
    succeeded(library_session["adapters"])
    card = pushed_card(hub_server, ADAPTER)
    assert card.data.library_name == "hf-neural-attn"
    assert card.data.base_model == BASE and card.data.base_model_relation == "adapter"
    assert card.data.tags == ["hf-neural-attn", "qana"] and card.data.pipeline_tag == "text-generation"
    assert "pip install hf-neural-attn" in card.text and f'hf_neural_attn.from_pretrained("{ADAPTER}")' in card.text
    # A local base is no Hub id: no base_model the Hub would link to.
    assert pushed_card(hub_server, LOCAL_BASE_ADAPTER).data.base_model is None


def test_save_pretrained_writes_the_card_and_keeps_one_already_there(tmp_path):
    from helpers.models import tiny_model, tiny_vit

    import hf_neural_attn

    model = tiny_model("llama")
    model.config._name_or_path = "someone/tiny-llama-base"  # as from_pretrained("someone/tiny-llama-base") sets it
    hf_neural_attn.patch_model(model, "neural", proj_dim=2)
    model.save_pretrained(tmp_path / "llama")
    card = ModelCard.load(tmp_path / "llama" / "README.md")
    assert_full_checkpoint_card(card, "neural", "text-generation", "path/to/this/folder", "AutoModelForCausalLM")
    assert card.data.base_model == "someone/tiny-llama-base"

    vit = tiny_vit()
    hf_neural_attn.patch_model(vit, "qana")
    (tmp_path / "vit").mkdir()
    vit.save_pretrained(tmp_path / "vit")
    assert ModelCard.load(tmp_path / "vit" / "README.md").data.pipeline_tag == pipeline_tag_of(vit)

    (tmp_path / "vit" / "README.md").write_text("# mine\n")
    vit.save_pretrained(tmp_path / "vit")
    assert (tmp_path / "vit" / "README.md").read_text() == "# mine\n"


def pipeline_tag_of(model) -> str:
    """The Hub task of a model class, as the card should say it."""
    return {
        "ViTForImageClassification": "image-classification",
        "ViTModel": "feature-extraction",
        "LlamaForCausalLM": "text-generation",
    }[type(model).__name__]


def test_patch_model_tags_the_model_for_transformers_card_writers_and_unpatch_removes_them():
    from helpers.models import tiny_model

    import hf_neural_attn

    model = tiny_model("gpt2")
    model.add_model_tags(["mine"])
    hf_neural_attn.patch_model(model, "qana")
    assert model.model_tags == ["mine", "hf-neural-attn", "qana", "custom_code"]
    hf_neural_attn.unpatch_model(model)
    assert model.model_tags == ["mine"]
    plain = tiny_model("gpt2")
    hf_neural_attn.unpatch_model(hf_neural_attn.patch_model(plain, "neural"))
    assert plain.model_tags is None  # as before the patch: transformers' class default


@pytest.mark.hub
def test_the_server_token_is_the_one_the_clients_send(hub_server):
    """The server's own contract, which the tests above rely on: 401 without the token, the user with it."""
    import urllib.error
    import urllib.request

    request = urllib.request.Request(f"{hub_server.url}/api/whoami-v2", headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        assert json.loads(response.read())["name"] == "someone"
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"{hub_server.url}/api/whoami-v2", timeout=10)
    assert refused.value.code == 401
