"""recipes/compare.py with one seed, in-process on the tiny assets of recipes_helpers: the table and pictures, a rerun
into the same folder, and the offline demo. One comparison (two 4-step runs) serves every test but the demo's;
``--seeds N`` is in test_compare_seeds.py."""

from __future__ import annotations

import contextlib
import io
import math
from dataclasses import dataclass
from pathlib import Path

import pytest
from recipes_helpers import (  # fresh_accelerate_state, one_thread: autouse fixtures
    clm_flags,
    fresh_accelerate_state,  # noqa: F401
    in_process_runs,
    one_thread,  # noqa: F401
    png_size,
    read_results,
    tiny_recipe_assets,
)

from recipes import scorer_plots, stats, training
from recipes.args import parse_args
from recipes.compare import COMPARISON_PLOT, COMPARISON_TABLE, compare, main, run_demo
from recipes.errors import RecipeError


@dataclass
class Comparison:
    out: Path
    flags: list[str]  # the patched run's flags, without --output_dir
    runs: list[dict]  # what compare returned
    printed: str  # what it printed


@pytest.fixture(scope="module")
def compared(tmp_path_factory) -> Comparison:
    root = tmp_path_factory.mktemp("compare")
    assets = tiny_recipe_assets(root / "assets")
    flags = clm_flags(assets, "--scorer", "qana", "--eval_steps", "2", "--eval_at_start")
    printed = io.StringIO()
    with in_process_runs(), contextlib.redirect_stdout(printed):
        runs = compare(parse_args([*flags, "--output_dir", str(root / "out")]))
    return Comparison(root / "out", flags, runs, printed.getvalue())


def test_compare_runs_baseline_and_patched_on_the_same_budget(compared):
    out, (baseline, patched) = compared.out, compared.runs
    table = (out / COMPARISON_TABLE).read_text()
    assert table.startswith("# clm: baseline vs qana, h=4, layers=[0, 1]\n")
    assert "| `baseline` | scorer=none | 0 |" in table and "| `qana` | scorer=qana |" in table
    assert "Δ perplexity vs baseline" in table and (out / COMPARISON_PLOT).is_file()
    assert "| `baseline` |" in compared.printed
    trained = (
        "* `baseline` trained all parameters; base weights in full precision.\n"
        "* `qana` trained all parameters; base weights in full precision.\n"
    )
    assert trained in table and trained in compared.printed
    for name in ("baseline", "qana"):
        assert (out / name / "all_results.json").is_file()
    # Same data, seed and budget; QANA is function-preserving, so both start from the same perplexity.
    start = [run["history"]["evaluations"][0] for run in (baseline, patched)]
    assert start[0]["step"] == start[1]["step"] == 0
    assert start[0]["perplexity"] == pytest.approx(start[1]["perplexity"], rel=1e-5)
    assert baseline["results"]["train_steps"] == patched["results"]["train_steps"] == 4
    assert baseline["results"]["patch"] is None and patched["results"]["patch"]["scorer"] == "qana"
    # The report shows the patched run's pictures, by paths that resolve from the report's folder.
    for name in (scorer_plots.SCORER_PLOT_FILE, scorer_plots.ATTENTION_PLOT_FILE):
        assert f"](qana/{name})" in table and png_size(out / "qana" / name)
        assert not (out / "baseline" / name).exists()  # nothing to draw without a patch
    assert f"![evaluation curves]({COMPARISON_PLOT})" in table


def test_compare_with_one_seed_says_there_is_no_error_bar(compared):
    out = compared.out
    table = (out / COMPARISON_TABLE).read_text()
    assert (out / "baseline" / "all_results.json").is_file() and (out / "qana" / "all_results.json").is_file()
    assert 'read "no difference"' in table and "One seed gives no error bar" in table
    assert not list(out.glob("seed_*"))
    # With one seed the verdict is the --no_difference_below threshold's (1 % by default).
    values = [read_results(out / name)["perplexity"] for name in ("qana", "baseline")]
    difference = stats.paired_difference(values[:1], values[1:])
    row = next(line for line in table.splitlines() if line.startswith("| `qana` |"))
    assert f"| {stats.format_difference(difference)} | {stats.verdict(difference, False, 1.0)} | 1/1 |" in row


def test_a_rerun_skips_the_finished_runs_and_refuses_runs_of_other_settings(compared, monkeypatch, capsys):
    out = compared.out
    table = (out / COMPARISON_TABLE).read_text()
    monkeypatch.setattr(training, "run", lambda args: pytest.fail(f"{args.output_dir} was trained again"))
    again = compare(parse_args([*compared.flags, "--output_dir", str(out)]))
    assert [(run["label"], run["action"]) for run in again] == [("baseline", "skipped"), ("qana", "skipped")]
    assert [run["results"] for run in again] == [run["results"] for run in compared.runs]
    assert (out / COMPARISON_TABLE).read_text() == table  # the report, written again from the same runs
    assert f"= 2 runs in {out}; 2 done, 0 interrupted, 0 to run." in capsys.readouterr().out

    # Other settings into the same folder: refused before anything runs, naming each folder and setting.
    changed = [*compared.flags, "--learning_rate", "0.5", "--output_dir", str(out)]
    with pytest.raises(RecipeError, match=r"qana holds a run with other settings \(learning_rate: there 0.001"):
        compare(parse_args(changed))
    assert main(changed) == 2
    error = capsys.readouterr().err
    assert error.startswith("compare.py: error:") and "Use another --output_dir" in error
    assert "baseline holds a run with other settings (learning_rate: there 0.001, planned 0.5)" in error


def test_embedded_default_runs_offline_without_model_or_data_flags(tmp_path, capsys):
    # `compare` with no arguments runs this demo (`make demo`); here with a smaller budget and model to stay fast.
    demo_flags = ["--max_train_steps", "2", "--eval_steps", "2", "--max_eval_samples", "4", "--max_train_samples", "64"]
    demo_flags += ["--config_overrides", "n_layer=1,n_embd=32,n_head=2", "--output_dir", str(tmp_path / "demo")]
    runs = run_demo(demo_flags)
    assert [run["label"] for run in runs] == ["baseline", "qana"]
    for run_info in runs:
        results = run_info["results"]
        assert results["data"]["dataset_name"] == "pydoc_data" and results["from_scratch"]
        assert "ByT5Tokenizer" in results["model_source"] and math.isfinite(results["perplexity"])
    assert "| `qana` |" in capsys.readouterr().out


def test_help_lists_the_comparisons_flags_and_the_finetune_flags_it_passes_on(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    printed = capsys.readouterr().out
    assert printed.startswith("usage: compare.py ")
    for flag in ("--seeds", "--no_difference_below", "--config", "--learning_rate", "--config_overrides", "--h"):
        assert f"{flag} " in printed, flag
    for refused in ("--push_to_hub", "--hub_model_id", "--resume_from_checkpoint"):  # compare refuses them
        assert refused not in printed


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--bogus"], "unrecognized arguments: --bogus"),
        (["--seeds", "2", "--learning_rate", "fast"], "argument --learning_rate: invalid float value: 'fast'"),
        (["--seeds", "two"], "argument --seeds: invalid int value: 'two'"),
    ],
)
def test_a_bad_flag_is_an_error_of_compare(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert f"compare.py: error: {message}" in error and "finetune.py" not in error


def quantized_comparison_flags(tmp_path, *extra: str) -> list[str]:
    """A comparison's flags on a quantized pretrained base (planning the comparison reads its config; nothing trains)."""
    from recipes_helpers import save_tiny_llama

    model, text = save_tiny_llama(tmp_path / "llama"), tmp_path / "train.txt"
    text.write_text("unused\n")
    return ["--model_name_or_path", str(model), "--train_file", str(text), "--task", "clm", "--scorer", "qana"] + [
        *extra,
        *("--max_train_steps", "4", "--output_dir", str(tmp_path / "out")),
    ]


def test_a_qlora_comparison_says_how_both_runs_trained(tmp_path):
    from recipes.compare import comparison_plan, how_trained

    args = parse_args(quantized_comparison_flags(tmp_path, "--load_in_4bit", "--lora_r", "4"))
    lora = "LoRA adapters (r=4, alpha=8, dropout=0.05, on all-linear)"
    base = "base weights bitsandbytes 4-bit NF4, matmuls in float32"
    assert how_trained(comparison_plan(args)) == (
        f"* `baseline` trained {lora}; {base}.\n* `qana` trained {lora} and the new parameters; {base}.\n\n"
    )


@pytest.mark.parametrize("quantization", [["--load_in_4bit"], ["--torchao", "int8_weight_only"]])
def test_a_scorer_only_comparison_on_a_quantized_base_is_refused_for_its_baseline_naming_what_to_do(
    tmp_path, capsys, quantization
):
    """Its baseline (--scorer none) would have nothing to train; the message names the flags given and the way out,
    rather than asking for --train_only_new_params, which was given."""
    flag = " ".join(quantization)
    flags = quantized_comparison_flags(tmp_path, *quantization, "--train_only_new_params")
    capsys.readouterr()  # what saving the model printed
    assert main(flags) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and error[0].startswith(f"compare.py: error: {flag} --train_only_new_params trains the ")
    assert "baseline (--scorer none) would have nothing to train" in error[0]
    assert f"{flag} --lora_r 16 in place of --train_only_new_params" in error[0]
    assert not (tmp_path / "out").exists()
