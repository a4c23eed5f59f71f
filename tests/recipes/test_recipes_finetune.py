"""recipes/finetune.py in-process on tiny models and data built here: what a run leaves behind (checkpoint, results,
model card, plots, scorer history), training from scratch, training only the new parameters, gate schedules.

Multi-process runs are in test_recipes_distributed.py; each task's data and metrics in test_recipes_tasks.py.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from helpers.paths import scorer_impls
from recipes_helpers import (  # fresh_accelerate_state, one_thread: autouse fixtures
    clm_flags,
    finetune_in_process,
    fresh_accelerate_state,  # noqa: F401
    glue_file_args,
    map_size,
    offline_env,
    one_thread,  # noqa: F401
    png_size,
    read_history,
    read_results,
    recipe_assets,
    run_recipe,
    write_glue_files,
)

import hf_neural_attn
from recipes import report, scorer_plots
from recipes.args import parse_args
from recipes.tasks import clm


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return recipe_assets(tmp_path_factory.mktemp("recipe_assets"))


def test_clm_run_leaves_a_loadable_checkpoint_results_card_and_plot(assets, tmp_path):
    from huggingface_hub import ModelCard
    from PIL import Image
    from transformers import AutoTokenizer

    out = tmp_path / "clm"
    outcome = finetune_in_process(
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
    # The library's rule for a full patched checkpoint's tags, taken from the library, not restated by the recipe.
    assert card.data.tags[:3] == hf_neural_attn.checkpoint_tags("qana") == ["hf-neural-attn", "qana", "custom_code"]
    assert "hf_neural_attn.from_pretrained" in card.text and "| h | 4 |" in card.text
    assert card.data.library_name == "transformers" and "pip install hf-neural-attn" in card.text
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


def test_image_from_scratch_with_nsea(assets, tmp_path):
    """The exponentiation-based scorers are for training from scratch: a ViT built from a config, NSEA everywhere."""
    out = tmp_path / "vit-nsea"
    finetune_in_process(
        out,
        *("--task", "image", "--model_type", "vit", "--train_dir", str(assets["images_train"])),
        *("--config_overrides", "image_size=16,patch_size=8,hidden_size=32,num_hidden_layers=2,num_attention_heads=4"),
        *["--scorer", "nsea", "--mode", "replace", "--terms", "3", "--max_train_steps", "2"],
    )
    results = read_results(out)
    assert results["patch"]["scorer"] == "nsea" and results["patch"]["options"]["terms"] == 3
    assert 0.0 <= results["accuracy"] <= 1.0
    reloaded = hf_neural_attn.from_pretrained(str(out))
    assert reloaded.config.hf_neural_attn["options"] == {"terms": 3, "mode": "replace"}  # impl is not saved


def test_image_from_scratch_with_the_neural_attention_paper_patch(assets, tmp_path):
    # The paper's vision setup at toy scale: a ViT trained from scratch, Neural Attention in the first layer only,
    # down-projection d' = 2, the MLP replacing the dot product.
    out = tmp_path / "vit-scratch"
    finetune_in_process(
        out,
        *("--task", "image", "--model_type", "vit", "--train_dir", str(assets["images_train"])),
        *("--config_overrides", "image_size=16,patch_size=8,hidden_size=32,num_hidden_layers=2,num_attention_heads=4"),
        *["--scorer", "neural", "--layers", "0", "--proj_dim", "2", "--mode", "replace", "--max_train_steps", "2"],
    )
    results = read_results(out)
    assert results["patch"]["layers"] == [0] and results["patch"]["options"]["mode"] == "replace"
    assert results["data"]["eval_split"] == "15% of train (split seed 42)" and results["from_scratch"]
    assert (out / "preprocessor_config.json").is_file()


def test_train_only_new_params_keeps_pretrained_weights(assets, tmp_path):
    from safetensors.torch import load_file

    out = tmp_path / "frozen"
    files = write_glue_files(tmp_path / "data", "sst2")
    finetune_in_process(
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
    outcome = finetune_in_process(
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


def test_scorer_statistics_that_fail_stop_the_pictures_not_the_run(assets, tmp_path, monkeypatch):
    # e.g. QANA with key_dim has no unpatched attention to compare with: the run trains and saves without pictures.
    def no_statistics(progress, model, probe):
        raise ValueError("no original model to go back to")

    monkeypatch.setattr(scorer_plots, "record", no_statistics)
    out = tmp_path / "run"
    results = finetune_in_process(out, *clm_flags(assets, "--scorer", "qana", "--logging_steps", "1"))
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


def test_train_only_new_params_keeps_resized_embeddings_trainable(assets, tmp_path):
    """A tokenizer larger than the model's vocabulary adds embedding rows, which must learn too."""
    from transformers import ByT5Tokenizer, GPT2Config, GPT2LMHeadModel

    from recipes import modeling, tasks

    folder = tmp_path / "small-vocab"
    tokenizer = ByT5Tokenizer()
    GPT2LMHeadModel(GPT2Config(vocab_size=300, n_embd=32, n_layer=2, n_head=2, n_positions=64)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    args = parse_args(
        [*clm_flags(assets, "--scorer", "qana", "--train_only_new_params"), "--output_dir", str(tmp_path / "out")]
    )
    args.model_name_or_path = str(folder)
    task = tasks.get_task(args.task)
    config = modeling.load_config(args, task)
    bundle = modeling.build_model(args, task, config, task.load_preprocessor(args, config), None)
    trainable = {name for name, p in bundle.model.named_parameters() if p.requires_grad}
    assert bundle.model.get_input_embeddings().weight.shape[0] == len(tokenizer) > 300
    assert "transformer.wte.weight" in trainable
    assert set(hf_neural_attn.scorer_parameters(bundle.model)) <= trainable
    assert "transformer.h.0.mlp.c_fc.weight" not in trainable


def test_gradient_accumulation_set_by_the_accelerate_config_is_used_and_recorded(assets, tmp_path, monkeypatch):
    # What `accelerate launch` with a DeepSpeed config exports; it overrides the flag inside Accelerator.
    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "1")
    results = finetune_in_process(tmp_path / "run", *clm_flags(assets, "--gradient_accumulation_steps", "2"))
    assert results["settings"]["gradient_accumulation_steps"] == 1
    assert results["total_train_batch_size"] == 4


def test_a_patched_checkpoint_can_keep_training_only_its_new_parameters(assets, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    first = tmp_path / "first"
    finetune_in_process(first, *clm_flags(assets, "--scorer", "neural", "--proj_dim", "2"))
    second = tmp_path / "second"
    # --impl is the run's, not the checkpoint's (the record does not save it): it reaches the reloaded scorers.
    flags = clm_flags(assets, "--scorer", "none", "--train_only_new_params", "--attention_map_layer", "none")
    flags += ["--impl", "chunked"]
    flags[flags.index("--model_name_or_path") + 1] = str(first)
    loaded = []
    load = hf_neural_attn.from_pretrained
    monkeypatch.setattr(hf_neural_attn, "from_pretrained", lambda *a, **k: loaded.append(load(*a, **k)) or loaded[-1])
    results = finetune_in_process(second, *flags)
    assert results["patch"]["scorer"] == "neural"
    assert len(loaded) == 1 and scorer_impls(loaded[0]) == {"chunked"}
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


@pytest.fixture(scope="module")
def from_scratch_command_line(tmp_path_factory):
    """`python -m recipes.finetune` on a GPT-2 built from --model_type (input and output embeddings tied), without
    --tokenizer_name, saving a checkpoint at each of its two steps: the run folder and what the command printed."""
    out = tmp_path_factory.mktemp("from_scratch") / "run"
    flags = ["--model_type", "gpt2", "--config_overrides", "n_layer=1,n_embd=32,n_head=2", "--block_size", "32"]
    flags += ["--dataset_name", "pydoc_data", "--max_train_samples", "16", "--max_eval_samples", "2"]
    flags += ["--max_train_steps", "2", "--attention_map_layer", "none"]
    finished = run_recipe([*flags, "--checkpointing_steps", "1", "--output_dir", str(out)], offline_env())
    assert finished.returncode == 0, finished.stderr[-3000:]
    return out, finished.stdout + finished.stderr


@pytest.mark.spawns
def test_the_log_names_the_tokenizer_and_why(from_scratch_command_line):
    _, printed = from_scratch_command_line
    lines = [line for line in printed.splitlines() if " - INFO - recipes.tasks.text - Tokenizer: " in line]
    assert len(lines) == 1 and lines[0].endswith(
        "Tokenizer: the byte-level ByT5Tokenizer, as --tokenizer_name is not given and the model is built from "
        "scratch (--model_type gpt2) without a tokenizer of its own; pass --tokenizer_name (e.g. gpt2) for another."
    )


@pytest.mark.spawns
def test_checkpoints_of_tied_embeddings_are_saved_without_warnings(from_scratch_command_line):
    from safetensors import safe_open

    out, printed = from_scratch_command_line
    assert "Removed shared tensor" not in printed
    for checkpoint in ("step_1", "step_2"):  # the tied output weight is stored once, as save_pretrained stores it
        with safe_open(out / checkpoint / "model.safetensors", framework="pt") as weights:
            names = set(weights.keys())
            assert "transformer.wte.weight" in names and "lm_head.weight" not in names


@pytest.mark.spawns
def test_a_training_state_checkpoint_is_named_as_such_and_exports_to_the_model(from_scratch_command_line, tmp_path):
    """``hf_neural_attn.from_pretrained`` of a run's step_N says what the folder is and the command that makes a
    checkpoint of it; that command (``python -m recipes.export``) saves the model of the last step: the run's own
    saved model, tensor for tensor (the tied output weight tied again), with its tokenizer."""
    from transformers import AutoTokenizer, GPT2LMHeadModel

    from recipes.export import main as export

    out, _ = from_scratch_command_line
    with pytest.raises(ValueError, match=r"step_2 is a training-state folder.*not a model checkpoint") as error:
        hf_neural_attn.from_pretrained(out / "step_2")
    assert f"python -m recipes.export {out / 'step_2'} <new folder>" in str(error.value)

    assert export([str(out / "step_2"), str(tmp_path / "model")]) == 0
    exported, final = GPT2LMHeadModel.from_pretrained(tmp_path / "model"), GPT2LMHeadModel.from_pretrained(out)
    assert exported.lm_head.weight is exported.transformer.wte.weight
    final_state = final.state_dict()
    assert all(torch.equal(tensor, final_state[name]) for name, tensor in exported.state_dict().items())
    assert len(AutoTokenizer.from_pretrained(tmp_path / "model")) == len(AutoTokenizer.from_pretrained(out))
    # Not into a folder holding something already.
    assert export([str(out / "step_1"), str(tmp_path / "model")]) == 2


# What every run printed, and a LoRA run on a plain checkpoint besides, that it does not act on (recipes/quiet.py and
# the causal-LM task's loss name deal with them): other libraries' start-up messages, and warnings about what PEFT or
# the recipe settles itself.
NOT_ACTED_ON = (
    "_C_mxfp8",  # torchao: "Failed to load .../torchao/_C_mxfp8...so"
    "_C_cutlass_90a",  # the same for its Hopper kernels
    "is an Enum subclass and is now natively supported by torch.compile",  # torch's pytree, on torchao's import
    "Failed to load CPU gemm_4bit_forward",  # bitsandbytes, on its import
    "Setting accelerator to CPU",  # DeepSpeed, on its import (Accelerate's unwrap_model imports it)
    "`loss_type=None` was set in the config",  # transformers: GPT2LMHeadModel's name names no loss
    "Adapters saved from this model will name",  # the library: the card loads the adapter onto the patched base
    "fan_in_fan_out is set to False",  # PEFT, on GPT-2's Conv1D layers
    "`is_gradient_checkpointing` is deprecated",  # transformers, called by PEFT
)


@pytest.mark.spawns
def test_a_run_prints_nothing_it_does_not_act_on_and_still_shows_a_real_warning(assets, tmp_path):
    flags = clm_flags(assets, "--scorer", "qana", "--scorer_init", "zero", "--lora_r", "2")
    flags[flags.index("--max_train_steps") + 1] = "1"
    finished = run_recipe(
        [*flags, "--attention_map_layer", "none", "--output_dir", str(tmp_path / "run")], offline_env()
    )
    assert finished.returncode == 0, finished.stderr[-3000:]
    printed = (finished.stdout + finished.stderr).replace("\r", "\n")
    assert [line for line in printed.splitlines() if any(noise in line for noise in NOT_ACTED_ON)] == []
    # A warning that no filter names still shows: the library's, on --scorer_init zero.
    assert "UserWarning: init='zero' is the papers' literal init" in finished.stderr
