"""lm-evaluation-harness on patched models, offline: a local task (a ``dataset_path: json`` task over a file this test
writes), the harness's own ``HFLM`` on the model in memory and on a checkpoint loaded back."""

import json
import math
import re
import textwrap
from pydoc_data.topics import topics

import pytest
import torch
from helpers.models import perturb_scorers
from transformers import ByT5Tokenizer, GPT2Config, GPT2LMHeadModel

import hf_neural_attn

pytest.importorskip("lm_eval", reason="lm-evaluation-harness is a recipes extra")
from recipes.harness import evaluate_with_harness

TASK = "local_pydoc"


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    """A rolling-loglikelihood task (like the harness's wikitext) over five short documents."""
    folder = tmp_path_factory.mktemp("harness_tasks")
    documents = [topics[name][:160] for name in sorted(topics)[:5]]
    (folder / "docs.jsonl").write_text("".join(json.dumps({"text": text}) + "\n" for text in documents))
    (folder / "task.yaml").write_text(
        textwrap.dedent(
            f"""\
            task: {TASK}
            dataset_path: json
            dataset_kwargs:
              data_files:
                test: {folder / "docs.jsonl"}
            test_split: test
            output_type: loglikelihood_rolling
            doc_to_text: ""
            doc_to_target: "{{{{text}}}}"
            metric_list:
              - metric: word_perplexity
              - metric: byte_perplexity
              - metric: bits_per_byte
            metadata:
              version: 1.0
            """
        )
    )
    return folder, documents


@pytest.fixture(scope="module")
def tokenizer():
    return ByT5Tokenizer()  # byte-level: needs no files


def tiny_lm(tokenizer):
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=2, n_positions=256)
    return GPT2LMHeadModel(config).eval()


def harness(model, tokenizer, task_dir):
    folder = str(task_dir[0])
    return evaluate_with_harness(model, tokenizer, [TASK], include_path=folder, batch_size=2)[TASK]


@torch.no_grad()
def byte_perplexity_by_hand(model, tokenizer, documents) -> float:
    """What the harness should compute: each document, encoded with the tokenizer's defaults (ByT5 appends its
    end-of-text token, which is scored too), scored after the end-of-text token, in one window."""
    total, size = 0.0, 0
    for text in documents:
        ids = [tokenizer.eos_token_id, *tokenizer(text).input_ids]
        logits = model(torch.tensor([ids])).logits[0, :-1].double()
        total += logits.log_softmax(-1).gather(-1, torch.tensor(ids[1:])[:, None]).sum().item()
        size += len(text.encode("utf-8"))
    return math.exp(-total / size)


def test_harness_scores_a_patched_model_in_memory_as_computed_by_hand(task_dir, tokenizer):
    model = tiny_lm(tokenizer)
    plain = harness(model, tokenizer, task_dir)
    assert set(plain) >= {"word_perplexity", "byte_perplexity", "bits_per_byte"}
    hf_neural_attn.patch_model(model, "qana", h=2)
    patched = harness(model, tokenizer, task_dir)
    for metric in ("byte_perplexity", "bits_per_byte", "word_perplexity"):  # the patch starts where the model is
        assert patched[metric] == pytest.approx(plain[metric], rel=1e-5)
    perturb_scorers(model)
    moved = harness(model, tokenizer, task_dir)
    assert moved["byte_perplexity"] != pytest.approx(plain["byte_perplexity"], rel=1e-4)
    assert moved["byte_perplexity"] == pytest.approx(byte_perplexity_by_hand(model, tokenizer, task_dir[1]), rel=1e-5)
    assert moved["bits_per_byte"] == pytest.approx(math.log2(moved["byte_perplexity"]), rel=1e-9)


def test_harness_on_a_checkpoint_loaded_back(task_dir, tokenizer, tmp_path):
    model = tiny_lm(tokenizer)
    hf_neural_attn.patch_model(model, "neural", proj_dim=4)
    perturb_scorers(model)
    expected = harness(model, tokenizer, task_dir)
    model.save_pretrained(tmp_path)
    loaded = hf_neural_attn.from_pretrained(tmp_path)
    assert harness(loaded, tokenizer, task_dir) == pytest.approx(expected, rel=1e-6)


def test_the_recipe_runs_the_harness_after_training_and_reports_it(task_dir, tmp_path):
    """`--lm_eval_tasks` on the offline default (a from-scratch GPT-2 shape on Python's docs, byte tokenizer): the
    harness's metrics land in all_results.json and the model card, for the model that was saved."""
    from recipes.args import parse_args
    from recipes.training import run

    out = tmp_path / "run"
    flags = [
        "--dataset_name",
        "pydoc_data",
        "--model_type",
        "gpt2",
        "--config_overrides",
        "n_layer=1,n_embd=32,n_head=2",
    ]
    flags += ["--scorer", "qana", "--h", "2", "--block_size", "64", "--max_train_steps", "2", "--max_eval_samples", "4"]
    flags += ["--max_train_samples", "32", "--lm_eval_tasks", TASK, "--lm_eval_include_path", str(task_dir[0])]
    results = run(parse_args([*flags, "--output_dir", str(out)]))
    scores = json.loads((out / "all_results.json").read_text())["lm_eval"]
    assert scores == results["lm_eval"] and set(scores[TASK]) >= {"word_perplexity", "byte_perplexity"}
    card = (out / "README.md").read_text()
    assert "## lm-evaluation-harness" in card and f"| {TASK} | byte_perplexity |" in card
    loaded = hf_neural_attn.from_pretrained(out)
    tokenizer = ByT5Tokenizer()
    assert scores[TASK]["byte_perplexity"] == pytest.approx(
        byte_perplexity_by_hand(loaded, tokenizer, task_dir[1]), rel=1e-5
    )


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--task", "sst2", "--lm_eval_tasks", "wikitext"], "evaluates causal language models"),
        (["--lm_eval_limit", "5"], "applies to --lm_eval_tasks"),
        (["--lm_eval_tasks", "wikitext", "--lm_eval_include_path", "/nonexistent"], "is not a folder"),
        (["--lm_eval_tasks", "wikitext", "--lm_eval_limit", "0"], "must be positive"),
    ],
)
def test_bad_harness_flags_fail_before_training(flags, message):
    from recipes.args import parse_args
    from recipes.errors import RecipeError

    with pytest.raises(RecipeError, match=message):
        parse_args(["--dataset_name", "pydoc_data", "--model_type", "gpt2", *flags])


RUN_FLAGS = [
    "--dataset_name", "pydoc_data", "--model_type", "gpt2", "--config_overrides", "n_layer=1,n_embd=32,n_head=2",
    "--block_size", "64", "--max_train_steps", "2", "--max_eval_samples", "4", "--max_train_samples", "32",
]  # fmt: skip


@pytest.mark.parametrize(
    ("task", "message"),
    [
        ("no_such_task", "lm-evaluation-harness has no task 'no_such_task'"),
        ("wikitext", "cannot load the data of wikitext.*offline mode"),  # a Hub dataset, and HF_HUB_OFFLINE=1
    ],
)
def test_a_task_the_harness_cannot_run_is_refused_before_training(tmp_path, capsys, task, message):
    from recipes.finetune import main

    out = tmp_path / "run"
    assert main([*RUN_FLAGS, "--lm_eval_tasks", task, "--output_dir", str(out)]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and error[0].startswith("finetune.py: error: --lm_eval_tasks:")
    assert re.search(message, error[0])
    assert not out.exists() or not any(out.iterdir())  # nothing trained, nothing written


def test_only_data_that_cannot_be_reached_gets_the_offline_hint(tmp_path, capsys):
    # A task over a local file whose template is broken: its error is the template's, offline or not (the tests run
    # with HF_HUB_OFFLINE=1), so the message must not send the user after the data.
    (tmp_path / "docs.jsonl").write_text(json.dumps({"text": "hello"}) + "\n")
    (tmp_path / "broken.yaml").write_text(
        textwrap.dedent(
            f"""\
            task: broken_template
            dataset_path: json
            dataset_kwargs: {{data_files: {{test: {tmp_path / "docs.jsonl"}}}}}
            test_split: test
            output_type: loglikelihood_rolling
            doc_to_text: ""
            doc_to_target: "{{{{text"
            metric_list: [{{metric: word_perplexity}}]
            """
        )
    )
    from recipes.finetune import main

    out = tmp_path / "run"
    flags = ["--lm_eval_tasks", "broken_template", "--lm_eval_include_path", str(tmp_path), "--output_dir", str(out)]
    assert main([*RUN_FLAGS, *flags]) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]  # after datasets' progress bar over the local file
    assert error.startswith("finetune.py: error: --lm_eval_tasks: lm-evaluation-harness cannot load broken_template")
    assert "unexpected end of template" in error and "offline" not in error and "data" not in error
    assert not out.exists() or not any(out.iterdir())


def test_a_harness_failure_after_training_keeps_the_run(task_dir, tmp_path, capsys, monkeypatch):
    from recipes import harness
    from recipes.finetune import main

    def broken(*args, **kwargs):
        raise RuntimeError("the harness broke")

    monkeypatch.setattr(harness, "evaluate_with_harness", broken)
    out = tmp_path / "run"
    flags = [*RUN_FLAGS, "--lm_eval_tasks", TASK, "--lm_eval_include_path", str(task_dir[0]), "--output_dir", str(out)]
    assert main(flags) == 2
    assert "lm-evaluation-harness failed after training (RuntimeError: the harness broke)" in capsys.readouterr().err
    results = json.loads((out / "all_results.json").read_text())
    assert "lm_eval" not in results and results["train_steps"] == 2
    assert (out / "README.md").exists() and (out / "tokenizer_config.json").exists()
    assert hf_neural_attn.from_pretrained(out) is not None


def test_the_python_api_names_a_missing_task_folder(tmp_path):
    with pytest.raises(ValueError, match="include_path .*no-such-folder.* is not a folder"):
        evaluate_with_harness(None, None, [TASK], include_path=str(tmp_path / "no-such-folder"))
