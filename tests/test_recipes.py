"""The fine-tuning recipes (recipes/finetune.py and friends), run in-process on tiny models and data built here.

Multi-process and kill-and-resume runs, which need subprocesses, are in test_recipes_distributed.py.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import recipes_helpers as helpers
import torch
from recipes_helpers import (  # fresh_accelerate_state: an autouse fixture
    fresh_accelerate_state,  # noqa: F401
    glue_file_args,
    read_history,
    read_results,
    save_tiny_gpt2,
    save_tiny_llama,
    save_tiny_vit,
    write_glue_files,
    write_image_folders,
    write_text_files,
)

import hf_neural_attn
from recipes import checkpointing, report, scorer_plots
from recipes.tasks import base as task_base
from recipes.tasks import clm, glue
from recipes.args import GLUE_TASKS, RecipeError, parse_args
from recipes.finetune import main as finetune_main
from recipes.finetune import run

TINY_DISTILBERT = "n_layers=1,dim=32,n_heads=2,hidden_dim=64"  # a family the patch does not support

# ------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("recipe_assets")
    train, validation = write_text_files(root / "text")
    images_train, images_validation = write_image_folders(root / "images")
    return {
        "root": root,
        "gpt2": save_tiny_gpt2(root / "tiny-gpt2"),
        "llama": save_tiny_llama(root / "tiny-llama"),
        "vit": save_tiny_vit(root / "tiny-vit"),
        "train_txt": train,
        "validation_txt": validation,
        "images_train": images_train,
        "images_validation": images_validation,
    }


def finetune(output_dir: Path, *flags: str) -> dict:
    return run(parse_args([*flags, "--output_dir", str(output_dir)]))


def clm_flags(assets, *extra: str) -> list[str]:
    return [
        *("--model_name_or_path", str(assets["gpt2"]), "--train_file", str(assets["train_txt"])),
        *("--validation_file", str(assets["validation_txt"])),
        *[
            "--task",
            "clm",
            "--block_size",
            "32",
            "--per_device_train_batch_size",
            "4",
            "--per_device_eval_batch_size",
            "4",
        ],
        *["--learning_rate", "1e-3", "--max_train_steps", "4"],
        *extra,
    ]


def png_size(path: Path) -> tuple[int, int]:
    """The pixel size of a PNG the run wrote (a truncated or non-PNG file fails)."""
    from PIL import Image

    assert path.is_file() and path.stat().st_size > 5_000, f"{path} missing or empty"
    with Image.open(path) as image:
        assert image.format == "PNG"
        image.load()
        return image.size


def map_size(heads: int) -> tuple[int, int]:
    """attention_maps.png: a column per head; rows patched, unpatched, difference (plotting's documented size)."""
    return round(100 * (2.4 * heads + 1.2)), round(100 * (2.4 * 3 + 1.0))


# ------------------------------------------------------------------------------------------- metrics


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


# ------------------------------------------------------------------------------------------ perplexity


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


# ----------------------------------------------------------------------------------- flags and configs


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
        assert args.task in ("clm", "image", *GLUE_TASKS), path


def test_bad_config_values_are_errors(tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text("task: translation\n")
    with pytest.raises(RecipeError, match="task='translation' is not one of"):
        parse_args(["--config", str(config)])
    config.write_text("learning_rat: 1e-3\n")
    with pytest.raises(RecipeError, match="unknown key"):
        parse_args(["--config", str(config)])


# ------------------------------------------------------------------------------------------ bad input


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
            "cannot take --task clm",
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
            "cannot take --task image",
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
            finetune(output_dir, *flags, "--max_train_steps", "2", "--block_size", "32")
        produced = list(output_dir.iterdir()) if output_dir.exists() else []
        assert produced == [], f"{name}: the failed run wrote {produced}"


def test_a_hub_model_without_network_fails_fast_and_clearly(tmp_path, monkeypatch):
    import time

    import datasets.config
    import huggingface_hub.constants

    from recipes import hub

    # Whatever the run switches to offline mode is restored after the test.
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", False)
    monkeypatch.setattr(hub, "_reachable", None)
    started = time.time()
    with pytest.raises(RecipeError, match="Could not load the model config from 'hf-neural-attn-tests/no-such-model'"):
        finetune(tmp_path / "out", "--task", "clm", "--model_name_or_path", "hf-neural-attn-tests/no-such-model")
    # No network here: one failed connection decides, instead of the Hub clients' ~20 s of retries.
    # (With network the repository does not exist: the Hub answers 404 just as fast.)
    assert time.time() - started < 10


def test_command_line_reports_errors_with_exit_code_2(tmp_path, capsys):
    assert finetune_main(["--task", "clm", "--train_file", str(tmp_path / "missing.txt")]) == 2
    assert "error: --train_file" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------- end to end


def test_clm_run_leaves_a_loadable_checkpoint_results_card_and_plot(assets, tmp_path):
    from huggingface_hub import ModelCard
    from PIL import Image
    from transformers import AutoTokenizer

    out = tmp_path / "clm"
    outcome = finetune(
        out,
        *clm_flags(
            assets, "--scorer", "qana", "--h", "4", "--eval_steps", "2", "--with_tracking", "--logging_steps", "1"
        ),
    )
    results = read_results(out)
    assert results["perplexity"] == outcome["perplexity"] and results["perplexity"] > 1
    assert results["eval_loss"] == pytest.approx(math.log(results["perplexity"]))
    assert results["settings"]["scorer"] == "qana" and results["settings"]["h"] == 4
    assert results["patch"]["scorer"] == "qana" and results["parameters"]["added_by_patch"] > 0
    assert results["train_steps"] == 4
    assert [e["step"] for e in read_history(out)["evaluations"]] == [2, 4]
    assert [s for s, _ in read_history(out)["train_loss"]] == [1, 2, 3, 4]

    # The checkpoint reloads patched, and reproduces the reported perplexity.
    model = hf_neural_attn.from_pretrained(str(out)).eval()
    assert hf_neural_attn.is_patched(model)
    tokenizer = AutoTokenizer.from_pretrained(out)
    # The text loader keeps each line's line break (keep_linebreaks); the lines are joined with blank lines.
    text = "\n\n".join(Path(assets["validation_txt"]).read_text().splitlines(keepends=True))
    ids = torch.tensor(tokenizer(text)["input_ids"])
    batch = clm.WindowCollator(0)(clm.make_windows(ids, 32, 32, "sliding"))
    with torch.no_grad():
        nll, count = clm.window_nll(
            model(**{k: batch[k] for k in ("input_ids", "attention_mask")}).logits, batch["targets"]
        )
    assert math.exp(nll.double().sum() / count.double().sum()) == pytest.approx(results["perplexity"], rel=1e-5)

    card = ModelCard.load(out / "README.md")
    (evaluation,) = card.data.eval_results
    assert (evaluation.metric_type, evaluation.task_type) == ("perplexity", "text-generation")
    assert evaluation.metric_value == pytest.approx(results["perplexity"])
    assert "hf-neural-attn" in card.data.tags and "qana" in card.data.tags
    assert "hf_neural_attn.from_pretrained" in card.text and "| h | 4 |" in card.text
    assert card.data.library_name == "hf-neural-attn" and "pip install hf-neural-attn" in card.text
    with Image.open(out / report.PLOT_FILE) as plot:
        assert plot.format == "PNG" and plot.size[0] > 300
    assert list(out.glob("finetune/events.out.tfevents.*")), "TensorBoard tracking wrote no event file"

    # The scorers' history: step 0 and every logging step, each patched layer's per-head gates and norms.
    history = json.loads((out / scorer_plots.SCORER_HISTORY_FILE).read_text())["history"]
    assert history == outcome["scorer_history"]
    assert [entry["step"] for entry in history] == [0, 1, 2, 3, 4]
    for entry in history:
        assert [record["layer"] for record in entry["layers"]] == [0, 1]
        assert all(len(record["gate"]) == 2 for record in entry["layers"])  # tiny GPT-2: 2 heads
    for record in history[0]["layers"]:  # at init QANA is the unpatched model: gates 1, same attention
        assert record["gate"] == [1.0, 1.0] and record["attention_change"] < 1e-6
    assert any(record["attention_change"] > 1e-6 for record in history[-1]["layers"]), "training moved nothing"
    # Step 4's numbers are those of the saved model.
    from hf_neural_attn.plotting import scorer_statistics

    saved = scorer_statistics(model)
    for record, reloaded in zip(history[-1]["layers"], saved):
        assert record["gate"] == pytest.approx(reloaded["gate"], abs=1e-7)
        assert record["param_norm"] == pytest.approx(reloaded["param_norm"], rel=1e-6)
    assert png_size(out / scorer_plots.SCORER_PLOT_FILE) == (round(100 * 4.2 * 3), 360)  # gate, norm, change
    # The attention maps of the first patched layer on the first evaluation example's first 32 tokens.
    assert png_size(out / scorer_plots.ATTENTION_PLOT_FILE) == map_size(heads=2)
    plots = results["plots"]
    assert plots["attention_layer"] == 0 and "first 32 tokens" in plots["attention_input"]
    assert 0 < plots["attention_change"] < 1
    # ... and the model card shows both.
    assert f"![scorer gates and norms over training]({scorer_plots.SCORER_PLOT_FILE})" in card.text
    assert f"![attention maps, patched vs unpatched]({scorer_plots.ATTENTION_PLOT_FILE})" in card.text
    assert "Attention layer 0, every head, on the first 32 tokens" in card.text


@pytest.mark.parametrize("task", GLUE_TASKS)
def test_glue_task_end_to_end_with_official_metrics(task, assets, tmp_path):
    from transformers import AutoTokenizer

    fmt = "json" if task in ("mrpc", "mnli") else "csv"
    files = write_glue_files(tmp_path / "data", task, fmt=fmt)
    model_dir = assets["llama"] if task == "rte" else assets["gpt2"]  # rte: a Llama whose tokenizer has no pad
    out = tmp_path / task
    finetune(
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
    finetune(
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


def test_recipe_scorer_choices_are_the_library_registry():
    from recipes.args import SCORERS

    assert set(SCORERS) == {"none", *hf_neural_attn.scorers.SCORERS}


def test_image_from_scratch_with_nsea(assets, tmp_path):
    """The exponentiation-based scorers are for training from scratch: a ViT built from a config, NSEA everywhere."""
    out = tmp_path / "vit-nsea"
    finetune(
        out,
        *("--task", "image", "--model_type", "vit", "--train_dir", str(assets["images_train"])),
        *("--config_overrides", "image_size=16,patch_size=8,hidden_size=32,num_hidden_layers=2,num_attention_heads=4"),
        *["--scorer", "nsea", "--mode", "replace", "--terms", "3", "--max_train_steps", "2"],
    )
    results = read_results(out)
    assert results["patch"]["scorer"] == "nsea" and results["patch"]["options"]["terms"] == 3
    assert 0.0 <= results["accuracy"] <= 1.0
    reloaded = hf_neural_attn.from_pretrained(str(out))
    assert reloaded.config.hf_neural_attn["options"] == {"impl": "auto", "terms": 3, "mode": "replace"}


def test_image_from_scratch_with_the_neural_attention_paper_patch(assets, tmp_path):
    # The paper's vision setup at toy scale: a ViT trained from scratch, Neural Attention in the first layer only,
    # down-projection d' = 2, the MLP replacing the dot product.
    out = tmp_path / "vit-scratch"
    finetune(
        out,
        *("--task", "image", "--model_type", "vit", "--train_dir", str(assets["images_train"])),
        *("--config_overrides", "image_size=16,patch_size=8,hidden_size=32,num_hidden_layers=2,num_attention_heads=4"),
        *["--scorer", "neural", "--layers", "0", "--proj_dim", "2", "--mode", "replace", "--max_train_steps", "2"],
    )
    results = read_results(out)
    assert results["patch"]["layers"] == [0] and results["patch"]["options"]["mode"] == "replace"
    assert results["data"]["eval_split"] == "15% of train" and results["from_scratch"]
    assert (out / "preprocessor_config.json").is_file()


def test_train_only_new_params_keeps_pretrained_weights(assets, tmp_path):
    from safetensors.torch import load_file

    out = tmp_path / "frozen"
    files = write_glue_files(tmp_path / "data", "sst2")
    finetune(
        out,
        *("--task", "sst2", "--model_name_or_path", str(assets["gpt2"]), *glue_file_args(files)),
        *["--scorer", "qana", "--train_only_new_params", "--max_train_steps", "3", "--learning_rate", "1e-2"],
        *["--attention_map_layer", "-1", "--logging_steps", "1"],
    )
    results = read_results(out)
    assert results["plots"]["attention_layer"] == 1  # --attention_map_layer -1: the last layer
    history = json.loads((out / scorer_plots.SCORER_HISTORY_FILE).read_text())["history"]
    gates = {entry["step"]: entry["layers"][1]["gate"] for entry in history}
    assert sorted(gates) == [0, 1, 2, 3] and gates[3] != gates[0], "the history shows the gates training"
    before = load_file(assets["gpt2"] / "model.safetensors")
    after = load_file(out / "model.safetensors")
    scorer = [name for name in after if ".attn_scorer." in name]
    head = [name for name in after if name.startswith("score.")]
    assert scorer and head
    for name, tensor in before.items():
        if name in after:
            assert torch.equal(after[name], tensor), f"pretrained weight {name} changed"
    # QANA's gates start at exactly 1 and get gradient from the second step on: training moved them.
    gates = [name for name in scorer if name.endswith("attn_scorer.gate")]
    assert gates
    for name in gates:
        assert not torch.equal(after[name], torch.ones_like(after[name])), f"{name}: the scorer did not train"
    assert results["parameters"]["trainable"] < results["parameters"]["total"]


@pytest.mark.parametrize("schedule", ["warmup", "fixed", "learned"])
def test_gate_schedule_holds_the_gates_as_asked(schedule, assets, tmp_path):
    from huggingface_hub import ModelCard
    from safetensors.torch import load_file

    flags = {"warmup": ["--gate_schedule", "warmup", "--gate_warmup_steps", "4"], "fixed": ["--gate_schedule", "fixed"]}
    out = tmp_path / schedule
    outcome = finetune(
        out,
        *clm_flags(assets, "--max_train_steps", "6", "--logging_steps", "1", "--attention_map_layer", "none"),
        *flags.get(schedule, []),
    )
    # Per step: every gate of both layers (2 heads each), and the norm of the other scorer parameters.
    gates = {
        entry["step"]: [g for layer in entry["layers"] for g in layer["gate"]] for entry in outcome["scorer_history"]
    }
    norms = {entry["step"]: [layer["param_norm"] for layer in entry["layers"]] for entry in outcome["scorer_history"]}
    assert sorted(gates) == list(range(7))
    saved = load_file(out / "model.safetensors")
    saved_gates = torch.cat([saved[name] for name in sorted(saved) if name.endswith("attn_scorer.gate")])
    assert saved_gates.tolist() == pytest.approx(gates[6], abs=1e-7)
    card = ModelCard.load(out / "README.md").text
    assert outcome["settings"]["gate_schedule"] == schedule
    if schedule == "warmup":
        # alpha = step / 4, exactly, while held (0 for the first step), then trained from 1.
        for step in range(5):
            assert gates[step] == [step / 4] * 4, step
        assert all(g != 1.0 for g in gates[5]) and gates[6] != gates[5]
        assert outcome["settings"]["gate_warmup_steps"] == 4
        assert "| gate α schedule | warmup (held at min(1, step/4) for 4 steps, then learned from 1) |" in card
    elif schedule == "fixed":
        assert all(gates[step] == [1.0] * 4 for step in gates), gates
        assert norms[6] != norms[0], "the other scorer parameters did not train"
        assert "| gate α schedule | fixed (held at its initial value, never learned) |" in card
    else:  # learned: the gate gets its first gradient on the second step (see docs/scorers.md), then moves
        assert gates[1] == [1.0] * 4 and all(g != 1.0 for g in gates[6])
        assert "gate α schedule" not in card


def test_gate_warmup_resumes_exactly(assets, tmp_path, monkeypatch):
    from recipes import finetune as finetune_module

    original = finetune_module.save_checkpoint

    def save_then_die(state, name):
        original(state, name)
        raise KeyboardInterrupt("killed after the first checkpoint")

    common = clm_flags(assets, "--max_train_steps", "5", "--logging_steps", "1", "--checkpointing_steps", "2")
    common += ["--gate_schedule", "warmup", "--attention_map_layer", "none"]
    flags = [*common, "--gate_warmup_steps", "3"]
    monkeypatch.setattr(finetune_module, "save_checkpoint", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        finetune(tmp_path / "run", *flags)
    monkeypatch.setattr(finetune_module, "save_checkpoint", original)
    assert checkpointing.find_latest(tmp_path / "run") == tmp_path / "run" / "step_2"
    # Resumed at step 2 of a 3-step warmup: alpha 2/3, then 1 at step 3 and learned from there.
    resumed = finetune(tmp_path / "run", *flags, "--resume_from_checkpoint", "latest")
    reference = finetune(tmp_path / "reference", *flags)
    assert resumed["scorer_history"] == reference["scorer_history"]
    assert resumed["perplexity"] == reference["perplexity"]
    gates = [entry["layers"][0]["gate"][0] for entry in resumed["scorer_history"]]
    assert gates[:4] == pytest.approx([0.0, 1 / 3, 2 / 3, 1.0], abs=1e-7) and gates[5] != 1.0
    with pytest.raises(RecipeError, match="different settings.*gate_warmup_steps"):
        finetune(tmp_path / "run", *common, "--gate_warmup_steps", "2", "--resume_from_checkpoint", "latest")


def test_gate_schedule_refuses_a_model_without_gates_even_when_the_options_cannot_tell(assets, tmp_path, monkeypatch):
    # The flags are checked by building the scorer on the meta device; where that cannot tell (None), the patched
    # model is checked before any data is prepared or anything written.
    from recipes import args as recipe_args

    monkeypatch.setattr(recipe_args, "scorer_has_gates", lambda scorer, options: None)
    out = tmp_path / "run"
    with pytest.raises(RecipeError, match=r"patch \(neural, .*mode=replace.*\) has none"):
        finetune(out, *clm_flags(assets, "--scorer", "neural", "--mode", "replace", "--gate_schedule", "fixed"))
    assert not out.exists()


def test_scorer_statistics_that_fail_stop_the_pictures_not_the_run(assets, tmp_path, monkeypatch):
    # e.g. QANA with key_dim has no unpatched attention to compare with: the run trains and saves without pictures.
    def no_statistics(progress, model, probe):
        raise ValueError("no original model to go back to")

    monkeypatch.setattr(scorer_plots, "record", no_statistics)
    out = tmp_path / "run"
    results = finetune(out, *clm_flags(assets, "--scorer", "qana", "--logging_steps", "1"))
    assert results["train_steps"] == 4 and results["plots"] == {} and results["scorer_history"] == []
    assert (out / "all_results.json").is_file() and not (out / scorer_plots.SCORER_PLOT_FILE).exists()


def test_new_parameters_suit_ddp_and_fsdp_wrapping(assets):
    # DDP (find_unused_parameters=False) and FSDP need every trainable parameter to take part in the loss and
    # one dtype per flattened group. Check it for each family and scorer, also in bfloat16.
    from transformers import AutoModelForCausalLM, ViTForImageClassification

    for scorer, options in (("qana", {}), ("neural", {"proj_dim": 2}), ("neural", {"mode": "replace", "layers": [0]})):
        for kind in ("gpt2", "llama", "vit"):
            for dtype in (torch.float32, torch.bfloat16):
                if kind == "vit":
                    model = ViTForImageClassification.from_pretrained(assets["vit"], dtype=dtype)
                    inputs = {"pixel_values": torch.randn(2, 3, 16, 16, dtype=dtype), "labels": torch.tensor([0, 1])}
                else:
                    model = AutoModelForCausalLM.from_pretrained(assets[kind], dtype=dtype)
                    ids = torch.randint(2, 30, (2, 10))
                    inputs = {"input_ids": ids, "labels": ids}
                options = dict(options)
                hf_neural_attn.patch_model(model, scorer, layers=options.pop("layers", None), **options)
                assert {p.dtype for p in model.parameters()} == {dtype}, (scorer, kind, dtype)
                model.train()
                model(**inputs).loss.backward()
                unused = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
                assert not unused, (scorer, kind, dtype, unused)


def test_push_to_hub_uploads_the_output_folder(assets, tmp_path, monkeypatch):
    import huggingface_hub

    calls = []

    class RecordingApi:
        def __init__(self, token=None):
            calls.append(("init", token))

        def whoami(self):
            calls.append(("whoami",))
            return {"name": "someone", "orgs": [], "auth": {"accessToken": {"role": "write"}}}

        def create_repo(self, repo_id, **kwargs):
            calls.append(("create_repo", repo_id, kwargs))

        def upload_folder(self, repo_id, folder_path, **kwargs):
            calls.append(
                ("upload_folder", repo_id, folder_path, sorted(p.name for p in Path(folder_path).iterdir()), kwargs)
            )

    from recipes import hub

    monkeypatch.setattr(huggingface_hub, "HfApi", RecordingApi)
    monkeypatch.setattr(hub, "is_offline", lambda: False)
    monkeypatch.setattr(hub, "_reachable", True)
    out = tmp_path / "push"
    finetune(
        out,
        *clm_flags(assets, "--push_to_hub", "--hub_model_id", "someone/tiny-qana", "--hub_token", "hf_test"),
        *("--checkpointing_steps", "2"),
    )
    assert calls[:2] == [("init", "hf_test"), ("whoami",)]  # checked before training
    assert calls[2] == ("init", "hf_test")
    assert calls[3][:2] == ("create_repo", "someone/tiny-qana")
    _, repo, folder, files, kwargs = calls[4]
    assert repo == "someone/tiny-qana" and Path(folder) == out
    assert {
        "README.md",
        "config.json",
        "model.safetensors",
        "all_results.json",
        report.PLOT_FILE,
        "tokenizer_config.json",
    } <= set(files)
    assert "step_*" in kwargs["ignore_patterns"] and "step_2" in files
    card = (out / "README.md").read_text()
    assert 'hf_neural_attn.from_pretrained("someone/tiny-qana")' in card
    assert "hf_test" not in (out / "all_results.json").read_text(), "the token leaked into the results"


def test_crash_while_saving_leaves_no_checkpoint_that_resume_would_pick(assets, tmp_path, monkeypatch):
    from accelerate import Accelerator

    original = Accelerator.save_state
    saves = []

    def crashing_save_state(self, output_dir=None, **kwargs):
        saves.append(output_dir)
        if len(saves) == 2:  # the second checkpoint dies half-written
            Path(output_dir, "model.safetensors").write_bytes(b"half a file")
            raise KeyboardInterrupt("simulated crash while saving")
        return original(self, output_dir, **kwargs)

    out = tmp_path / "crash"
    flags = clm_flags(assets, "--max_train_steps", "6", "--checkpointing_steps", "2", "--eval_steps", "3")
    monkeypatch.setattr(Accelerator, "save_state", crashing_save_state)
    with pytest.raises(KeyboardInterrupt):
        finetune(out, *flags)
    monkeypatch.setattr(Accelerator, "save_state", original)
    assert (out / ".step_4.partial").is_dir() and not (out / "step_4").exists()
    assert checkpointing.find_latest(out) == out / "step_2"

    resumed = finetune(out, *flags, "--resume_from_checkpoint", "latest")
    reference = finetune(tmp_path / "reference", *flags)
    assert resumed["perplexity"] == reference["perplexity"]
    assert resumed["history"] == reference["history"]
    assert resumed["scorer_history"] == reference["scorer_history"]  # saved with the checkpoint, continued
    assert [entry["step"] for entry in resumed["scorer_history"]] == [0, 6]
    assert not (out / ".step_4.partial").exists() and (out / "step_4").is_dir()


def test_checkpoint_every_epoch_and_keep_only_the_newest(assets, tmp_path):
    out = tmp_path / "epochs"
    # 8 blocks of 32 tokens, batch 4: two steps per epoch, so 6 steps are three epochs.
    flags = clm_flags(assets, "--max_train_samples", "8", "--max_train_steps", "6", "--checkpointing_steps", "epoch")
    finetune(out, *flags, "--checkpoints_total_limit", "2")
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["epoch_1", "epoch_2"]
    progress = checkpointing.read_progress(out / "epoch_2")
    assert (progress.completed_steps, progress.epoch, progress.batches_in_epoch) == (6, 3, 0)
    # Resuming a finished run trains no further and reports the same metrics.
    again = finetune(out, *flags, "--resume_from_checkpoint", "latest")
    assert again["train_steps"] == 6 and again["perplexity"] == read_results(out)["perplexity"]


def test_resume_refuses_a_checkpoint_of_a_different_run(assets, tmp_path):
    out = tmp_path / "run"
    finetune(out, *clm_flags(assets, "--checkpointing_steps", "2", "--scorer", "qana"))
    resume = ("--resume_from_checkpoint", str(out / "step_2"))
    # Each of these would change the run: a resumed optimizer would silently keep the old learning rate,
    # a different h would not even fit the saved weights.
    for changed in (("--seed", "7"), ("--learning_rate", "0.5"), ("--h", "2"), ("--scorer", "neural")):
        flags = clm_flags(assets, *resume, "--scorer", "qana", *changed)
        with pytest.raises(RecipeError, match=f"different settings.*{changed[0][2:]}"):
            finetune(out, *flags)
    with pytest.raises(RecipeError, match="not a complete checkpoint"):
        finetune(out, *clm_flags(assets, "--resume_from_checkpoint", str(assets["gpt2"])))


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


def test_train_only_new_params_keeps_resized_embeddings_trainable(assets, tmp_path):
    """A tokenizer larger than the model's vocabulary adds embedding rows, which must learn too."""
    from transformers import ByT5Tokenizer, GPT2Config, GPT2LMHeadModel

    from recipes import modeling

    folder = tmp_path / "small-vocab"
    tokenizer = ByT5Tokenizer()
    GPT2LMHeadModel(GPT2Config(vocab_size=300, n_embd=32, n_layer=2, n_head=2, n_positions=64)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    args = parse_args(
        [*clm_flags(assets, "--scorer", "qana", "--train_only_new_params"), "--output_dir", str(tmp_path / "out")]
    )
    args.model_name_or_path = str(folder)
    bundle = modeling.build_model(args, modeling.load_config(args), modeling.load_tokenizer(args), None)
    trainable = {name for name, p in bundle.model.named_parameters() if p.requires_grad}
    assert bundle.model.get_input_embeddings().weight.shape[0] == len(tokenizer) > 300
    assert "transformer.wte.weight" in trainable
    assert set(hf_neural_attn.scorer_parameters(bundle.model)) <= trainable
    assert "transformer.h.0.mlp.c_fc.weight" not in trainable


def test_gradient_accumulation_set_by_the_accelerate_config_is_used_and_recorded(assets, tmp_path, monkeypatch):
    # What `accelerate launch` with a DeepSpeed config exports; it overrides the flag inside Accelerator.
    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "1")
    results = finetune(tmp_path / "run", *clm_flags(assets, "--gradient_accumulation_steps", "2"))
    assert results["settings"]["gradient_accumulation_steps"] == 1
    assert results["total_train_batch_size"] == 4


def test_a_patched_checkpoint_can_keep_training_only_its_new_parameters(assets, tmp_path):
    from safetensors.torch import load_file

    first = tmp_path / "first"
    finetune(first, *clm_flags(assets, "--scorer", "neural", "--proj_dim", "2"))
    second = tmp_path / "second"
    flags = clm_flags(assets, "--scorer", "none", "--train_only_new_params", "--attention_map_layer", "none")
    flags[flags.index("--model_name_or_path") + 1] = str(first)
    results = finetune(second, *flags)
    assert results["patch"]["scorer"] == "neural"
    # A reloaded patch is tracked too; --attention_map_layer none skips only the maps.
    assert (second / scorer_plots.SCORER_PLOT_FILE).is_file() and not (
        second / scorer_plots.ATTENTION_PLOT_FILE
    ).exists()
    assert "attention_maps" not in results["plots"]
    before, after = load_file(first / "model.safetensors"), load_file(second / "model.safetensors")
    scorer_names = [name for name in after if ".attn_scorer." in name]
    assert scorer_names and any(not torch.equal(after[n], before[n]) for n in scorer_names)
    for name, tensor in before.items():
        if ".attn_scorer." not in name:
            assert torch.equal(after[name], tensor), f"pretrained weight {name} changed"


def test_train_only_new_params_without_any_patch_is_refused(assets, tmp_path):
    with pytest.raises(RecipeError, match="--train_only_new_params needs a patch"):
        finetune(tmp_path / "run", *clm_flags(assets, "--scorer", "none", "--train_only_new_params"))
