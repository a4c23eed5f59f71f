"""What tests/integrations/test_hub_http.py runs in a subprocess whose ``HF_ENDPOINT`` is tests/hub_server.py's server.

huggingface_hub reads ``HF_ENDPOINT`` when it is imported, so the Hub clients (``push_to_hub``, ``from_pretrained``
by repo id, the recipes' upload) run here, unchanged, in a process of their own. Each step is a function that
returns what the test checks, as JSON; ``python -c "import hub_steps; hub_steps.main()" STEP...`` runs the steps
named and prints ``{step: result}`` as its last line. A step that raises records ``{"error": traceback}`` and the
next step still runs, so one failure shows as the test it belongs to.

The library steps import the library; :func:`without_the_library` runs in a process where it cannot be imported
(:func:`block_the_library`), which is why this module imports the library and the test helpers inside the steps.
"""

from __future__ import annotations

import importlib.abc
import json
import sys
import traceback
import warnings
from pathlib import Path

from hub_server import ORGS, TOKEN, USER

BASE = f"{USER}/tiny-llama-base"
QANA_LLAMA = f"{USER}/tiny-qana-llama"
NEURAL_GPT2 = f"{USER}/tiny-neural-gpt2"
SHARDED = f"{ORGS[0]}/tiny-qana-llama-sharded"  # an organisation's namespace
REVISIONS = f"{USER}/tiny-qana-two-commits"
OWN_CARD = f"{USER}/tiny-qana-own-card"
ADAPTER = f"{USER}/tiny-qana-adapter"
LOCAL_BASE_ADAPTER = f"{USER}/tiny-local-base-adapter"
PRIVATE = f"{USER}/tiny-qana-private"
PRIVATE_NO_TOKEN = f"{USER}/tiny-qana-pushed-without-token"
RECIPE_BASE = f"{USER}/tiny-gpt2-base"
RECIPE_RUN = f"{USER}/tiny-qana-run"
RECIPE_BASELINE = f"{USER}/tiny-baseline-run"
OWN_CARD_TEXT = "# A card written by its owner\n\nKept as it is.\n"

SAVED_AND_PUSHED = f"{USER}/tiny-neural-llama-save-pretrained-push"

# (repo, family, scorer, options, max_shard_size, base model) of the full checkpoints pushed by model.push_to_hub;
# the base model is the name_or_path the model says it was loaded from (None: built from a config).
FULL_PUSHES = [
    (QANA_LLAMA, "llama", "qana", {}, None, BASE),
    (NEURAL_GPT2, "gpt2", "neural", {"proj_dim": 2}, None, None),
    (SHARDED, "llama", "qana", {"layers": [1]}, "20KB", None),
]


def patched(family: str, scorer: str = "qana", seed: int = 0, **options):
    """A tiny model of ``family``, patched, its scorers moved off their init (``seed``): a trained model."""
    from helpers.models import perturb_scorers, tiny_model

    import hf_neural_attn

    model = tiny_model(family).eval()
    hf_neural_attn.patch_model(model, scorer, **options)
    perturb_scorers(model, seed=seed)
    return model


def max_difference(model, other, family: str) -> float:
    """The largest absolute difference of the two models' logits on the family's test inputs."""
    import torch
    from helpers.models import logits, model_inputs

    with torch.no_grad():
        inputs = model_inputs(family)
        return (logits(model, inputs) - logits(other.eval(), inputs)).abs().max().item()


def error_text(call) -> dict[str, str] | None:
    """``{"type", "message"}`` of what ``call()`` raises, or None when it returns."""
    try:
        call()
    except Exception as error:
        return {"type": type(error).__name__, "message": str(error)}
    return None


# ------------------------------------------------------------------------------------------------ the steps


def full_checkpoints() -> dict:
    """model.push_to_hub of patched models, loaded back by repo id through the library and through the Auto class."""
    from huggingface_hub import HfApi
    from transformers import AutoModelForCausalLM

    import hf_neural_attn

    results = {}
    for repo, family, scorer, options, shard_size, base_model in FULL_PUSHES:
        model = patched(family, scorer, **options)
        model.config.name_or_path = base_model or ""  # as from_pretrained(base_model) sets it
        sharding = {"max_shard_size": shard_size} if shard_size else {}
        model.push_to_hub(repo, token=TOKEN, **sharding)
        by_library = hf_neural_attn.from_pretrained(repo)
        by_auto_class = AutoModelForCausalLM.from_pretrained(repo)
        results[repo] = {
            "files": sorted(HfApi().list_repo_files(repo)),
            "library_difference": max_difference(model, by_library, family),
            "auto_class_difference": max_difference(model, by_auto_class, family),
            "classes": [type(by_library).__name__, type(by_auto_class).__name__],
            "records_equal": by_library.config.hf_neural_attn
            == by_auto_class.config.hf_neural_attn
            == model.config.hf_neural_attn,
        }
    return results


def save_pretrained_push(folder: str) -> dict:
    """save_pretrained(push_to_hub=True), transformers' other way to push, loaded back by repo id."""
    import hf_neural_attn

    model = patched("llama", "neural", proj_dim=2)
    model.config.name_or_path = BASE
    model.save_pretrained(folder, push_to_hub=True, repo_id=SAVED_AND_PUSHED, token=TOKEN)
    return {"difference": max_difference(model, hf_neural_attn.from_pretrained(SAVED_AND_PUSHED), "llama")}


def revisions() -> dict:
    """Two pushes of different weights to one repo; the first commit id loads the first weights."""
    import hf_neural_attn

    first_model, second_model = patched("llama", seed=1), patched("llama", seed=2)
    first = first_model.push_to_hub(REVISIONS, token=TOKEN, commit_message="first weights")
    second = second_model.push_to_hub(REVISIONS, token=TOKEN, commit_message="second weights")
    at_first = hf_neural_attn.from_pretrained(REVISIONS, revision=first.oid)
    at_main = hf_neural_attn.from_pretrained(REVISIONS)
    return {
        "commits": [first.oid, second.oid],
        "first_at_first": max_difference(first_model, at_first, "llama"),
        "second_at_first": max_difference(second_model, at_first, "llama"),
        "second_at_main": max_difference(second_model, at_main, "llama"),
    }


def own_card() -> dict:
    """A repo whose owner wrote its card before the model was pushed: transformers keeps it and tags it."""
    from huggingface_hub import HfApi

    api = HfApi(token=TOKEN)
    api.create_repo(OWN_CARD)
    api.upload_file(path_or_fileobj=OWN_CARD_TEXT.encode(), path_in_repo="README.md", repo_id=OWN_CARD)
    patched("llama").push_to_hub(OWN_CARD, token=TOKEN)
    return {}


def adapters(local_base: str) -> dict:
    """push_adapter_to_hub of a model whose base came from the Hub, loaded back by repo id; and the warning for an
    adapter whose base is a local folder."""
    from helpers.models import perturb_scorers, tiny_model
    from transformers import LlamaForCausalLM

    import hf_neural_attn

    tiny_model("llama").push_to_hub(BASE, token=TOKEN)
    model = LlamaForCausalLM.from_pretrained(BASE).eval()  # its name_or_path is the base's repo id
    hf_neural_attn.patch_model(model, "qana", layers=[0])
    perturb_scorers(model)
    commit = hf_neural_attn.push_adapter_to_hub(model, ADAPTER, token=TOKEN)
    loaded = hf_neural_attn.from_pretrained(ADAPTER)

    tiny_model("llama").save_pretrained(local_base)
    local = LlamaForCausalLM.from_pretrained(local_base).eval()
    hf_neural_attn.patch_model(local, "qana")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hf_neural_attn.push_adapter_to_hub(local, LOCAL_BASE_ADAPTER, token=TOKEN)
    return {
        "commit_url": commit.commit_url,
        "difference": max_difference(model, loaded, "llama"),
        "class": type(loaded).__name__,
        "warnings": [str(warning.message) for warning in caught if issubclass(warning.category, UserWarning)],
    }


def private_repos(cache: str) -> dict:
    """A private repo loaded without a token (the errors, and what the failed loads leave in the Hub cache ``cache``),
    then with it; and a push without a token."""
    from transformers import AutoModelForCausalLM

    import hf_neural_attn

    model = patched("llama")
    model.push_to_hub(PRIVATE, token=TOKEN, private=True)
    cached = Path(cache) / f"models--{PRIVATE.replace('/', '--')}"
    results = {
        "cached_before_loads": files_under(cached),  # the push's card lookup: refs/main, .no_exist/.../README.md
        "library_without_token": error_text(lambda: hf_neural_attn.from_pretrained(PRIVATE)),
        "auto_class_without_token": error_text(lambda: AutoModelForCausalLM.from_pretrained(PRIVATE)),
        "cached_after_errors": files_under(cached),
        "push_without_token": error_text(lambda: model.push_to_hub(PRIVATE_NO_TOKEN, private=True)),
    }
    results["with_token"] = max_difference(model, hf_neural_attn.from_pretrained(PRIVATE, token=TOKEN), "llama")
    return results


def files_under(folder: Path) -> list[str]:
    """The files under ``folder``, relative to it; none when it does not exist."""
    return (
        sorted(str(path.relative_to(folder)) for path in folder.rglob("*") if path.is_file()) if folder.exists() else []
    )


def without_the_library() -> dict:
    """Loading a pushed patched checkpoint by repo id in a process where hf_neural_attn cannot be imported."""
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    return {
        "library_importable": error_text(lambda: __import__("hf_neural_attn")),
        "auto_class": error_text(lambda: AutoModelForCausalLM.from_pretrained(QANA_LLAMA)),
        "auto_class_trust_remote_code": error_text(
            lambda: AutoModelForCausalLM.from_pretrained(QANA_LLAMA, trust_remote_code=True)
        ),
        "plain_class": error_text(lambda: LlamaForCausalLM.from_pretrained(QANA_LLAMA)),
    }


def recipe_push(folder: str) -> dict:
    """The recipe with --push_to_hub, fine-tuning a base model it downloads from the Hub (patched, and a baseline
    run); the pushed patched run loaded back by repo id."""
    from huggingface_hub import HfApi
    from recipes_helpers import clm_flags, in_process_runs, save_tiny_gpt2, tiny_recipe_assets

    import hf_neural_attn

    root = Path(folder)
    assets = tiny_recipe_assets(root / "assets")
    api = HfApi(token=TOKEN)
    api.create_repo(RECIPE_BASE)
    api.upload_folder(repo_id=RECIPE_BASE, folder_path=save_tiny_gpt2(root / "base"))
    outputs = {}
    for repo, scorer in ((RECIPE_RUN, "qana"), (RECIPE_BASELINE, "none")):
        outputs[repo] = root / repo.split("/")[1]
        flags = clm_flags(assets, "--model_name_or_path", RECIPE_BASE, "--scorer", scorer, "--checkpointing_steps", "2")
        flags += ["--push_to_hub", "--hub_model_id", repo, "--hub_token", TOKEN, "--attention_map_layer", "none"]
        with in_process_runs():
            from recipes_helpers import finetune_in_process

            finetune_in_process(outputs[repo], *flags)
    from transformers import GPT2LMHeadModel

    local = GPT2LMHeadModel.from_pretrained(outputs[RECIPE_RUN]).eval()  # the run's own folder, patched
    by_repo_id = hf_neural_attn.from_pretrained(RECIPE_RUN)
    return {
        "local_files": sorted(path.name for path in outputs[RECIPE_RUN].iterdir()),
        "patched": hf_neural_attn.is_patched(by_repo_id),
        "difference": max_difference(local, by_repo_id, "gpt2"),
    }


# ------------------------------------------------------------------------------------------------ running


class _NotInstalled(importlib.abc.MetaPathFinder):
    """Answers for hf_neural_attn as Python does for a package that is not installed."""

    def find_spec(self, name, path=None, target=None):
        if name == "hf_neural_attn" or name.startswith("hf_neural_attn."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)


def block_the_library() -> None:
    """Make ``import hf_neural_attn`` fail as where it is not installed (the venv installs it in editable mode, so
    taking it off the path is not enough); called before transformers is imported."""
    sys.meta_path.insert(0, _NotInstalled())


STEPS = {
    "full_checkpoints": full_checkpoints,
    "revisions": revisions,
    "save_pretrained_push": save_pretrained_push,
    "own_card": own_card,
    "adapters": adapters,
    "private_repos": private_repos,
    "without_the_library": without_the_library,
    "recipe_push": recipe_push,
}


def main() -> None:
    """``STEP[=ARGUMENT] ...`` from argv: run each, print ``{step: result}`` as JSON on the last line."""
    results = {}
    for spec in sys.argv[1:]:
        name, _, argument = spec.partition("=")
        try:
            results[name] = STEPS[name](*([argument] if argument else []))
        except Exception:
            results[name] = {"error": traceback.format_exc()}
    print("\n" + json.dumps(results))  # on a line of its own: transformers' prompts end without a newline
