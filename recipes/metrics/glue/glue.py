"""GLUE metrics as a local `evaluate` module: the same configs, inputs and output keys as the Hub's
``glue`` metric, computed here with numpy so that they work offline.

    metric = evaluate.load("recipes/metrics/glue", "mrpc")
    metric.compute(predictions=[1, 0, 1], references=[1, 1, 1])   # {"accuracy": ..., "f1": ...}

Configs and what they return (the GLUE benchmark's official metrics):

* ``cola``: ``matthews_correlation``
* ``mrpc``, ``qqp``: ``accuracy`` and ``f1`` (binary, positive class 1)
* ``stsb``: ``pearson`` and ``spearmanr`` (Spearman with average ranks for ties)
* ``sst2``, ``mnli``, ``mnli_matched``, ``mnli_mismatched``, ``qnli``, ``rte``, ``wnli``, ``hans``: ``accuracy``

Degenerate inputs follow scikit-learn / SciPy: F1 and Matthews correlation are 0 when undefined
(no positive predictions and labels; a constant prediction), Pearson and Spearman are NaN when either
side is constant.
"""

import datasets
import evaluate
import numpy as np

_DESCRIPTION = """GLUE benchmark metrics (accuracy, F1, Matthews correlation, Pearson, Spearman), computed offline
with numpy. Output keys match the Hugging Face Hub `glue` metric."""

_KWARGS_DESCRIPTION = """
Args:
    predictions: predicted labels (int), or scores (float) for `stsb`.
    references: gold labels (int), or scores (float) for `stsb`.
Returns: a dict, depending on the config: `accuracy`, `f1`, `matthews_correlation`, `pearson`, `spearmanr`.
"""

_CITATION = """@inproceedings{wang2019glue,
  title={{GLUE}: A Multi-Task Benchmark and Analysis Platform for Natural Language Understanding},
  author={Wang, Alex and Singh, Amanpreet and Michael, Julian and Hill, Felix and Levy, Omer and Bowman, Samuel R.},
  booktitle={International Conference on Learning Representations},
  year={2019}
}"""

ACCURACY_CONFIGS = ("sst2", "mnli", "mnli_mismatched", "mnli_matched", "qnli", "rte", "wnli", "hans")
CONFIGS = ("cola", "mrpc", "qqp", "stsb") + ACCURACY_CONFIGS


def accuracy(predictions, references) -> float:
    predictions, references = np.asarray(predictions), np.asarray(references)
    return float((predictions == references).mean())


def f1_binary(predictions, references) -> float:
    """F1 of the positive class 1: 2TP / (2TP + FP + FN); 0 when there is no positive at all."""
    predictions, references = np.asarray(predictions) == 1, np.asarray(references) == 1
    tp = np.sum(predictions & references)
    fp = np.sum(predictions & ~references)
    fn = np.sum(~predictions & references)
    denominator = 2 * tp + fp + fn
    return float(2 * tp / denominator) if denominator else 0.0


def matthews_correlation(predictions, references) -> float:
    """Matthews correlation coefficient (multiclass form, as scikit-learn); 0 when undefined."""
    predictions, references = np.asarray(predictions), np.asarray(references)
    labels = np.union1d(predictions, references)
    index = {label: i for i, label in enumerate(labels)}
    confusion = np.zeros((len(labels), len(labels)), dtype=np.float64)
    for truth, guess in zip(references, predictions):
        confusion[index[truth], index[guess]] += 1
    true_sum, pred_sum = confusion.sum(axis=1), confusion.sum(axis=0)
    correct, samples = np.trace(confusion), confusion.sum()
    cov_true_pred = correct * samples - true_sum @ pred_sum
    cov_pred_pred = samples**2 - pred_sum @ pred_sum
    cov_true_true = samples**2 - true_sum @ true_sum
    denominator = np.sqrt(cov_true_true * cov_pred_pred)
    return float(cov_true_pred / denominator) if denominator else 0.0


def pearson(x, y) -> float:
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    x, y = x - x.mean(), y - y.mean()
    denominator = np.sqrt((x @ x) * (y @ y))
    return float((x @ y) / denominator) if denominator else float("nan")


def average_ranks(values) -> np.ndarray:
    """Ranks 1..n, ties sharing the mean of the ranks they span (SciPy's ``rankdata(method="average")``)."""
    values = np.asarray(values)
    order = np.argsort(values, kind="mergesort")
    sorted_values = values[order]
    ranks = np.empty(len(values), dtype=np.float64)
    start = 0
    while start < len(values):
        end = start
        while end + 1 < len(values) and sorted_values[end + 1] == sorted_values[start]:
            end += 1
        ranks[order[start : end + 1]] = (start + end) / 2 + 1
        start = end + 1
    return ranks


def spearman(x, y) -> float:
    return pearson(average_ranks(x), average_ranks(y))


class Glue(evaluate.Metric):
    def _info(self):
        if self.config_name not in CONFIGS:
            raise KeyError(f"Unknown GLUE config {self.config_name!r}; choose one of {list(CONFIGS)}.")
        value_type = "float32" if self.config_name == "stsb" else "int64"
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {"predictions": datasets.Value(value_type), "references": datasets.Value(value_type)}
            ),
            codebase_urls=[],
            reference_urls=["https://gluebenchmark.com/"],
            format="numpy",
        )

    def _compute(self, predictions, references):
        if self.config_name == "cola":
            return {"matthews_correlation": matthews_correlation(predictions, references)}
        if self.config_name == "stsb":
            return {"pearson": pearson(predictions, references), "spearmanr": spearman(predictions, references)}
        if self.config_name in ("mrpc", "qqp"):
            return {"accuracy": accuracy(predictions, references), "f1": f1_binary(predictions, references)}
        return {"accuracy": accuracy(predictions, references)}
