"""recipes/sweep/ (plan.py, run.py, report.py, the command line): planning and validation, a killed sweep that
resumes, the report, and the shipped sweep configs.

Runs use the tiny GPT-2 and text files of recipes_helpers (4 optimizer steps each, about a second a run).
"""

from __future__ import annotations

import csv
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import recipes_helpers as helpers
import yaml
from recipes_helpers import (  # fresh_accelerate_state, one_thread: autouse fixtures
    fresh_accelerate_state,  # noqa: F401
    one_thread,  # noqa: F401
    read_history,
    read_results,
    tiny_recipe_assets,
)

from recipes import checkpointing, report, scorer_plots, stats, sweep, training
from recipes.errors import RecipeError
from recipes.patch_flags import scorer_flags
from recipes.sweep import plan as sweep_plan
from recipes.sweep import report as sweep_report
from recipes.sweep import run as sweep_run

# The QANA options of the paper's ablations (hf_neural_attn/scorers/qana.py); the shipped QANA sweep needs them.
QANA_ABLATION_OPTIONS = ("key_dim", "skip", "rope", "u_rank")
# Runs per grid of each shipped sweep (configurations x seeds, baselines included), as their comments state.
SHIPPED_RUNS = {
    ("qana_ablations", "full"): 14 * 3,
    ("qana_ablations", "reduced"): 11 * 2,
    ("neural_attention_paper", "full"): 7 * 3,
    ("neural_attention_paper", "reduced"): 6 * 2,
}


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return tiny_recipe_assets(tmp_path_factory.mktemp("sweep_assets"))


@pytest.fixture
def no_run_plots(monkeypatch):
    """Each run's own pictures (training curves, scorer history) take most of a tiny run's time and are tested in
    test_recipes_finetune.py; the sweep's tests skip them."""
    monkeypatch.setattr(scorer_plots, "draw", lambda *args, **kwargs: {})
    monkeypatch.setattr(report, "plot_training", lambda *args, **kwargs: None)


def tiny_base(assets, output_dir: Path, **extra) -> dict:
    return {
        "task": "clm",
        "model_name_or_path": str(assets["gpt2"]),
        "train_file": str(assets["train_txt"]),
        "validation_file": str(assets["validation_txt"]),
        "block_size": 32,
        "per_device_train_batch_size": 4,
        "per_device_eval_batch_size": 8,
        "learning_rate": 1.0e-2,
        "max_train_steps": 4,
        "eval_steps": 2,
        "checkpointing_steps": 2,
        "scorer": "qana",
        "h": 2,
        "attention_map_layer": "none",
        "output_dir": str(output_dir),
        **extra,
    }


def write_config(path: Path, **values) -> Path:
    path.write_text(yaml.safe_dump(values, sort_keys=False))
    return path


# ------------------------------------------------------------------------------------------ validation


def bad_configs(assets, tmp_path):
    base = tiny_base(assets, tmp_path / "out")
    return {
        "unknown top-level key": ({"base": base, "axis": {"h": [1]}}, "unknown key.*'axis'"),
        "unknown flag in base": ({"base": {**base, "learning_rat": 1}}, r"base:, has unknown key.*learning_rat"),
        "unknown flag in an axis value": ({"base": base, "axes": {"x": [{"hh": 2}]}}, r"unknown flag\(s\) \['hh'\]"),
        "scalar values for an axis that is no flag": ({"base": base, "axes": {"width": [1, 2]}}, "not a recipe flag"),
        "a value the recipe refuses": ({"base": base, "axes": {"h": [2, 0]}}, "Run 'h=0'.*Invalid patch options"),
        "a choice the recipe does not have": ({"base": base, "axes": {"activation": ["gelu", "swish"]}}, "swish"),
        "a wrong type": ({"base": {**base, "max_train_steps": "many"}}, "max_train_steps must be an integer"),
        "a step count that is no number": (
            {"base": {**{k: v for k, v in base.items() if k != "checkpointing_steps"}, "max_train_steps": "ten"}},
            "max_train_steps must be an integer, got 'ten'",
        ),
        "an option only the model refuses": (
            {"base": base, "axes": {"key_dim": [None, 8]}},
            "Run 'key_dim=8'.*Cannot patch GPT2LMHeadModel.*key_dim is not supported on GPT2Attention",
        ),
        "gate warmup without its length": ({"base": base, "axes": {"gate_schedule": ["warmup"]}}, "gate_warmup"),
        "unknown mode": ({"base": base, "mode": "random"}, "mode must be one of"),
        "no seeds": ({"base": base, "seeds": 0}, "seeds must be at least 1"),
        "repeated seeds": ({"base": base, "seeds": [1, 1]}, "distinct integers"),
        "baseline not a bool": ({"base": base, "baseline": "yes"}, "baseline must be true or false"),
        "same label twice": ({"base": base, "axes": {"lr": [{"learning_rate": 1e-3, "label": "a"}] * 2}}, "label"),
        "sweeping the seed": ({"base": base, "axes": {"seed": [1, 2]}}, "cannot be swept"),
        "uploading": ({"base": {**base, "push_to_hub": True}}, "push_to_hub cannot be set in a sweep"),
        "a baseline of a baseline": ({"base": {**base, "scorer": "none", "h": None}, "baseline": True}, "a baseline"),
        "a baseline with nothing to train": (
            {"base": {**base, "load_in_4bit": True, "train_only_new_params": True}, "baseline": True},
            r"Run 'base' of .*: --load_in_4bit --train_only_new_params trains the scorers alone, and its unpatched",
        ),
        "reduced that names an unknown axis": (
            {"base": base, "axes": {"h": [2]}, "reduced": {"axes": {"d": [1]}}},
            "reduced.axes names 'd'",
        ),
    }


def test_bad_sweep_configs_fail_before_anything_runs(assets, tmp_path, monkeypatch):
    monkeypatch.setattr(training, "run", lambda args: pytest.fail("a run started"))
    for name, (values, message) in bad_configs(assets, tmp_path).items():
        path = write_config(tmp_path / f"{name.replace(' ', '_')}.yaml", **values)
        with pytest.raises(RecipeError, match=message):
            sweep_plan.build_plan(path, "reduced" if "reduced" in values else "full")
    assert not (tmp_path / "out").exists()
    config = write_config(tmp_path / "ok.yaml", base=tiny_base(assets, tmp_path / "out"), axes={"h": [2, 4]})
    with pytest.raises(RecipeError, match="has no reduced: section"):
        sweep_plan.build_plan(config, "reduced")
    with pytest.raises(RecipeError, match=r"The command line sets \['--h'\], which the sweep varies"):
        sweep_plan.build_plan(config, "full", ["--h", "8"])
    listed = write_config(tmp_path / "listed.yaml", base=tiny_base(assets, tmp_path / "out"), seeds=[3, 4])
    with pytest.raises(RecipeError, match="lists its seeds"):
        sweep_plan.build_plan(listed, "full", ["--seed", "8"])
    assert sweep_plan.build_plan(config, "full", ["--seed", "8"]).seeds == (8,)


def test_a_bad_config_is_one_line_and_leaves_nothing_behind(assets, tmp_path, capsys, monkeypatch):
    """On the command line, as met: a value only the model refuses is found before the first run trains (no run
    folder, no record), and once the config is fixed the same command runs."""
    trained = []
    monkeypatch.setattr(training, "run", lambda args: trained.append(args.output_dir))
    base = tiny_base(assets, tmp_path / "out")
    config = write_config(tmp_path / "sweep.yaml", base=base, axes={"h": [1, 2], "key_dim": [None, 8]})
    assert sweep.main(["--config", str(config)]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "key_dim is not supported" in error[0]
    assert trained == [] and not (tmp_path / "out").exists()
    write_config(tmp_path / "sweep.yaml", base=base, axes={"h": [1, 2]})
    assert sweep.main(["--config", str(config), "--dry_run"]) == 0
    assert "0 done, 0 interrupted, 2 to run" in capsys.readouterr().out  # h=2 is the base point


def test_help_lists_the_sweeps_flags_and_the_finetune_flags_it_passes_on(capsys):
    with pytest.raises(SystemExit) as exit_info:
        sweep.main(["--help"])
    assert exit_info.value.code == 0
    printed = capsys.readouterr().out
    assert printed.startswith("usage: python -m recipes.sweep ")
    for flag in ("--config", "--grid", "--report_only", "--dry_run", "--learning_rate", "--config_overrides", "--h"):
        assert f"{flag} " in printed, flag
    for refused in ("--push_to_hub", "--hub_model_id", "--resume_from_checkpoint"):  # a sweep refuses them
        assert refused not in printed


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--config", "sweep.yaml", "--bogus"], "unrecognized arguments: --bogus"),
        (["--config", "sweep.yaml", "--learning_rate", "fast"], "argument --learning_rate: invalid float value"),
        (["--config", "sweep.yaml", "--grid", "tiny"], "argument --grid: invalid choice: 'tiny'"),
    ],
)
def test_a_bad_flag_is_an_error_of_the_sweep(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        sweep.main(argv)
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert f"python -m recipes.sweep: error: {message}" in error and "finetune.py" not in error


@pytest.mark.parametrize("overrides", list(helpers.BAD_OVERRIDES))
def test_a_bad_config_override_in_base_stops_the_sweep_before_anything_runs(overrides, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(training, "run", lambda args: pytest.fail("a run started"))
    base = {"model_type": "gpt2", "dataset_name": "pydoc_data", "block_size": 32, "max_train_steps": 1}
    base.update(config_overrides=overrides, output_dir=str(tmp_path / "out"))
    config = write_config(tmp_path / "sweep.yaml", base=base, axes={"h": [1, 2]}, baseline=True)
    assert sweep.main(["--config", str(config)]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and error[0].startswith("sweep: error: Run 'base' of sweep ")
    assert re.search(helpers.BAD_OVERRIDES[overrides], error[0]), error[0]
    assert not (tmp_path / "out").exists()


def test_sweep_plan_grid_reduced_and_command_line_overrides(assets, tmp_path):
    config = write_config(
        tmp_path / "grid.yaml",
        mode="grid",
        base={**tiny_base(assets, tmp_path / "out"), "model_name_or_path": None, "model_type": "gpt2"},
        axes={
            "h": [2, 4],
            "proj": [{"layers": "0", "label": "first"}, {"layers": "all", "learning_rate": 2e-2, "label": "all"}],
        },
        seeds=[5, 9],
        baseline=True,
        reduced={"seeds": 1, "base": {"max_train_steps": 2}, "axes": {"proj": None, "h": [4]}},
    )
    plan = sweep_plan.build_plan(
        config, "full", ["--model_name_or_path", str(assets["gpt2"]), "--weight_decay", "0.05"]
    )
    names = [c.name for c in plan.configurations]
    # Grid: every combination; a baseline for each value of the axis that changes more than the patch (first only
    # sets layers, a patch flag: its baseline is the plain one).
    assert names == [
        "baseline",
        "baseline__proj=all",
        "h=2__proj=first",
        "h=2__proj=all",
        "h=4__proj=first",
        "h=4__proj=all",
    ]
    assert plan.by_name("h=4__proj=all").baseline == "baseline__proj=all"
    runs = plan.runs()
    assert [(r.configuration, r.seed) for r in runs[:3]] == [
        ("baseline", 5),
        ("baseline__proj=all", 5),
        ("h=2__proj=first", 5),
    ]
    assert len(runs) == 12 and {r.seed for r in runs} == {5, 9}
    run = plan.by_name("h=4__proj=first").runs[1]
    assert run.output_dir == tmp_path / "out" / "h=4__proj=first" / "seed_9"
    # The command line overrides base for every run; a model named there replaces the config's model_type.
    assert (run.args.weight_decay, run.args.model_type, run.args.model_name_or_path) == (
        0.05,
        None,
        str(assets["gpt2"]),
    )
    assert run.args.learning_rate == 1e-2 and plan.by_name("h=2__proj=all").runs[0].args.learning_rate == 2e-2
    assert (run.args.seed, run.args.layers, run.args.h, run.args.resume_from_checkpoint) == (9, [0], 4, "latest")
    assert plan.by_name("h=2__proj=first").baseline == "baseline"
    assert plan.by_name("baseline__proj=all").runs[0].args.scorer == "none"

    reduced = sweep_plan.build_plan(config, "reduced", ["--model_name_or_path", str(assets["gpt2"])])
    assert [c.name for c in reduced.configurations] == ["baseline", "h=4"]
    assert reduced.seeds == (5,) and reduced.runs()[1].args.max_train_steps == 2

    # Ablation (the default): the base point once, an axis value equal to the base maps onto it.
    ablation = write_config(tmp_path / "ablation.yaml", base=tiny_base(assets, tmp_path / "a"), axes={"h": [1, 2, 4]})
    plan = sweep_plan.build_plan(ablation)
    assert [c.name for c in plan.configurations] == ["base", "h=1", "h=4"]
    assert [(tuple(v.label for v in choices), name) for choices, name in plan.cells] == [
        ((), "base"),
        (("1",), "h=1"),
        (("2",), "base"),
        (("4",), "h=4"),
    ]
    # Sweep runs checkpoint, so that a killed one resumes: every quarter of the budget by default.
    no_checkpoints = {**tiny_base(assets, tmp_path / "b"), "checkpointing_steps": None, "max_train_steps": 8}
    plan = sweep_plan.build_plan(write_config(tmp_path / "c.yaml", base=no_checkpoints))
    assert (plan.runs()[0].args.checkpointing_steps, plan.runs()[0].args.checkpoints_total_limit) == ("2", 1)


# -------------------------------------------------------------------------------------- kill and resume


def test_a_killed_sweep_resumes_its_interrupted_run_and_skips_finished_ones(
    assets, tmp_path, monkeypatch, capsys, no_run_plots
):
    out = tmp_path / "sweep"
    config = write_config(tmp_path / "s.yaml", base=tiny_base(assets, out), axes={"h": [2, 4]}, seeds=2)
    original_save = training.save_checkpoint

    def killed_after_first_checkpoint_of_h4(state, name):
        original_save(state, name)
        if Path(state.args.output_dir) == out / "h=4" / "seed_42":
            raise KeyboardInterrupt("killed")

    monkeypatch.setattr(training, "save_checkpoint", killed_after_first_checkpoint_of_h4)
    with pytest.raises(KeyboardInterrupt):
        sweep.main(["--config", str(config)])
    monkeypatch.setattr(training, "save_checkpoint", original_save)
    assert (out / "base" / "seed_42" / "all_results.json").is_file()
    interrupted = out / "h=4" / "seed_42"
    assert checkpointing.find_latest(interrupted) == interrupted / "step_2"
    assert (interrupted / sweep_plan.RUN_RECORD).is_file() and not (interrupted / "all_results.json").exists()
    assert not (out / "base" / "seed_43").exists() and not (out / "sweep.md").exists()

    plan = sweep_plan.build_plan(config)
    statuses = sweep_plan.check_run_folders(plan)
    assert [statuses[r.configuration, r.seed] for r in plan.runs()] == ["done", "interrupted", "pending", "pending"]
    read = []
    real_read = checkpointing.read_progress
    monkeypatch.setattr(checkpointing, "read_progress", lambda path: read.append(Path(path)) or real_read(path))
    log = sweep_run.run_sweep(plan, statuses)
    assert [(e["configuration"], e["seed"], e["action"]) for e in log] == [
        ("base", 42, "skipped"),
        ("h=4", 42, "resumed from step_2"),
        ("base", 43, "started"),
        ("h=4", 43, "started"),
    ]
    assert read == [interrupted / "step_2"]
    # The resumed run kept the evaluation from before the kill and finished the budget.
    assert [e["step"] for e in read_history(interrupted)["evaluations"]] == [2, 4]
    assert read_results(interrupted)["train_steps"] == 4 and read_results(interrupted)["settings"]["h"] == 4

    # Everything finished: a third run of the command runs nothing and writes the report.
    monkeypatch.setattr(training, "run", lambda args: pytest.fail(f"{args.output_dir} ran again"))
    assert sweep.main(["--config", str(config)]) == 0
    table = (out / "sweep.md").read_text()
    assert "| `base` | — (base) |" in table and "| `h=4` | h=4 |" in table and table.count("| 2/2 |") == 2
    assert "One seed" not in table and "± is the sample standard deviation over the 2 seeds" in table

    # A run recorded before a flag existed (settings without it) is the same run when the plan keeps its default.
    results_file = out / "base" / "seed_42" / "all_results.json"
    saved = json.loads(results_file.read_text())
    for flag in ("adam_beta1", "adam_beta2", "min_learning_rate", "train_stride"):
        del saved["settings"][flag]
    results_file.write_text(json.dumps(saved))
    plan = sweep_plan.build_plan(config)
    first = plan.runs()[0]
    assert sweep_plan.check_run_folders(plan)[first.configuration, first.seed] == "done"

    # A folder of a run with other settings is refused, naming the setting, before anything runs.
    changed = write_config(tmp_path / "s2.yaml", base=tiny_base(assets, out, learning_rate=0.5), axes={"h": [2, 4]})
    assert sweep.main(["--config", str(changed)]) == 2
    error = capsys.readouterr().err
    assert "holds a run with other settings (learning_rate: there 0.01, planned 0.5)" in error
    assert "Use another --output_dir" in error
    stray = out / "h=8" / "seed_42"
    stray.mkdir(parents=True)
    (stray / "notes.txt").write_text("mine")
    other = write_config(tmp_path / "s3.yaml", base=tiny_base(assets, out), axes={"h": [2, 8]})
    with pytest.raises(RecipeError, match="holds files but no sweep_run.json"):
        sweep_plan.check_run_folders(sweep_plan.build_plan(other))


# ---------------------------------------------------------------------------------------------- report


def test_sweep_report_pairs_each_configuration_with_its_baseline(assets, tmp_path, monkeypatch, no_run_plots):
    out = tmp_path / "sweep"
    config = write_config(
        tmp_path / "s.yaml",
        description="Tiny test sweep.",
        base=tiny_base(assets, out, checkpointing_steps=4),
        axes={"h": [2, 4]},
        seeds=2,
        baseline=True,
    )
    assert sweep.main(["--config", str(config)]) == 0
    values = {
        (name, seed): read_results(out / name / f"seed_{seed}")["perplexity"]
        for name in ("baseline", "base", "h=4")
        for seed in (42, 43)
    }
    assert read_results(out / "baseline" / "seed_42")["patch"] is None
    difference = stats.paired_difference(
        [values["h=4", 42], values["h=4", 43]], [values["baseline", s] for s in (42, 43)]
    )
    table = (out / "sweep.md").read_text()
    row = next(line for line in table.splitlines() if line.startswith("| `h=4` |"))
    assert stats.format_mean_std([values["h=4", 42], values["h=4", 43]]) in row
    assert f"| {stats.format_difference(difference)} | {stats.verdict(difference, False)} | 2/2 |" in row
    assert "| `baseline` | scorer=none | 0 |" in table and "![h](sweep_h.png)" in table
    assert helpers_png(out / "sweep_h.png")

    with open(out / "sweep.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert [(r["configuration"], r["seed"], r["status"]) for r in rows] == [
        (name, str(seed), "done") for name in ("baseline", "base", "h=4") for seed in (42, 43)
    ]
    assert rows[-1]["axis:h"] == "4" and float(rows[-1]["perplexity"]) == values["h=4", 43]
    assert rows[-1]["baseline"] == "baseline" and int(rows[-1]["params_added"]) > 0
    with open(out / "sweep_summary.csv") as handle:
        summary = {r["configuration"]: r for r in csv.DictReader(handle)}
    assert float(summary["h=4"]["ci_low"]) == pytest.approx(difference.ci_low)
    assert float(summary["h=4"]["diff_mean"]) == pytest.approx(difference.mean)
    card = (out / "SUMMARY.md").read_text()
    for section in ("Tiny test sweep.", "## What was run", "## Data", "## Model", "## Budget", "## Caveats"):
        assert section in card
    assert "seeds: 42, 43" in card and "runs finished: 6 of 6" in card and "Seed noise: 2 seeds" in card

    # --report_only: nothing runs; a run without results counts as unfinished and drops out of the pairing.
    (out / "h=4" / "seed_43" / "all_results.json").unlink()
    (out / "sweep.md").unlink()
    monkeypatch.setattr(training, "run", lambda args: pytest.fail("--report_only ran a run"))
    assert sweep.main(["--config", str(config), "--report_only"]) == 0
    row = next(line for line in (out / "sweep.md").read_text().splitlines() if line.startswith("| `h=4` |"))
    assert "| one seed: no error bar | 1/2 |" in row
    with open(out / "sweep.csv") as handle:
        statuses = {(r["configuration"], r["seed"]): r["status"] for r in csv.DictReader(handle)}
    assert statuses["h=4", "43"] == "interrupted" and statuses["h=4", "42"] == "done"


def test_a_sweep_of_parts_fine_tunes_an_earlier_parts_run_and_reports_its_metric(
    assets, tmp_path, monkeypatch, capsys, no_run_plots
):
    out = tmp_path / "study"
    pretrain = tiny_base(assets, out / "pretrain", scorer="none", h=None, checkpointing_steps=4)
    pretrained = out / "pretrain" / "base" / "seed_42"
    fine_tune = tiny_base(assets, out / "finetune", checkpointing_steps=4, eval_at_start=True)
    fine_tune["model_name_or_path"] = str(pretrained)
    config = write_config(
        tmp_path / "study.yaml",
        description="Pretrain, then fine-tune.",
        parts={
            "pretrain": {"base": pretrain},
            "finetune": {
                "base": fine_tune,
                "axes": {"h": [2]},
                "mode": "grid",
                "seeds": 2,
                "baseline": True,
                "metric": "eval_loss",
            },
        },
    )
    # Planned before anything ran: the second part waits for the first, whose run it fine-tunes.
    assert sweep.main(["--config", str(config), "--dry_run"]) == 0
    printed = capsys.readouterr().out
    assert "Sweep study/pretrain (full grid, ablation): 1 configuration x 1 seed = 1 run" in printed
    assert "Part 'finetune': planned once the parts before it have run" in printed and not out.exists()

    assert sweep.main(["--config", str(config)]) == 0
    assert helpers.read_results(pretrained)["patch"] is None
    patched = helpers.read_results(out / "finetune" / "h=2" / "seed_43")
    assert patched["model_source"] == str(pretrained) and patched["patch"]["scorer"] == "qana"
    # The report is in eval_loss (lower is better), with each run's step-0 value: the function-preserving patch
    # starts where its unpatched control does.
    table = (out / "finetune" / "sweep.md").read_text()
    assert "primary metric eval loss (lower is better)" in table and "| eval loss at step 0 |" in table
    assert "| peak memory (MiB, mean over seeds) |" in table and "![curves](sweep_curves.png)" in table
    assert helpers_png(out / "finetune" / "sweep_curves.png")
    with open(out / "finetune" / "sweep_summary.csv") as handle:
        summary = {r["configuration"]: r for r in csv.DictReader(handle)}
    assert summary["h=2"]["metric"] == "eval_loss" and float(summary["h=2"]["peak_rss_mib_mean"]) > 100
    starts = {name: float(summary[name]["at_start_mean"]) for name in ("baseline", "h=2")}
    assert starts["h=2"] == pytest.approx(starts["baseline"], abs=1e-4)
    finals = [helpers.read_results(out / "finetune" / "h=2" / f"seed_{s}")["eval_loss"] for s in (42, 43)]
    assert float(summary["h=2"]["mean"]) == pytest.approx(stats.mean(finals))

    # Rerun: nothing runs again.
    monkeypatch.setattr(training, "run", lambda args: pytest.fail(f"{args.output_dir} ran again"))
    assert sweep.main(["--config", str(config)]) == 0
    # --output_dir cannot move parts that read each other's runs.
    assert sweep.main(["--config", str(config), "--output_dir", str(tmp_path / "elsewhere")]) == 2
    assert "each with its own output_dir" in capsys.readouterr().err


def test_bad_parts_and_metrics_are_refused(assets, tmp_path):
    base = tiny_base(assets, tmp_path / "out")
    cases = {
        "parts beside a sweep's keys": ({"parts": {"a": {"base": base}}, "base": base}, r"unknown key\(s\) \['base'\]"),
        "a part that is no mapping": ({"parts": {"a": [1]}}, "part 'a' must be a sweep config"),
        "a part name that is no folder name": ({"parts": {"a/b": {"base": base}}}, "usable as a folder name"),
        "a metric the task does not report": ({"base": base, "metric": "accuracy"}, "metric 'accuracy' is not one"),
    }
    for name, (values, message) in cases.items():
        with pytest.raises(RecipeError, match=message):
            sweep_plan.build_plan(write_config(tmp_path / "bad.yaml", **values))
        assert not (tmp_path / "out").exists(), name


def fake_run(folder: Path, eval_loss: float, evaluations: list[tuple[int, float]], added: int = 0) -> None:
    """A finished run's files, as training writes them, with chosen numbers (for report tests that run nothing)."""
    folder.mkdir(parents=True)
    results = {
        "eval_loss": eval_loss,
        "perplexity": 2.718281828459045**eval_loss,
        "train_steps": evaluations[-1][0],
        "train_runtime_s": 10.0,
        "train_samples": 100,
        "num_processes": 1,
        "total_train_batch_size": 4,
        "parameters": {"total": 1000 + added, "trainable": 1000 + added, "added_by_patch": added, "added": added},
        "model_class": "GPT2LMHeadModel",
        "model_source": "tiny",
        "from_scratch": False,
        "data": {"dataset_name": "tiny text", "eval_split": "validation"},
    }
    (folder / report.RESULTS_FILE).write_text(json.dumps(results))
    history = {"evaluations": [{"step": s, "elapsed_s": s / 10, "eval_loss": v} for s, v in evaluations]}
    (folder / report.HISTORY_FILE).write_text(json.dumps(history))


def test_controls_extra_comparisons_and_holm(assets, tmp_path):
    # An unpatched axis value is a control, paired with the base's baseline; `compare` adds a pair; with
    # `correction: holm` every comparison of the table is one family, its verdicts read from Holm's p-values.
    out = tmp_path / "sweep"
    config = write_config(
        tmp_path / "s.yaml",
        base=tiny_base(assets, out, scorer_learning_rate=1.0e-3),
        axes={"layers": ["0"], "control": [{"scorer": "none", "max_train_steps": 8, "label": "longer"}]},
        seeds=3,
        baseline=True,
        metric="eval_loss",
        compare=[{"configuration": "base", "against": "control=longer"}],
        correction="holm",
    )
    plan = sweep_plan.build_plan(config)
    kinds = {c.name: (c.kind, c.baseline) for c in plan.configurations}
    assert kinds == {
        "baseline": ("baseline", None),
        "base": ("configuration", "baseline"),
        "layers=0": ("configuration", "baseline"),
        "control=longer": ("control", "baseline"),
    }
    control = plan.by_name("control=longer").runs[0].args
    assert (control.scorer, control.max_train_steps, control.scorer_learning_rate) == ("none", 8, None)
    assert plan.comparisons()[-1] == ("base", "control=longer") and len(plan.comparisons()) == 4

    finals = {
        "baseline": [2.00, 2.10, 2.20],
        "base": [1.90, 2.05, 2.10],
        "layers=0": [2.01, 2.08, 2.20],
        "control=longer": [1.95, 2.00, 2.15],
    }
    for name, values in finals.items():
        for seed, value in zip(plan.seeds, values):
            # Evaluations at 0, 2, 3 (the last at or before 3/4 of 4 steps) and 4: the last quarter's change is
            # value - (value + 0.01).
            fake_run(
                sweep_plan.sweep_run_folder(out, name, seed),
                value,
                [(0, 2.5), (2, value + 0.05), (3, value + 0.01), (4, value)],
                added=0 if "baseline" in name or "control" in name else 500,
            )
    sweep_report.write_report(plan)

    differences = {pair: stats.paired_difference(finals[pair[0]], finals[pair[1]]) for pair in plan.comparisons()}
    p_values = [d.p_value for d in differences.values()]
    holm = stats.holm_adjusted(p_values)
    with open(out / sweep_report.COMPARISONS_CSV) as handle:
        rows = list(csv.DictReader(handle))
    assert [(r["configuration"], r["against"]) for r in rows] == plan.comparisons()
    for row, difference, p, adjusted in zip(rows, differences.values(), p_values, holm):
        assert float(row["diff_mean"]) == pytest.approx(difference.mean)
        assert float(row["p_value"]) == pytest.approx(p) and float(row["p_holm"]) == pytest.approx(adjusted)
        assert row["verdict"] == stats.verdict(difference, False, p_adjusted=adjusted) and row["correction"] == "holm"
    # base vs its baseline: diffs -0.10, -0.05, -0.10, p = 0.020 alone; Holm over four: above 0.05.
    assert p_values[0] < 0.05 < holm[0] and rows[0]["verdict"] == "within seed noise"

    table = (out / "sweep.md").read_text()
    assert "| p | p, Holm (4 comparisons) |" in table and "Other comparisons:" in table
    other = next(line for line in table.splitlines() if line.startswith("| `base` | `control=longer` |"))
    assert stats.format_difference(differences["base", "control=longer"]) in other and "| 3 |" in other
    assert "change over the last quarter of the steps" in table
    with open(out / "sweep.csv") as handle:
        runs = list(csv.DictReader(handle))
    assert {float(r["eval_loss_at_start"]) for r in runs} == {2.5}
    assert next(r for r in runs if r["configuration"] == "base")["params_added"] == "500"
    with open(out / "sweep_summary.csv") as handle:
        summary = {r["configuration"]: r for r in csv.DictReader(handle)}
    assert float(summary["base"]["last_quarter_change_mean"]) == pytest.approx(-0.01)
    assert float(summary["control=longer"]["p_holm"]) == pytest.approx(holm[2])
    with open(out / sweep_report.HISTORY_CSV) as handle:
        history = list(csv.DictReader(handle))
    assert len(history) == 4 * 3 * 4 and history[1] == {
        "configuration": "baseline", "seed": "42", "step": "2", "elapsed_s": "0.2", "perplexity": "",
        "eval_loss": "2.05",
    }  # fmt: skip

    # While part of the family has not run, nothing is Holm-corrected: a family of 3 read as one of 4 would be
    # corrected for fewer comparisons than it holds.
    for seed in plan.seeds:
        (sweep_plan.sweep_run_folder(out, "layers=0", seed) / report.RESULTS_FILE).unlink()
    partial = sweep_report.summarize(plan)
    assert len(partial.comparisons) == 3 and all(c.p_adjusted is None for c in partial.comparisons)
    assert partial.comparisons[0].verdict == stats.verdict(differences["base", "baseline"], False)
    assert "p, Holm (4 comparisons)" in sweep_report.markdown_table(plan, partial)


def test_the_last_quarter_change_needs_an_evaluation_in_the_second_half():
    every_eighth = [{"step": 250 * i, "eval_loss": 2.0 - 0.01 * i} for i in range(9)]
    assert sweep_report.last_quarter_change(every_eighth, "eval_loss") == pytest.approx(-0.02)  # 1500 -> 2000
    ends_only = [{"step": 0, "eval_loss": 2.0}, {"step": 2000, "eval_loss": 1.5}]
    assert sweep_report.last_quarter_change(ends_only, "eval_loss") is None  # no last quarter to tell
    halves = [*ends_only[:1], {"step": 1000, "eval_loss": 1.7}, ends_only[1]]
    assert sweep_report.last_quarter_change(halves, "eval_loss") is None
    assert sweep_report.last_quarter_change([], "eval_loss") is None


def test_bad_controls_and_comparisons_are_refused(assets, tmp_path):
    base = tiny_base(assets, tmp_path / "out")
    axes = {"h": [4]}
    cases = {
        "an unknown run": ({"compare": [{"configuration": "h=4", "against": "h=8"}]}, "no run is named 'h=8'"),
        "a run against itself": ({"compare": [{"configuration": "h=4", "against": "h=4"}]}, "compared with itself"),
        "a baseline pair again": ({"compare": [{"configuration": "h=4", "against": "baseline"}]}, "listed twice"),
        "a malformed entry": ({"compare": [{"configuration": "h=4"}]}, "each compare entry is"),
        "an unknown correction": ({"correction": "bonferroni"}, "correction must be one of"),
    }
    for name, (extra, message) in cases.items():
        with pytest.raises(RecipeError, match=message):
            sweep_plan.build_plan(write_config(tmp_path / "bad.yaml", base=base, axes=axes, baseline=True, **extra))
    # A control that changes nothing but the scorer is the baseline itself: run once, as the baseline.
    same = sweep_plan.build_plan(
        write_config(
            tmp_path / "ok.yaml", base=base, axes={"control": [{"scorer": "none", "label": "same"}]}, baseline=True
        )
    )
    assert [c.name for c in same.configurations] == ["baseline", "base"]
    assert ((sweep_plan.AxisValue("control", "same", {"scorer": "none"}),), "baseline") in same.cells
    assert not (tmp_path / "out").exists()


@pytest.mark.spawns
def test_two_sweep_processes_share_the_runs(assets, tmp_path, monkeypatch, no_run_plots):
    out = tmp_path / "sweep"
    config = write_config(tmp_path / "s.yaml", base=tiny_base(assets, out), axes={"h": [2, 4]})
    plan = sweep_plan.build_plan(config)
    statuses = sweep_plan.check_run_folders(plan)
    first, second = plan.runs()
    # Another live process holds the first run: this one skips it; a lock whose process is gone is taken over.
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        first.output_dir.mkdir(parents=True)
        (first.output_dir / sweep_plan.RUN_LOCK).write_text(f"{sweep_run.socket.gethostname()} {holder.pid}")
        dead = subprocess.run(
            [sys.executable, "-c", "import os; print(os.getpid())"], check=True, capture_output=True, text=True
        )
        second.output_dir.mkdir(parents=True)
        (second.output_dir / sweep_plan.RUN_LOCK).write_text(f"{sweep_run.socket.gethostname()} {dead.stdout.strip()}")
        sweep_plan.check_run_folders(sweep_plan.build_plan(config))  # a lock alone is no stranger's folder
        log = sweep_run.run_sweep(plan, statuses)
    finally:
        holder.kill()
        holder.wait()
    assert [(e["configuration"], e["action"]) for e in log] == [
        ("base", "skipped (another process)"),
        ("h=4", "started"),
    ]
    assert not (first.output_dir / "all_results.json").exists() and (second.output_dir / "all_results.json").is_file()
    assert not (second.output_dir / sweep_plan.RUN_LOCK).exists()  # released when the run ended


def helpers_png(path: Path) -> bool:
    from PIL import Image

    with Image.open(path) as image:
        return image.format == "PNG" and image.size[0] > 300


# ------------------------------------------------------------------------------------- shipped configs


def test_shipped_sweeps_are_all_tested():
    # The ablation sweeps below; shakespeare_char and shakespeare_char_converged (parts: train, then fine-tune) in
    # test_shakespeare_char.py.
    shipped = {p.stem for p in (helpers.ROOT / "recipes" / "sweeps").glob("*.yaml")}
    assert shipped == {name for name, _ in SHIPPED_RUNS} | {"shakespeare_char", "shakespeare_char_converged"}


@pytest.mark.parametrize("grid", sweep_plan.GRIDS)
@pytest.mark.parametrize("name", sorted({name for name, _ in SHIPPED_RUNS}))
def test_shipped_sweep_configs_are_valid(name, grid):
    assert set(QANA_ABLATION_OPTIONS) <= set(scorer_flags())  # the QANA ablations' options are recipe flags
    path = helpers.ROOT / "recipes" / "sweeps" / f"{name}.yaml"
    plan = sweep_plan.build_plan(path, grid)
    assert len(plan.runs()) == SHIPPED_RUNS[name, grid], [c.name for c in plan.configurations]
    assert plan.baseline and plan.mode == "ablation" and len(plan.seeds) >= 2
    for run in plan.runs():  # offline: a model built from a config, the embedded pydoc_data text
        assert run.args.model_name_or_path is None and run.args.dataset_name == "pydoc_data"
        assert run.args.checkpointing_steps is not None
    assert json.dumps(plan.base_flags)  # plain values, for SUMMARY.md


@pytest.mark.spawns
def test_the_sweep_runs_as_a_module(tmp_path):
    # `python -m recipes.sweep` (recipes/sweep/__main__.py), as the docs run it: a shipped sweep's plan, nothing run.
    config = helpers.ROOT / "recipes" / "sweeps" / "qana_ablations.yaml"
    command = [sys.executable, "-m", "recipes.sweep", "--config", str(config), "--grid", "reduced", "--dry_run"]
    command += ["--output_dir", str(tmp_path)]
    finished = subprocess.run(
        command, cwd=helpers.ROOT, env=helpers.offline_env(), capture_output=True, text=True, timeout=300, check=False
    )
    assert finished.returncode == 0, finished.stderr[-2000:]
    assert f"11 configurations x 2 seeds = 22 runs in {tmp_path}; 0 done, 0 interrupted, 22 to run." in finished.stdout
    assert "pending      h=1 seed 42" in finished.stdout and not list(tmp_path.iterdir())
