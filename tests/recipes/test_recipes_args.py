"""The command line: recipes/args.py (flags), config_files.py, checks.py and the checks each task owns (recipes/tasks/),
and bad input that fails before training starts."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import recipes_helpers as helpers
from recipes_helpers import (  # fresh_accelerate_state, one_thread: autouse fixtures
    BAD_OVERRIDES,
    TINY_SCRATCH,
    clm_flags,
    finetune_in_process,
    fresh_accelerate_state,  # noqa: F401
    glue_file_args,
    one_thread,  # noqa: F401
    recipe_assets,
    write_glue_files,
)

import hf_neural_attn
from hf_neural_attn.scorers import NeuralAttentionConfig
from recipes.args import parse_args
from recipes.compare import main as compare_main
from recipes.errors import RecipeError
from recipes.finetune import main as finetune_main
from recipes.patch_flags import patch_settings, scorer_options
from recipes.tasks import TASKS


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return recipe_assets(tmp_path_factory.mktemp("recipe_assets"))


TINY_DISTILBERT = "n_layers=1,dim=32,n_heads=2,hidden_dim=64"  # a family the patch does not support


def test_config_file_stands_in_for_flags_and_command_line_wins(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(
        "task: sst2\nlearning_rate: 3e-4\nlayers: [0, 1]\nscorer: neural\nproj_dim: 2\ncheckpointing_steps: 50\n"
    )
    args = parse_args(["--config", str(config), "--learning_rate", "1e-3"])
    assert (args.task, args.learning_rate, args.layers, args.scorer, args.proj_dim) == (
        "sst2",
        1e-3,
        [0, 1],
        "neural",
        2,
    )
    assert args.checkpointing_steps == "50"
    json_config = tmp_path / "run.json"
    json_config.write_text(json.dumps({"task": "image", "scorer": "none", "num_train_epochs": 2}))
    args = parse_args([str(json_config)])  # a config file as the first argument, like the HF scripts
    assert (args.task, args.scorer, args.num_train_epochs) == ("image", "none", 2)
    assert args.output_dir == str(Path("outputs") / "image-none")


def test_shipped_configs_are_valid():
    configs = sorted((helpers.ROOT / "recipes" / "configs").glob("*.yaml"))
    assert len(configs) >= 5
    for path in configs:
        args = parse_args(["--config", str(path)])
        assert args.task in TASKS, path


def test_the_authors_code_config_is_the_paper_run_with_the_authors_scorer():
    """neural_attention_wikitext103_authors_code.yaml differs from its _paper twin in the scorer's options (and its
    output folder) only, and those are NeuralAttentionConfig.authors_code()."""
    configs = helpers.ROOT / "recipes" / "configs"
    paper, authors = (
        parse_args(["--config", str(configs / f"neural_attention_wikitext103_{name}.yaml")])
        for name in ("paper", "authors_code")
    )
    assert NeuralAttentionConfig.from_options(scorer_options(authors)) == NeuralAttentionConfig.authors_code(proj_dim=2)
    differing = {name for name, value in vars(paper).items() if getattr(authors, name) != value}
    assert differing <= {*patch_settings(), "output_dir", "config"}, differing


def test_bad_config_values_are_errors(tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text("task: translation\n")
    with pytest.raises(RecipeError, match="task='translation' is not one of"):
        parse_args(["--config", str(config)])
    config.write_text("learning_rat: 1e-3\n")
    with pytest.raises(RecipeError, match="unknown key"):
        parse_args(["--config", str(config)])


def test_unknown_task_on_the_command_line_is_a_clear_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--task", "summarization"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'summarization'" in capsys.readouterr().err


def bad_input_cases(assets, tmp_path):
    no_text = tmp_path / "no_text.csv"
    no_text.write_text("body,label\nhello there,1\nbye now,0\n")
    glue = write_glue_files(tmp_path / "glue", "mrpc")
    return {
        "missing file": (["--task", "clm", "--train_file", str(tmp_path / "nope.txt")], "does not exist"),
        "text column not there": (
            ["--task", "clm", "--train_file", str(no_text), "--text_column_name", "text"],
            "no text column 'text'",
        ),
        "glue column not there": (
            ["--task", "mrpc", *glue_file_args(glue), "--sentence2_key", "second"],
            "no second text column 'second'",
        ),
        "image model for a text task": (
            ["--task", "clm", "--model_name_or_path", str(assets["vit"])],
            "cannot take --task clm: transformers has no class with a causal language-modeling head for model type "
            "'vit'. Use a decoder",
        ),
        "text model for images": (
            [
                "--task",
                "image",
                "--model_name_or_path",
                str(assets["gpt2"]),
                "--train_dir",
                str(assets["images_train"]),
            ],
            "cannot take --task image: transformers has no class with an image-classification head for model type "
            "'gpt2'.",
        ),
        "push without a repository": (["--task", "clm", "--push_to_hub"], "--push_to_hub needs --hub_model_id"),
        "layer out of range": (
            ["--task", "clm", "--model_name_or_path", str(assets["gpt2"]), "--train_file", str(assets["train_txt"])]
            + ["--layers", "5"],
            "out of range",
        ),
        "unsupported family for the patch": (
            [
                *("--task", "mrpc", *glue_file_args(glue)),
                *("--model_type", "distilbert", "--config_overrides", TINY_DISTILBERT),
            ],
            "Cannot patch DistilBertForSequenceClassification",
        ),
        "baseline with patch options": (["--task", "clm", "--scorer", "none", "--h", "8"], "takes no patch options"),
        "scorer options that do not fit together": (
            ["--task", "clm", "--scorer", "neural", "--depth", "4", "--h", "4"],
            "depth=4 needs h >= 8",
        ),
        "freezing a from-scratch model": (
            ["--task", "clm", "--train_file", str(assets["train_txt"]), "--train_only_new_params"],
            "built from scratch",
        ),
        "image task with text files": (["--task", "image", "--train_file", str(assets["train_txt"])], "not files"),
        "nsea on a causal model": (
            ["--task", "clm", "--model_name_or_path", str(assets["gpt2"]), "--train_file", str(assets["train_txt"])]
            + ["--scorer", "nsea", "--mode", "replace"],
            "nsea cannot serve GPT2Attention, a causal",
        ),
        "nsea without mode replace": (["--task", "clm", "--scorer", "nsea"], "mode='replace'"),
        "gate schedule on the baseline": (
            ["--task", "clm", "--scorer", "none", "--gate_schedule", "fixed"],
            "--scorer none \\(the baseline\\) has no scorer",
        ),
        "gate schedule for a patch without gates": (
            ["--task", "clm", "--scorer", "neural", "--mode", "replace", "--gate_schedule", "fixed"],
            "--scorer neural with these options .* has none",
        ),
        "gate warmup without its length": (
            ["--task", "clm", "--gate_schedule", "warmup"],
            "needs --gate_warmup_steps N > 0",
        ),
        "gate warmup length without warmup": (
            ["--task", "clm", "--gate_warmup_steps", "3"],
            "--gate_warmup_steps is for --gate_schedule warmup only",
        ),
    }


def test_bad_inputs_fail_before_training(assets, tmp_path):
    for name, (flags, message) in bad_input_cases(assets, tmp_path).items():
        output_dir = tmp_path / name.replace(" ", "_")
        with pytest.raises(RecipeError, match=message):
            finetune_in_process(output_dir, *flags, "--max_train_steps", "2", "--block_size", "32")
        produced = list(output_dir.iterdir()) if output_dir.exists() else []
        assert produced == [], f"{name}: the failed run wrote {produced}"


def test_command_line_reports_errors_with_exit_code_2(tmp_path, capsys):
    assert finetune_main(["--task", "clm", "--train_file", str(tmp_path / "missing.txt")]) == 2
    assert "error: --train_file" in capsys.readouterr().err


def test_recipe_scorer_choices_are_the_library_registry():
    from recipes.patch_flags import SCORERS

    assert set(SCORERS) == {"none", *hf_neural_attn.scorers.SCORERS}


def test_gate_schedule_refuses_a_model_without_gates_even_when_the_options_cannot_tell(assets, tmp_path, monkeypatch):
    # The flags are checked by building the scorer on the meta device; where that cannot tell (None), the patched
    # model is checked before any data is prepared or anything written.
    from recipes import checks

    monkeypatch.setattr(checks, "scorer_has_gates", lambda scorer, options: None)
    out = tmp_path / "run"
    with pytest.raises(RecipeError, match=r"patch \(neural, .*mode=replace.*\) has none"):
        finetune_in_process(
            out, *clm_flags(assets, "--scorer", "neural", "--mode", "replace", "--gate_schedule", "fixed")
        )
    assert not out.exists()


@pytest.mark.parametrize("flags", [["--train_only_new_params"], ["--impl", "chunked"]], ids=["train_only_new", "impl"])
def test_a_patch_flag_without_any_patch_is_refused(assets, tmp_path, flags):
    # --scorer none takes these for a patched checkpoint; an unpatched model has nothing they could apply to.
    with pytest.raises(RecipeError, match=f"{flags[0]} needs a patch"):
        finetune_in_process(tmp_path / "run", *clm_flags(assets, "--scorer", "none", *flags))


@pytest.mark.parametrize("overrides", list(BAD_OVERRIDES))
@pytest.mark.parametrize(("main", "prog"), [(finetune_main, "finetune.py"), (compare_main, "compare.py")])
def test_a_bad_config_override_is_one_line_with_exit_code_2_before_training(main, prog, overrides, tmp_path, capsys):
    # compare.py checks both of its runs before the baseline trains (recipes.sweep's base: test_sweep.py).
    out = tmp_path / "run"
    assert main([*TINY_SCRATCH, "--config_overrides", overrides, "--output_dir", str(out)]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and error[0].startswith(f"{prog}: error: ")
    assert re.search(BAD_OVERRIDES[overrides], error[0]), error[0]
    assert not out.exists()


# Rates, their schedule and the other numbers a run takes that were unchecked until they failed (or did not) after the
# model had loaded: (flags, the message, a regular expression).
BAD_NUMBERS = {
    # The cosine would rise to 100x the rate asked for.
    "minimum above the rate": (
        ["--learning_rate", "1e-4", "--lr_scheduler_type", "cosine_with_min_lr", "--min_learning_rate", "1e-2"],
        r"--min_learning_rate 0.01 is above --learning_rate 0.0001",
    ),
    # One step, then a rate of 0.
    "negative minimum": (
        ["--lr_scheduler_type", "cosine_with_min_lr", "--min_learning_rate=-1e-4"],
        r"--min_learning_rate must be a finite number >= 0, got -0.0001",
    ),
    # AdamW refused it only once the model had loaded.
    "negative rate": (["--learning_rate=-1e-4"], r"--learning_rate must be a finite number >= 0, got -0.0001"),
    "rate that is not a number": (["--learning_rate", "nan"], r"--learning_rate must be a finite number >= 0"),
    "negative scorer rate": (["--scorer_learning_rate", "-1"], r"--scorer_learning_rate must be a finite number"),
    "cosine from a rate of 0": (
        ["--learning_rate", "0", "--lr_scheduler_type", "cosine_with_min_lr", "--min_learning_rate", "0"],
        r"cosine_with_min_lr decays --learning_rate: it must be above 0",
    ),
    "negative weight decay": (["--weight_decay", "-0.1"], r"--weight_decay must be a finite number >= 0"),
    # A negative clipping norm would turn every gradient around.
    "negative clipping norm": (["--max_grad_norm", "-1"], r"--max_grad_norm must be a finite number >= 0"),
    "negative seed": (["--seed", "-1"], r"--seed must be in \[0, 2\*\*32\), got -1"),
    "no checkpoints kept": (["--checkpoints_total_limit", "0"], r"--checkpoints_total_limit must be at least 1"),
    "negative workers": (["--preprocessing_num_workers", "-2"], r"--preprocessing_num_workers must be >= 0"),
    "no tokens per example": (["--max_seq_length", "0"], r"--max_seq_length must be at least 1, got 0"),
}


@pytest.mark.parametrize("case", list(BAD_NUMBERS))
def test_bad_rates_and_numbers_are_refused_naming_the_flag_before_anything_loads(assets, tmp_path, case, capsys):
    flags, message = BAD_NUMBERS[case]
    out = tmp_path / "run"
    assert finetune_main([*clm_flags(assets, *flags), "--output_dir", str(out)]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and error[0].startswith("finetune.py: error: ")
    assert re.search(message, error[0]), error[0]
    assert not out.exists()


def test_a_minimum_rate_at_or_below_the_rate_is_taken():
    flags = ["--learning_rate", "1e-3", "--lr_scheduler_type", "cosine_with_min_lr"]
    for minimum in ("1e-3", "1e-4", "0"):
        assert parse_args([*flags, "--min_learning_rate", minimum]).min_learning_rate == float(minimum)


@pytest.mark.parametrize(
    ("model_type", "overrides", "head_dim"),
    [
        # Llama stores head_dim = hidden_size // num_attention_heads (4096 // 32 = 128) when its config is made.
        ("llama", "hidden_size=256,num_attention_heads=4", 64),
        ("llama", "num_attention_heads=8,hidden_size=256,num_hidden_layers=1", 32),
        ("llama", "hidden_size=256,num_attention_heads=4,head_dim=16", 16),  # given: kept
        ("llama", "num_hidden_layers=1", 128),  # neither overridden: kept
        ("gemma", "hidden_size=256,num_attention_heads=4", 256),  # Gemma's own 256, not 3072 // 16: kept
        # Falcon's head_dim is a property of its config, hidden_size // num_attention_heads: it follows by itself.
        ("falcon", "hidden_size=256,num_attention_heads=4", 64),
    ],
)
def test_a_head_width_the_config_derived_follows_the_overridden_width_and_heads(model_type, overrides, head_dim):
    from recipes.modeling import load_config
    from recipes.tasks import get_task

    args = parse_args(["--task", "clm", "--model_type", model_type, "--config_overrides", overrides])
    assert load_config(args, get_task("clm")).head_dim == head_dim


def test_an_overridden_width_the_heads_do_not_divide_is_refused_when_the_head_width_follows_from_them():
    from recipes.modeling import load_config
    from recipes.tasks import get_task

    args = parse_args(["--task", "clm", "--model_type", "llama", "--config_overrides", "hidden_size=250"])
    with pytest.raises(RecipeError, match="hidden_size 250 is not a multiple of num_attention_heads 32.*set head_dim"):
        load_config(args, get_task("clm"))
