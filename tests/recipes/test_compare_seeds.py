"""recipes/stats.py against values computed by hand or from tables, and ``recipes.compare --seeds N`` end to end on
the tiny assets of recipes_helpers (one seed: test_recipes_compare.py)."""

from __future__ import annotations

import csv
import math
import re

import pytest
from recipes_helpers import (  # fresh_accelerate_state, one_thread: autouse fixtures
    fresh_accelerate_state,  # noqa: F401
    one_thread,  # noqa: F401
    read_results,
    tiny_recipe_assets,
)

from recipes import stats
from recipes.args import parse_args
from recipes.compare import COMPARISON_PLOT, COMPARISON_TABLE, compare, main
from recipes.errors import RecipeError

# ------------------------------------------------------------------------------------------------ stats


@pytest.mark.parametrize("dof, expected", [(1, 12.706), (2, 4.303), (4, 2.776), (9, 2.262), (29, 2.045)])
def test_student_t_975_is_the_printed_table(dof, expected):
    # Two-sided 95 % critical values as every t table prints them.
    assert stats.student_t_975(dof) == expected


def test_student_t_975_against_closed_forms_and_between_rows():
    # dof = 1 is the Cauchy distribution, t = tan(0.475 pi); dof = 2: t = (2p - 1) sqrt(2 / (1 - (2p - 1)^2)).
    assert stats.student_t_975(1) == pytest.approx(math.tan(0.475 * math.pi), abs=5e-4)
    assert stats.student_t_975(2) == pytest.approx(0.95 * math.sqrt(2 / (1 - 0.95**2)), abs=5e-4)
    # Every row lies between its neighbours, above the normal quantile 1.95996.
    values = [stats.student_t_975(dof) for dof in sorted(stats.T_975)]
    assert values == sorted(values, reverse=True) and values[-1] > 1.95996
    # Between two rows, the row below: a wider interval, never a narrower one.
    assert stats.student_t_975(35) == stats.student_t_975(30) == 2.042
    assert stats.student_t_975(10**6) == stats.student_t_975(120) == 1.980
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="positive integer"):
            stats.student_t_975(bad)


def test_mean_std_and_paired_difference_by_hand():
    assert stats.mean([1.0, 2.0, 6.0]) == 3.0
    # Deviations -2, -1, 3: squares 4 + 1 + 9 = 14, / (3 - 1) = 7.
    assert stats.sample_std([1.0, 2.0, 6.0]) == pytest.approx(math.sqrt(7))
    assert stats.sample_std([5.0]) is None
    assert stats.format_mean_std([1.0, 2.0, 6.0]) == f"3.0000 ± {math.sqrt(7):.4f}"
    assert stats.format_mean_std([2.5]) == "2.5000"

    # Differences patched - baseline: -0.5, -0.3, -0.4 -> mean -0.4, std 0.1, half-width t(0.975, 2) 0.1 / sqrt 3.
    baseline, patched = [10.0, 11.0, 12.0], [9.5, 10.7, 11.6]
    difference = stats.paired_difference(patched, baseline)
    half = 4.303 * 0.1 / math.sqrt(3)
    assert (difference.n, difference.mean, difference.std) == (3, pytest.approx(-0.4), pytest.approx(0.1))
    assert difference.ci_low == pytest.approx(-0.4 - half) and difference.ci_high == pytest.approx(-0.4 + half)
    assert difference.relative == pytest.approx(-0.4 / 11 * 100)
    # Lower is better (perplexity): the interval [-0.648, -0.152] excludes 0.
    assert stats.verdict(difference, greater_is_better=False) == "difference larger than seed noise (better)"
    assert stats.verdict(difference, greater_is_better=True) == "difference larger than seed noise (worse)"
    assert stats.format_difference(difference) == (
        f"-0.4000 [{-0.4 - half:+.4f}, {-0.4 + half:+.4f}] ({-0.4 / 11 * 100:+.2f} %)"
    )

    # A difference too small for 4 decimals shows two significant digits, its interval as many decimals: differences
    # -0.00005, -0.00007, -0.00006 -> mean -0.00006, std 0.00001, half-width 4.303 * 0.00001 / sqrt 3 = 0.0000248;
    # relative to the baseline's mean 1.8406567: -0.0033 %.
    tiny = stats.paired_difference([1.84029, 1.84201, 1.83949], [1.84034, 1.84208, 1.83955])
    assert stats.format_difference(tiny) == "-0.000060 [-0.000085, -0.000035] (-0.0033 %)"

    # Differences +0.2 and -0.4: mean -0.1, std 0.4243, half-width 12.706 * 0.3 = 3.81: within the noise.
    noisy = stats.paired_difference([10.2, 10.6], [10.0, 11.0])
    assert noisy.ci_low == pytest.approx(-0.1 - 12.706 * 0.3, abs=1e-6)
    assert stats.verdict(noisy, greater_is_better=False) == "within seed noise"
    one = stats.paired_difference([9.0], [10.0])
    assert one.ci_low is None and stats.verdict(one, False) == "one seed: no error bar"
    # recipes.compare's threshold for one seed: -10 % is beyond 5 % (better when lower is better), not beyond 20 %.
    assert (stats.verdict(one, False, 5.0), stats.verdict(one, True, 5.0)) == ("better", "worse")
    assert stats.verdict(one, False, 20.0) == "no difference"
    with pytest.raises(ValueError, match="same seeds"):
        stats.paired_difference([1.0, 2.0], [1.0])


@pytest.mark.parametrize("dof", sorted(stats.T_975))
def test_the_t_test_p_value_at_the_tables_critical_values_is_five_percent(dof):
    # t_{0.975}(dof) is where the two-sided p-value is 0.05; the table rounds t to 3 decimals, which moves p by at
    # most 0.0003 at dof 1 (the density there is 0.0024 per 0.001 of t) and less above it.
    assert stats.paired_t_p_value(stats.student_t_975(dof), dof) == pytest.approx(0.05, abs=3e-4)


def test_the_t_test_p_value_in_closed_form():
    # dof 1 is Cauchy: p = 1 - 2 atan(t) / pi; dof 2: p = 1 - t / sqrt(2 + t^2).
    for t in (0.0, 0.3, 1.0, 4.0, 50.0):
        assert stats.paired_t_p_value(t, 1) == pytest.approx(1 - 2 * math.atan(t) / math.pi, rel=1e-12, abs=1e-15)
        assert stats.paired_t_p_value(-t, 2) == pytest.approx(1 - t / math.sqrt(2 + t * t), rel=1e-12, abs=1e-15)
    # The paired difference's own: differences -0.5, -0.3, -0.4 -> t = -0.4 / (0.1 / sqrt 3) = -6.928 at dof 2.
    difference = stats.paired_difference([9.5, 10.7, 11.6], [10.0, 11.0, 12.0])
    t = 0.4 / (0.1 / math.sqrt(3))
    assert difference.p_value == pytest.approx(1 - t / math.sqrt(2 + t * t), rel=1e-9)
    assert stats.paired_difference([9.0], [10.0]).p_value is None
    assert stats.paired_difference([9.0, 10.0], [10.0, 11.0]).p_value == 0.0  # no spread, a difference
    with pytest.raises(ValueError, match="degrees of freedom"):
        stats.paired_t_p_value(1.0, 0)


def test_holm_adjusts_a_family_step_down():
    # Sorted 0.005, 0.01, 0.03, 0.04 -> x4, x3, x2, x1 = 0.02, 0.03, 0.06, 0.04 -> kept non-decreasing: 0.06 last.
    assert stats.holm_adjusted([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert stats.holm_adjusted([0.5, 0.9]) == [1.0, 1.0] and stats.holm_adjusted([]) == []
    # A verdict read from the adjusted p-value: the interval of -0.5, -0.3, -0.4 excludes 0 (p = 0.020), but among
    # three comparisons whose smallest is smaller Holm multiplies it by 2: 0.040 < 0.05 still, by 3: 0.06 is not.
    difference = stats.paired_difference([9.5, 10.7, 11.6], [10.0, 11.0, 12.0])
    assert stats.verdict(difference, False, p_adjusted=2 * difference.p_value) == (
        "difference larger than seed noise (better)"
    )
    assert stats.verdict(difference, False, p_adjusted=3 * difference.p_value) == "within seed noise"


# ---------------------------------------------------------------------------------------------- compare


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return tiny_recipe_assets(tmp_path_factory.mktemp("compare_seeds_assets"))


def tiny_flags(assets, output_dir) -> list[str]:
    return [
        *("--task", "clm", "--model_name_or_path", str(assets["gpt2"]), "--train_file", str(assets["train_txt"])),
        *("--validation_file", str(assets["validation_txt"]), "--block_size", "32"),
        *("--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "8", "--learning_rate", "1e-2"),
        *("--max_train_steps", "3", "--eval_steps", "3", "--scorer", "qana", "--attention_map_layer", "none"),
        *("--output_dir", str(output_dir)),
    ]


def test_compare_with_two_seeds_reports_mean_std_and_the_paired_interval(assets, tmp_path, capsys):
    out = tmp_path / "compare"
    runs = compare(parse_args(tiny_flags(assets, out)), seeds=2)
    assert [(run["label"], run["seed"]) for run in runs] == [
        ("baseline", 42),
        ("qana", 42),
        ("baseline", 43),
        ("qana", 43),
    ]
    values = {}
    for seed in (42, 43):
        for name in ("baseline", "qana"):
            results = read_results(out / f"seed_{seed}" / name)
            assert results["settings"]["seed"] == seed
            values[name, seed] = results["perplexity"]
    assert values["baseline", 42] != values["baseline", 43], "the seeds made no difference"
    assert not (out / "baseline").exists()

    # The sweep's summary table: mean ± std over the seeds, the paired difference with its interval and verdict.
    table = (out / COMPARISON_TABLE).read_text()
    baseline = [values["baseline", 42], values["baseline", 43]]
    patched = [values["qana", 42], values["qana", 43]]
    assert f"| `baseline` | scorer=none | 0 | {stats.format_mean_std(baseline)} |" in table
    difference = stats.paired_difference(patched, baseline)
    assert f"| {stats.format_difference(difference)} | {stats.verdict(difference, False)} | 2/2 |" in table
    # The interval is Student's t with one degree of freedom around the mean difference.
    qana_row = next(line for line in table.splitlines() if line.startswith("| `qana` |"))
    low, high = map(float, re.search(r"\[([-+]\d[.\d]*), ([-+]\d[.\d]*)\]", qana_row).groups())
    half = 12.706 * abs((patched[0] - baseline[0]) - (patched[1] - baseline[1])) / 2
    assert (high - low) / 2 == pytest.approx(half, abs=1e-4)
    assert "perplexity (mean ± std)" in table and "95 % Student-t interval (1 degree of freedom)" in table
    # Each seed's values are in the sweep's sweep.csv.
    with open(out / "sweep.csv") as handle:
        rows = {(row["configuration"], int(row["seed"])): row for row in csv.DictReader(handle)}
    assert {key: float(row["perplexity"]) for key, row in rows.items()} == values
    assert (out / COMPARISON_PLOT).stat().st_size > 5_000
    assert "± " in capsys.readouterr().out

    assert main([*tiny_flags(assets, tmp_path / "bad"), "--seeds", "0"]) == 2
    assert "--seeds must be at least 1" in capsys.readouterr().err
    with pytest.raises(RecipeError, match="--seeds must be at least 1"):
        compare(parse_args(tiny_flags(assets, tmp_path / "bad")), seeds=0)
