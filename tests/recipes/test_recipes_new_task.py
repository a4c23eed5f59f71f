"""A recipe task is one class and one registry line: a toy task written here, registered in ``recipes.tasks.TASKS``
for the test only, runs end to end through ``recipes.finetune`` (command line, training, evaluation, saved model),
the model card and ``recipes.sweep``, with no recipe module changed.

The toy task: does a sentence of the helpers' words contain "good"? Sequence classification of sentences made here,
in memory, scored by accuracy counted by hand.
"""

from __future__ import annotations

import csv

import pytest
import torch
import yaml
from recipes_helpers import (  # fresh_accelerate_state, one_thread: autouse fixtures
    fresh_accelerate_state,  # noqa: F401
    one_thread,  # noqa: F401
    read_results,
    save_tiny_gpt2,
    sentences,
)

import hf_neural_attn
from recipes import finetune, report, scorer_plots, sweep, tasks
from recipes.tasks.base import DataInfo, TaskData
from recipes.tasks.text import TextTask

LABELS = ["other", "good"]


def toy_split(count: int, seed: int) -> dict[str, list]:
    texts = sentences(count, seed=seed, length=6)
    return {"text": texts, "label": [int("good" in text.split()) for text in texts]}


class GoodSentenceTask(TextTask):
    """Is "good" among a sentence's words? The data is made in memory; accuracy is counted here."""

    kind = "good-sentence"
    primary_metric = "accuracy"
    pipeline_tag = "text-classification"
    hub_task_name = "Text Classification"
    head_mapping = "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES"
    head_description = "a sequence-classification head"

    def hub_data(self, args):
        return []  # made in memory: nothing to download

    def load_raw(self, args):
        import datasets

        self.info = DataInfo("good sentences (in memory)")
        return datasets.DatasetDict(
            train=datasets.Dataset.from_dict(toy_split(48, seed=3)),
            validation=datasets.Dataset.from_dict(toy_split(20, seed=4)),
        )

    def check_raw(self, args, raw):
        return {"num_labels": len(LABELS), "names": LABELS, "regression": False, "to_id": None}

    def prepare(self, args, raw, tokenizer, model_config, labels, accelerator):
        from transformers import DataCollatorWithPadding

        def tokenize(examples):
            return {**tokenizer(examples["text"], truncation=True, max_length=48), "labels": examples["label"]}

        processed = {split: raw[split].map(tokenize, batched=True, remove_columns=["text", "label"]) for split in raw}
        collate = DataCollatorWithPadding(tokenizer)
        return TaskData(processed["train"], {"validation": processed["validation"]}, collate, collate, self.info)

    def evaluate(self, model, dataloaders, accelerator, args, progress=True):
        model.eval()
        correct = total = 0
        with torch.no_grad():
            for batch in dataloaders["validation"]:
                logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
                predictions, references = accelerator.gather_for_metrics((logits.argmax(-1), batch["labels"]))
                correct += int((predictions == references).sum())
                total += len(references)
        model.train()
        return {"accuracy": correct / total}


@pytest.fixture
def toy_task(monkeypatch):
    """The one registration: ``--task good`` is the toy task while the test runs."""
    monkeypatch.setitem(tasks.TASKS, "good", GoodSentenceTask)
    return "good"


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    return save_tiny_gpt2(tmp_path_factory.mktemp("toy_task") / "tiny-gpt2")


def toy_flags(gpt2, *extra: str) -> list[str]:
    return [
        *("--task", "good", "--model_name_or_path", str(gpt2), "--max_train_steps", "3"),
        *("--per_device_train_batch_size", "8", "--learning_rate", "1e-3", "--attention_map_layer", "none"),
        *extra,
    ]


def test_a_task_written_outside_the_recipes_runs_through_finetune_and_its_model_card(toy_task, gpt2, tmp_path):
    from huggingface_hub import ModelCard
    from transformers import AutoTokenizer

    out = tmp_path / "run"
    assert finetune.main([*toy_flags(gpt2, "--scorer", "qana", "--h", "2"), "--output_dir", str(out)]) == 0
    results = read_results(out)
    assert (results["task"], results["task_kind"], results["pipeline_tag"]) == (
        "good",
        "good-sentence",
        "text-classification",
    )
    assert results["model_class"] == "GPT2ForSequenceClassification" and results["metric_names"] == ["accuracy"]
    assert results["data"]["dataset_name"] == "good sentences (in memory)" and results["train_steps"] == 3

    # The saved patched classifier and tokenizer give the reported accuracy on the validation sentences.
    model = hf_neural_attn.from_pretrained(str(out)).eval()
    assert hf_neural_attn.is_patched(model) and model.config.id2label == dict(enumerate(LABELS))
    tokenizer = AutoTokenizer.from_pretrained(out)
    validation = toy_split(20, seed=4)
    with torch.no_grad():
        predictions = [
            int(model(**tokenizer([text], return_tensors="pt")).logits.argmax(-1)) for text in validation["text"]
        ]
    correct = sum(int(p == label) for p, label in zip(predictions, validation["label"]))
    assert results["accuracy"] == pytest.approx(correct / len(predictions))

    # The card takes the task's Hub type and name, its label and its kind.
    card = ModelCard.load(out / "README.md")
    (evaluation,) = card.data.eval_results
    assert (evaluation.task_type, evaluation.task_name) == ("text-classification", "Text Classification")
    assert evaluation.metric_value == pytest.approx(results["accuracy"])
    assert card.data.pipeline_tag == "text-classification" and "good-sentence" in card.data.tags
    assert "# GPT2ForSequenceClassification with qana, h=2, layers=[0, 1] — Text Classification" in card.text
    assert "tokenizer = AutoTokenizer.from_pretrained(" in card.text


def test_a_task_written_outside_the_recipes_runs_through_a_sweep(toy_task, gpt2, tmp_path, monkeypatch):
    # Each run's own pictures are tested elsewhere (test_recipes_finetune.py); they take most of a tiny run's time.
    monkeypatch.setattr(scorer_plots, "draw", lambda *args, **kwargs: {})
    monkeypatch.setattr(report, "plot_training", lambda *args, **kwargs: None)
    out = tmp_path / "sweep"
    flags = toy_flags(gpt2, "--scorer", "qana", "--h", "2", "--output_dir", str(out))
    base = {flag.lstrip("-"): value for flag, value in zip(flags[::2], flags[1::2])}  # every flag takes a value
    config = tmp_path / "toy.yaml"
    config.write_text(yaml.safe_dump({"base": base, "axes": {"h": [4]}, "seeds": 1, "baseline": True}))
    assert sweep.main(["--config", str(config)]) == 0
    accuracy = {name: read_results(out / name / "seed_42")["accuracy"] for name in ("baseline", "base", "h=4")}
    assert read_results(out / "baseline" / "seed_42")["patch"] is None
    table = (out / "sweep.md").read_text()
    assert "primary metric accuracy (higher is better); 3/3 runs finished" in table
    row = next(line for line in table.splitlines() if line.startswith("| `h=4` | h=4 |"))
    assert f"| {accuracy['h=4']:.4f} |" in row
    with open(out / "sweep.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert [(row["configuration"], float(row["accuracy"])) for row in rows] == list(accuracy.items())
