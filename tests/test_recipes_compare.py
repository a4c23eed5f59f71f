"""recipes/compare.py in-process on the tiny assets of recipes_helpers: baseline and patched on the same budget, and
the offline demo; ``--seeds N`` is in test_compare_seeds.py."""

from __future__ import annotations

import math

import pytest
from recipes_helpers import (  # fresh_accelerate_state, one_thread: autouse fixtures
    clm_flags,
    fresh_accelerate_state,  # noqa: F401
    one_thread,  # noqa: F401
    png_size,
    tiny_recipe_assets,
)

from recipes import report, scorer_plots
from recipes.args import parse_args


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return tiny_recipe_assets(tmp_path_factory.mktemp("recipe_assets"))


def test_compare_runs_baseline_and_patched_on_the_same_budget(assets, tmp_path, capsys):
    from recipes.compare import compare

    out = tmp_path / "compare"
    args = parse_args(
        [*clm_flags(assets, "--scorer", "qana", "--eval_steps", "2", "--eval_at_start"), "--output_dir", str(out)]
    )
    baseline, patched = compare(args)
    table = (out / report.COMPARISON_TABLE).read_text()
    assert "| baseline | none (baseline) | 0 |" in table and "| qana | qana, h=4, layers=[0, 1] |" in table
    assert "Δ perplexity vs baseline" in table and (out / report.COMPARISON_PLOT).is_file()
    assert "| baseline |" in capsys.readouterr().out
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
    assert f"![evaluation curves]({report.COMPARISON_PLOT})" in table


def test_embedded_default_runs_offline_without_model_or_data_flags(tmp_path, capsys):
    # `finetune.py` with no arguments runs this demo; here with a smaller budget and model to stay fast.
    from recipes.compare import run_demo

    demo_flags = ["--max_train_steps", "2", "--eval_steps", "2", "--max_eval_samples", "4", "--max_train_samples", "64"]
    demo_flags += ["--config_overrides", "n_layer=1,n_embd=32,n_head=2", "--output_dir", str(tmp_path / "demo")]
    runs = run_demo(demo_flags)
    assert [run["label"] for run in runs] == ["baseline", "qana"]
    for run_info in runs:
        results = run_info["results"]
        assert results["data"]["dataset_name"] == "pydoc_data" and results["from_scratch"]
        assert "ByT5Tokenizer" in results["model_source"] and math.isfinite(results["perplexity"])
    assert "| qana |" in capsys.readouterr().out
