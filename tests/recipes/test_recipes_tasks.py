"""recipes/tasks/: each task's metrics, the perplexity protocols, and a run of every task end to end (GLUE's nine, the
image task), with the metrics recomputed by hand from the saved model. The causal-LM run is in
test_recipes_finetune.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from recipes_helpers import (  # fresh_accelerate_state, one_thread: autouse fixtures
    finetune_in_process,
    fresh_accelerate_state,  # noqa: F401
    glue_file_args,
    map_size,
    one_thread,  # noqa: F401
    png_size,
    read_results,
    recipe_assets,
    without_times,
    write_glue_files,
)

import hf_neural_attn
from recipes import scorer_plots
from recipes.args import build_parser
from recipes.errors import RecipeError
from recipes.tasks import TASKS, clm, get_task, glue
from recipes.tasks import base as task_base
from recipes.tasks.glue import GLUE_TASKS


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return recipe_assets(tmp_path_factory.mktemp("recipe_assets"))


def test_the_registry_serves_every_task_of_the_command_line():
    assert list(build_parser().recipe_flags["task"]["choices"]) == list(TASKS)
    for name in TASKS:
        task = get_task(name)
        assert task.name == name and task.kind == ("glue" if name in GLUE_TASKS else name)
    assert get_task("stsb").primary_metric == "pearson" and get_task("clm").greater_is_better is False
    with pytest.raises(RecipeError, match="Unknown task 'summarization'; choose clm, one of the GLUE tasks"):
        get_task("summarization")


def test_glue_metrics_match_values_computed_by_hand():
    # predictions / references chosen so the confusion matrix is TP=3, TN=2, FP=1, FN=1 (7 examples).
    predictions = [1, 1, 1, 0, 0, 1, 0]
    references = [1, 1, 1, 0, 0, 0, 1]
    # Matthews: (TP*TN - FP*FN) / sqrt((TP+FP)(TP+FN)(TN+FP)(TN+FN)) = (6 - 1) / sqrt(4*4*3*3) = 5/12.
    cola = task_base.load_local_metric("glue", "cola").compute(predictions=predictions, references=references)
    assert cola == {"matthews_correlation": pytest.approx(5 / 12, abs=1e-12)}
    # F1 = 2TP / (2TP + FP + FN) = 6/8; accuracy = 5/7.
    mrpc = task_base.load_local_metric("glue", "mrpc").compute(predictions=predictions, references=references)
    assert mrpc == {"accuracy": pytest.approx(5 / 7), "f1": pytest.approx(0.75)}
    qqp = task_base.load_local_metric("glue", "qqp").compute(predictions=predictions, references=references)
    assert qqp == mrpc
    for config in ("sst2", "qnli", "rte", "wnli", "mnli", "mnli_mismatched"):
        scores = task_base.load_local_metric("glue", config).compute(predictions=[0, 2, 1, 1], references=[0, 1, 1, 1])
        assert scores == {"accuracy": pytest.approx(0.75)}, config
    # Pearson of x = [1, 2, 3, 4], y = [2, 4, 5, 9]: centred x = [-1.5, -0.5, 0.5, 1.5], y = [-3, -1, 0, 4];
    # sum(xy) = 4.5 + 0.5 + 0 + 6 = 11, sum(x^2) = 5, sum(y^2) = 26 -> 11 / sqrt(130).
    # Spearman with a tie, x = [1, 2, 2, 3] -> ranks [1, 2.5, 2.5, 4], y = [1, 3, 2, 4] -> ranks [1, 3, 2, 4]:
    # centred [-1.5, 0, 0, 1.5] and [-1.5, 0.5, -0.5, 1.5] -> 4.5 / sqrt(4.5 * 5) = 3 / sqrt(10).
    stsb = task_base.load_local_metric("glue", "stsb")
    assert stsb.compute(predictions=[1, 2, 3, 4], references=[2, 4, 5, 9])["pearson"] == pytest.approx(
        11 / math.sqrt(130)
    )
    assert stsb.compute(predictions=[1, 2, 2, 3], references=[1, 3, 2, 4])["spearmanr"] == pytest.approx(
        3 / math.sqrt(10)
    )
    accuracy = task_base.load_local_metric("accuracy").compute(predictions=[0, 1, 2, 2], references=[0, 1, 1, 2])
    assert accuracy == {"accuracy": pytest.approx(0.75)}


def test_glue_metrics_degenerate_inputs_follow_scikit_learn():
    cola = task_base.load_local_metric("glue", "cola")
    assert cola.compute(predictions=[1, 1, 1], references=[1, 0, 1]) == {"matthews_correlation": 0.0}
    mrpc = task_base.load_local_metric("glue", "mrpc")
    assert mrpc.compute(predictions=[0, 0], references=[0, 0]) == {"accuracy": 1.0, "f1": 0.0}
    # A perfect anti-correlation and a constant prediction.
    assert cola.compute(predictions=[1, 0, 1, 0], references=[0, 1, 0, 1])["matthews_correlation"] == pytest.approx(
        -1.0
    )
    assert math.isnan(
        task_base.load_local_metric("glue", "stsb").compute(predictions=[2, 2, 2], references=[1, 2, 3])["pearson"]
    )


@pytest.mark.parametrize("n, block, stride", [(100, 16, 16), (100, 16, 5), (101, 16, 1), (10, 16, 8), (17, 16, 16)])
def test_sliding_windows_score_every_token_exactly_once(n, block, stride):
    ids = torch.arange(1000, 1000 + n)
    windows = clm.make_windows(ids, block, stride, "sliding")
    scored = []
    for window in windows:
        assert len(window["input_ids"]) <= block
        first = int(window["input_ids"][0]) - 1000
        for j, target in enumerate(window["targets"].tolist()):
            if target != -100:
                assert target == 1000 + first + j + 1  # input j predicts the next token of the stream
                scored.append(target - 1000)
                if first + j + 1 > block:  # full context once the stream is long enough
                    assert j + 1 >= block - stride
    assert sorted(scored) == list(range(1, n))


def test_full_window_protocol_is_the_authors_loop():
    # Their loop: windows of block + 1 tokens starting every `stride` tokens, partial windows skipped,
    # every prediction of a window scored, perplexity = exp(mean window loss).
    ids = torch.arange(50)
    windows = clm.make_windows(ids, 8, 4, "full_window")
    starts = [int(w["input_ids"][0]) for w in windows]
    assert starts == [begin for begin in range(0, 50, 4) if begin + 9 <= 50]
    for window in windows:
        assert torch.equal(window["targets"], window["input_ids"] + 1)
    sums, counts = torch.tensor([8.0, 16.0]), torch.tensor([8.0, 8.0])
    assert clm.perplexity_from_windows(sums, counts, "full_window")["eval_loss"] == pytest.approx(1.5)
    # The token-weighted protocol weighs windows by their scored tokens instead.
    assert clm.perplexity_from_windows(torch.tensor([8.0, 16.0]), torch.tensor([8.0, 2.0]), "sliding")[
        "eval_loss"
    ] == pytest.approx(2.4)


def test_sliding_perplexity_equals_the_model_loss_on_one_window(assets):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(assets["gpt2"]).eval()
    ids = torch.randint(3, 200, (40,), generator=torch.Generator().manual_seed(0))
    (window,) = clm.make_windows(ids, 64, 64, "sliding")
    batch = clm.WindowCollator(0)([window])
    with torch.no_grad():
        nll, count = clm.window_nll(model(input_ids=batch["input_ids"]).logits, batch["targets"])
        reference = model(input_ids=ids[None], labels=ids[None]).loss
    result = clm.perplexity_from_windows(nll.double(), count.double(), "sliding")
    assert count.item() == 39
    assert result["eval_loss"] == pytest.approx(reference.item(), rel=1e-5)
    assert result["perplexity"] == pytest.approx(math.exp(reference.item()), rel=1e-5)


@pytest.mark.parametrize("task", GLUE_TASKS)
def test_glue_task_end_to_end_with_official_metrics(task, assets, tmp_path):
    from transformers import AutoTokenizer

    fmt = "json" if task in ("mrpc", "mnli") else "csv"
    files = write_glue_files(tmp_path / "data", task, fmt=fmt)
    model_dir = assets["llama"] if task == "rte" else assets["gpt2"]  # rte: a Llama whose tokenizer has no pad
    out = tmp_path / task
    finetune_in_process(
        out,
        *("--task", task, "--model_name_or_path", str(model_dir), *glue_file_args(files)),
        *[
            "--max_train_steps",
            "3",
            "--per_device_train_batch_size",
            "8",
            "--max_seq_length",
            "48",
            "--learning_rate",
            "1e-3",
        ],
        *["--scorer", "neural", "--proj_dim", "2"],
    )
    results = read_results(out)
    expected = {
        "cola": {"matthews_correlation"},
        "stsb": {"pearson", "spearmanr", "combined_score"},
        "mrpc": {"accuracy", "f1", "combined_score"},
        "qqp": {"accuracy", "f1", "combined_score"},
        "mnli": {"accuracy", "accuracy_mm"},
    }.get(task, {"accuracy"})
    assert expected <= set(results), results.keys()
    assert not {"f1", "matthews_correlation", "pearson", "accuracy_mm"} - expected & set(results)

    # Recompute the predictions from the saved model and the metrics by hand.
    model = hf_neural_attn.from_pretrained(str(out)).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    first, second = glue.TASK_TO_KEYS[task]

    def predict(path):
        rows = [json.loads(line) for line in path.read_text().splitlines()] if fmt == "json" else _csv_rows(path)
        texts = [[row[first] for row in rows]] + ([[row[second] for row in rows]] if second else [])
        encoded = tokenizer(*texts, padding=True, truncation=True, max_length=48, return_tensors="pt")
        with torch.no_grad():
            logits = model(**encoded).logits
        if task == "stsb":
            return logits.squeeze(-1).numpy(), np.array([float(row["label"]) for row in rows])
        names = model.config.label2id
        labels = [
            names[row["label"]] if isinstance(row["label"], str) and not row["label"].isdigit() else int(row["label"])
            for row in rows
        ]
        return logits.argmax(-1).numpy(), np.array(labels)

    predictions, labels = predict(files["validation"])
    if task == "rte":
        assert tokenizer.pad_token == tokenizer.eos_token and model.config.pad_token_id == tokenizer.eos_token_id
    if task == "cola":
        tp, tn = np.sum((predictions == 1) & (labels == 1)), np.sum((predictions == 0) & (labels == 0))
        fp, fn = np.sum((predictions == 1) & (labels == 0)), np.sum((predictions == 0) & (labels == 1))
        denominator = math.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
        assert results["matthews_correlation"] == pytest.approx(
            (tp * tn - fp * fn) / denominator if denominator else 0.0, abs=1e-9
        )
    elif task == "stsb":
        import pandas as pd

        assert results["pearson"] == pytest.approx(np.corrcoef(predictions, labels)[0, 1], abs=1e-5)
        ranks = pd.Series(predictions).rank(), pd.Series(labels).rank()
        assert results["spearmanr"] == pytest.approx(np.corrcoef(*ranks)[0, 1], abs=1e-5)
    else:
        assert results["accuracy"] == pytest.approx(np.mean(predictions == labels))
        if task in ("mrpc", "qqp"):
            tp = np.sum((predictions == 1) & (labels == 1))
            wrong = np.sum(predictions != labels)
            assert results["f1"] == pytest.approx(2 * tp / (2 * tp + wrong) if tp + wrong else 0.0)
        if task == "mnli":
            mismatched, mm_labels = predict(files["validation_mismatched"])
            assert results["accuracy_mm"] == pytest.approx(np.mean(mismatched == mm_labels))
            assert model.config.id2label == {0: "entailment", 1: "neutral", 2: "contradiction"}


def _csv_rows(path: Path) -> list[dict]:
    import csv

    with open(path) as handle:
        return list(csv.DictReader(handle))


def test_image_classification_end_to_end(assets, tmp_path):
    from transformers import AutoImageProcessor

    out = tmp_path / "image"
    finetune_in_process(
        out,
        *("--task", "image", "--model_name_or_path", str(assets["vit"]), "--train_dir", str(assets["images_train"])),
        *("--validation_dir", str(assets["images_validation"])),
        *[
            "--max_train_steps",
            "4",
            "--per_device_train_batch_size",
            "6",
            "--learning_rate",
            "3e-3",
            "--scorer",
            "qana",
        ],
    )
    results = read_results(out)
    assert 0.0 <= results["accuracy"] <= 1.0 and results["model_class"] == "ViTForImageClassification"
    # The maps of a whole image: 4 heads, 16 patches and [CLS].
    assert png_size(out / scorer_plots.ATTENTION_PLOT_FILE) == map_size(heads=4)
    assert results["plots"]["attention_input"] == "the first `validation` example"
    assert (out / scorer_plots.SCORER_PLOT_FILE).is_file()
    model = hf_neural_attn.from_pretrained(str(out)).eval()
    assert model.config.id2label == {0: "blue", 1: "green", 2: "red"}
    processor = AutoImageProcessor.from_pretrained(out)
    from PIL import Image

    correct = total = 0
    for label, name in model.config.id2label.items():
        for path in sorted((assets["images_validation"] / name).glob("*.png")):
            with Image.open(path) as image:
                pixels = processor([image.convert("RGB")], return_tensors="pt")["pixel_values"]
            with torch.no_grad():
                correct += int(model(pixel_values=pixels).logits.argmax(-1).item() == label)
            total += 1
    assert results["accuracy"] == pytest.approx(correct / total)


def test_the_held_out_split_does_not_change_with_the_training_seed(assets, tmp_path):
    # Training text without a validation file: 5% of it is held out. Lines of different lengths, so that another
    # split would hold another number of tokens. The pretrained tiny GPT-2's step-0 evaluation (--eval_at_start,
    # before any training) depends on the evaluation examples only.
    train = tmp_path / "train.txt"
    train.write_text("".join(" ".join(["word"] * (1 + index % 17)) + "\n" for index in range(200)))
    flags = ["--model_name_or_path", str(assets["gpt2"]), "--train_file", str(train), "--scorer", "none"]
    flags += ["--block_size", "16", "--max_train_steps", "1", "--eval_at_start", "--attention_map_layer", "none"]
    step_zero = {}
    runs = {"seed 1": ["--seed", "1"], "seed 2": ["--seed", "2"], "split 7": ["--validation_split_seed", "7"]}
    for name, extra in runs.items():
        results = finetune_in_process(tmp_path / name.replace(" ", "_"), *flags, *extra)
        assert results["data"]["eval_split"] == f"5% of train (split seed {7 if name == 'split 7' else 42})"
        step_zero[name] = (results["eval_samples"], without_times(results["history"])["evaluations"][0])
    assert step_zero["seed 1"] == step_zero["seed 2"]  # the same windows of the same tokens, the same loss
    assert step_zero["split 7"] != step_zero["seed 1"]  # --validation_split_seed picks another split
