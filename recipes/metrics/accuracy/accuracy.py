"""Accuracy as a local `evaluate` module (same inputs and output key as the Hub's ``accuracy``), for offline use.

metric = evaluate.load("recipes/metrics/accuracy")
metric.compute(predictions=[0, 1, 2], references=[0, 1, 1])   # {"accuracy": 0.666...}
"""

import datasets
import evaluate
import numpy as np

_DESCRIPTION = "Accuracy: the fraction of predictions equal to their reference label, computed offline with numpy."

_KWARGS_DESCRIPTION = """
Args:
    predictions: predicted labels (int).
    references: gold labels (int).
Returns: {"accuracy": float}
"""


class Accuracy(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}),
            format="numpy",
        )

    def _compute(self, predictions, references):
        return {"accuracy": float((np.asarray(predictions) == np.asarray(references)).mean())}
