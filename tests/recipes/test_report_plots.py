"""The recipes' plots as a user reads them: training_curves.png (recipes.finetune) and comparison.png (recipes.compare).

Each test draws from made-up training histories and reads the saved figure back (tests/helpers/figures.py): the y
axis's drawn tick labels must reach below the lowest value drawn and above the highest (so the curves' last values
lie between labels), the last values are written out, and no two texts overlap.
"""

from __future__ import annotations

import math

import pytest
from helpers.figures import capture_saved_figures, drawn_tick_labels, overlapping_texts

from recipes import report

STEPS = [0, 40, 80, 120, 160, 200, 240]
# A run from scratch, as the offline demo's: perplexity near the vocabulary size at step 0, then down to about 14.
FROM_SCRATCH = [380.0, 40.2, 22.1, 17.4, 15.3, 14.4, 14.1]
# A fine-tune: a narrow range.
FINE_TUNE = [30.2, 29.6, 29.3, 29.1, 29.0, 28.95, 28.9]


def history(perplexities: list[float], scale: float = 1.0) -> dict:
    values = [value * scale for value in perplexities]
    return {
        "train_loss": [[step + 10, math.log(value) + 0.1] for step, value in zip(STEPS, values)],
        "evaluations": [
            {"step": step, "perplexity": value, "eval_loss": math.log(value)} for step, value in zip(STEPS, values)
        ],
    }


def assert_labels_span(axis, values: list[float]) -> None:
    labels = drawn_tick_labels(axis)
    assert len(labels) >= 3, [label.get_text() for _, label in labels]
    lowest, highest = labels[0][0], labels[-1][0]
    assert lowest <= min(values) and highest >= max(values), (
        f"the y labels run {lowest:g}..{highest:g}, the values drawn {min(values):g}..{max(values):g}"
    )
    # Every label says the value it stands at.
    assert all(float(label.get_text().replace("−", "-")) == pytest.approx(value) for value, label in labels)


@pytest.mark.parametrize(("curve", "scale"), [(FROM_SCRATCH, "log"), (FINE_TUNE, "linear")])
def test_training_curves_label_the_whole_range_and_the_last_value(curve, scale, tmp_path, monkeypatch):
    saved = capture_saved_figures(monkeypatch)
    report.plot_training(history(curve), "perplexity", tmp_path / report.PLOT_FILE, "a run")
    [(figure, _)] = saved
    loss_axis, metric_axis = figure.axes
    assert metric_axis.get_yscale() == scale  # logarithmic only over orders of magnitude
    assert_labels_span(metric_axis, curve)
    assert_labels_span(loss_axis, [value for _, value in history(curve)["train_loss"]])
    assert f"{curve[-1]:.4g} at step 240" in metric_axis.get_title()
    assert overlapping_texts(figure) == []


@pytest.mark.parametrize(("curve", "scale"), [(FROM_SCRATCH, "log"), (FINE_TUNE, "linear")])
def test_the_comparison_labels_the_whole_range_and_each_last_value(curve, scale, tmp_path, monkeypatch):
    saved = capture_saved_figures(monkeypatch)
    histories = {
        "baseline": [history(curve), history(curve, 1.01)],
        "qana": [history(curve, 0.97), None],  # one seed finished
    }
    report.plot_evaluation_curves(histories, "perplexity", tmp_path / "comparison.png", "baseline vs qana")
    [(figure, _)] = saved
    (axis,) = figure.axes
    assert axis.get_yscale() == scale
    drawn = [value * factor for value in curve for factor in (1.0, 1.01, 0.97)]  # the band's edges included
    assert_labels_span(axis, drawn)
    legend = [text.get_text() for text in axis.get_legend().get_texts()]
    assert legend == [
        f"baseline (mean of 2 seeds): {curve[-1] * 1.005:.4g} at step 240",
        f"qana: {curve[-1] * 0.97:.4g} at step 240",
    ]
    assert overlapping_texts(figure) == []
