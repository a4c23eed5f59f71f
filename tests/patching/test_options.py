"""Scorer options are declared once, in the scorer configs' dataclass fields; the recipes are generated from them.

Nothing here lists options by hand: every check walks the registry (hf_neural_attn.scorers.SCORERS) and each
config's declared fields, so a new option is covered the moment it is declared.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.models import tiny_model
from recipes_helpers import (  # fresh_accelerate_state: an autouse fixture
    ROOT,
    fresh_accelerate_state,  # noqa: F401
    offline_env,
    save_tiny_gpt2,
    write_text_files,
)

import hf_neural_attn
from hf_neural_attn.scorers import SCORERS, NeuralAttentionConfig
from recipes import hub, modeling, report, tasks
from recipes.args import build_parser, parse_args
from recipes.compare import baseline_args
from recipes.config_files import load_config_file
from recipes.errors import RecipeError
from recipes.finetune import main as finetune_main
from recipes.patch_flags import FLAG_FOR_OPTION, scorer_flags, scorer_options
from recipes.training import resume_settings, run


def declared_options():
    """(scorer, field) for every option every registered scorer declares."""
    return [(name, item) for name, scorer in SCORERS.items() for item in scorer.config_class.option_fields()]


def flag_of(option: str) -> str:
    return FLAG_FOR_OPTION.get(option, option)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("option_assets")
    train, validation = write_text_files(root / "text")
    return {"gpt2": save_tiny_gpt2(root / "tiny-gpt2"), "train": train, "validation": validation}


# ------------------------------------------------------------------------------------- declared once


def required_options(scorer: str) -> dict:
    """What a scorer needs beyond its defaults: NSEA and HEA refuse to build without mode='replace'."""
    try:
        SCORERS[scorer].config_class()
    except ValueError:
        return {"mode": "replace"}
    return {}


def test_every_declared_option_has_help_and_its_constraints_are_checked():
    for scorer, item in declared_options():
        assert item.metadata.get("help"), f"{scorer}.{item.name} declares no help text"
        config_class = SCORERS[scorer].config_class
        if item.metadata.get("choices"):
            with pytest.raises(ValueError, match=item.name):
                config_class(**{**required_options(scorer), item.name: "not-a-choice"})
        if item.metadata.get("minimum") is not None:
            with pytest.raises(ValueError, match=f"{item.name} must be"):
                config_class(**{**required_options(scorer), item.name: item.metadata["minimum"] - 1})
        if isinstance(item.default, bool):
            with pytest.raises(ValueError, match=f"{item.name} must be True or False"):
                config_class(**{**required_options(scorer), item.name: "no"})


def test_every_declared_option_is_a_recipe_flag_with_the_declared_help_and_choices():
    flags = build_parser().recipe_flags
    for scorer, item in declared_options():
        flag = flag_of(item.name)
        assert flag in flags, f"{scorer}.{item.name} has no recipe flag --{flag}"
        assert item.metadata["help"] in flags[flag]["help"]
        if item.metadata.get("choices"):
            assert set(item.metadata["choices"]) <= set(flags[flag]["choices"])


def test_every_declared_option_is_compared_on_resume_reset_for_the_baseline_and_a_config_key(tmp_path):
    settings = resume_settings()
    assert "terms" in settings  # the option the hand-kept lists had lost
    args = parse_args(["--scorer", "hea", "--mode", "replace", "--terms", "3", "--layers", "0"])
    base = baseline_args(args)
    assert base.scorer == "none" and base.layers is None
    parser = build_parser()
    for scorer, item in declared_options():
        flag = flag_of(item.name)
        assert flag in settings, f"resuming does not compare --{flag}"
        assert getattr(base, flag) is None, f"compare's baseline keeps --{flag}"
        config = tmp_path / f"{flag}.json"
        config.write_text(json.dumps({flag: None}))
        assert flag in load_config_file(str(config), parser)


def test_every_given_flag_reaches_patch_model_under_its_option_name():
    for scorer, item in declared_options():
        args = argparse.Namespace(**dict.fromkeys(scorer_flags()))
        setattr(args, flag_of(item.name), "value")
        assert scorer_options(args) == {item.name: "value"}


def test_resuming_with_different_terms_is_refused(assets, tmp_path):
    flags = ["--model_name_or_path", str(assets["gpt2"]), "--train_file", str(assets["train"])]
    flags += ["--validation_file", str(assets["validation"]), "--block_size", "32", "--max_train_steps", "2"]
    flags += ["--per_device_train_batch_size", "4", "--scorer", "hea", "--mode", "replace", "--terms", "2"]
    out = tmp_path / "hea"
    run(parse_args([*flags, "--checkpointing_steps", "2", "--output_dir", str(out)]))
    changed = [*flags, "--terms", "3", "--resume_from_checkpoint", str(out / "step_2"), "--output_dir", str(out)]
    with pytest.raises(RecipeError, match=r"different settings \(terms: checkpoint 2 vs now 3\)"):
        run(parse_args(changed))


# --------------------------------------------------------------------------------------------- values


@pytest.mark.parametrize(
    "make", [np.int64, np.int32, lambda v: torch.tensor(v), lambda v: torch.tensor(v, dtype=torch.int32)]
)
def test_numpy_and_tensor_integers_become_python_ints(make, assets):
    config = NeuralAttentionConfig(h=make(4), proj_dim=make(2), depth=make(2))
    assert (config.h, config.proj_dim, config.depth) == (4, 2, 2)
    assert all(type(v) is int for v in (config.h, config.proj_dim, config.depth))
    hea = SCORERS["hea"].config_class(mode="replace", terms=make(3))
    assert type(hea.terms) is int and hea.terms == 3
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(assets["gpt2"])
    hf_neural_attn.patch_model(model, "neural", h=make(4), proj_dim=make(2))
    json.dumps(model.config.hf_neural_attn)  # the record stays JSON-serialisable
    assert type(model.config.hf_neural_attn["options"]["h"]) is int


def test_non_integer_values_are_still_refused():
    for value in (2.0, np.float32(2), torch.tensor(2.0), torch.tensor([2]), True):
        with pytest.raises(ValueError, match="h must be a positive integer"):
            NeuralAttentionConfig(h=value)


def test_proj_dim_larger_than_the_head_dim_is_refused_before_the_model_changes(assets):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(assets["gpt2"])  # head dim 16
    with pytest.raises(ValueError, match="proj_dim=32 is larger than the head dimension 16"):
        hf_neural_attn.patch_model(model, "neural", proj_dim=32)
    assert not hf_neural_attn.is_patched(model)
    hf_neural_attn.patch_model(model, "neural", proj_dim=16)  # equal is fine


def test_depth_that_would_clamp_widths_is_refused():
    assert NeuralAttentionConfig(h=8, depth=4).hidden_widths() == [8, 4, 2, 1]
    with pytest.raises(ValueError, match="depth=4 needs h >= 8"):
        NeuralAttentionConfig(h=4, depth=4)


# ---------------------------------------------------------------------------------------- recipes


def test_flags_are_not_abbreviated(capsys):
    for flags in (["--lr", "1e-3"], ["--learning", "1e-3"], ["--model_name", "gpt2"]):
        with pytest.raises(SystemExit):
            parse_args(flags)
        assert "unrecognized arguments" in capsys.readouterr().err


def test_finetune_without_arguments_prints_usage(capsys):
    assert finetune_main([]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: finetune.py") and "recipes.compare" in err


@pytest.mark.spawns
def test_finetune_runs_by_its_script_path_from_any_directory(tmp_path):
    """`accelerate launch recipes/finetune.py` is the documented command: a script path, not a module."""
    script = Path(__file__).resolve().parents[2] / "recipes" / "finetune.py"
    finished = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False
    )
    assert finished.returncode == 2, finished.stderr[-2000:]
    assert finished.stderr.startswith("usage: finetune.py")


@pytest.mark.spawns
def test_recipes_import_one_way_and_the_library_needs_no_extra():
    # The extras' packages made unimportable (a None entry in sys.modules): the library still imports and patches.
    # (pyyaml is not among them: huggingface_hub, which transformers needs, requires it.)
    code = (
        "import sys\n"
        "for name in ('matplotlib', 'peft', 'accelerate', 'datasets', 'evaluate', 'PIL', 'tensorboard'):\n"
        "    sys.modules[name] = None\n"
        "import hf_neural_attn\n"
        "from transformers import GPT2Config, GPT2LMHeadModel\n"
        "model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))\n"
        "hf_neural_attn.patch_model(model, 'qana', h=2)\n"
        "print('library ok')\n"
    )
    process = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=offline_env(), capture_output=True, text=True, check=False
    )
    assert process.stdout.strip() == "library ok", process.stderr[-3000:]
    code = "import sys, recipes.finetune\nprint('recipes.compare' in sys.modules)\n"
    process = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=offline_env(), capture_output=True, text=True, check=False
    )
    assert process.stdout.strip() == "False", process.stderr[-3000:]


def test_push_to_hub_checks_the_hub_and_the_token_before_training(assets, tmp_path, monkeypatch):
    import huggingface_hub
    from huggingface_hub.errors import LocalTokenNotFoundError

    flags = ["--model_name_or_path", str(assets["gpt2"]), "--train_file", str(assets["train"])]
    flags += ["--block_size", "32", "--max_train_steps", "1", "--push_to_hub", "--hub_model_id", "someone/model"]
    out = tmp_path / "push"
    monkeypatch.setattr(hub, "is_offline", lambda: False)
    monkeypatch.setattr(hub, "_reachable", False)
    with pytest.raises(RecipeError, match="Hub .* is not reachable"):
        run(parse_args([*flags, "--output_dir", str(out)]))

    monkeypatch.setattr(hub, "_reachable", True)
    answers = []

    class Api:
        def __init__(self, token=None):
            pass

        def whoami(self):
            answer = answers[0]
            if isinstance(answer, Exception):
                raise answer
            return answer

    monkeypatch.setattr(huggingface_hub, "HfApi", Api)
    cases = [
        (LocalTokenNotFoundError("no token"), "not logged in"),
        ({"name": "someone", "auth": {"accessToken": {"role": "read"}}}, "read-only"),
        ({"name": "other", "orgs": [{"name": "team"}], "auth": {"accessToken": {"role": "write"}}}, "cannot create"),
    ]
    for answer, message in cases:
        answers[:] = [answer]
        with pytest.raises(RecipeError, match=message):
            run(parse_args([*flags, "--output_dir", str(out)]))
    assert not out.exists(), "a refused push must fail before the run writes anything"


def test_the_demo_data_can_be_selected_by_name(tmp_path):
    args = parse_args(["--model_name_or_path", str(tmp_path), "--dataset_name", "pydoc_data", "--scorer", "none"])
    assert hub.hub_resources(args) == []  # a local model and the shipped corpus: nothing from the Hub
    task = tasks.get_task("clm")
    raw = task.load_raw(args)
    assert task.info.dataset_name == "pydoc_data" and not task.info.hub_dataset
    assert len(raw["train"]) > 50 and len(raw["validation"]) > 3
    with pytest.raises(RecipeError, match="is for --task clm"):
        parse_args(["--task", "image", "--dataset_name", "pydoc_data"])


def test_an_image_run_names_no_text_tokenizer():
    assert "ByT5" not in modeling.describe_source(parse_args(["--task", "image"]))
    assert "ByT5Tokenizer" in modeling.describe_source(parse_args(["--task", "clm"]))


@pytest.mark.parametrize(
    ("scorer", "options", "layers", "line"),
    [
        ("qana", {"h": 8, "skip": False}, [0, 1], "qana, h=8, layers=[0, 1]"),
        ("neural", {"h": 4, "proj_dim": 2, "mode": "replace"}, [0], "neural, h=4, d'=2, mode=replace, layers=[0]"),
        ("nsea", {"mode": "replace", "terms": 2}, [1], "nsea, h=None, layers=[1]"),
    ],
)
def test_a_patch_is_named_in_one_line_by_the_options_its_scorer_names(tmp_path, scorer, options, layers, line):
    # Titles of reports and cards and the run's log; what all_results.json holds reads back the same.
    family = "bert" if scorer == "nsea" else "gpt2"  # NSEA scores non-causal attention only
    model = hf_neural_attn.patch_model(tiny_model(family), scorer, layers=layers, **options)
    record = hf_neural_attn.patch_record(model)
    assert report.describe_patch(record) == line
    assert report.describe_patch(json.loads(json.dumps(record.to_dict()))) == line
    assert report.describe_patch(None) == "none (baseline)"
