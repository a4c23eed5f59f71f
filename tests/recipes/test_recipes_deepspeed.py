"""The recipe under `accelerate launch` with the shipped DeepSpeed configs, as 2 CPU processes forming one job.

ZeRO-3 (`recipes/accelerate_configs/deepspeed_zero3.yaml`: the model built partitioned, the scorers created
partitioned, the whole model gathered for saving) is compared with the same run under DDP; its `save_state`
checkpoint resumes to the same end; its output folder loads as an ordinary patched checkpoint. ZeRO-2 trains the
new parameters only. The library-level checks (patching partitioned weights, reloading and generating under
ZeRO-3, frozen and unfrozen base, gradient checkpointing) are in tests/integrations/test_deepspeed.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from recipes_helpers import (
    ROOT,
    offline_env,
    read_history,
    read_results,
    run_recipe,
    save_tiny_gpt2,
    write_text_files,
)
from transformers import GPT2LMHeadModel

import hf_neural_attn
from recipes.export import export_checkpoint

pytest.importorskip("deepspeed", reason="the DeepSpeed tests need it: pip install 'hf-neural-attn[deepspeed]'")
pytestmark = [pytest.mark.deepspeed, pytest.mark.spawns]

CONFIGS = ROOT / "recipes" / "accelerate_configs"


def launcher(config: str, *overrides: str) -> list[str]:
    accelerate = shutil.which("accelerate", path=str(Path(sys.executable).parent)) or "accelerate"
    return [accelerate, "launch", "--config_file", str(CONFIGS / config), *overrides]


def check(process) -> None:
    assert process.returncode == 0, (
        f"exit code {process.returncode}\n{process.stdout[-3000:]}\n{process.stderr[-6000:]}"
    )


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("recipe_deepspeed")
    train, validation = write_text_files(root / "text", train_lines=160, validation_lines=40)
    flags = ["--task", "clm", "--train_file", str(train), "--validation_file", str(validation)]
    flags += ["--block_size", "32", "--max_train_samples", "64", "--max_train_steps", "6", "--eval_steps", "3"]
    flags += ["--logging_steps", "1", "--per_device_eval_batch_size", "3", "--per_device_train_batch_size", "4"]
    # GPT-2's default dropout (0.1), as users train it: the recipe seeds each micro-batch's masks, so ZeRO-3 and DDP
    # draw the same ones.
    gpt2 = save_tiny_gpt2(root / "tiny-gpt2", dropout=0.1)
    return {"root": root, "flags": flags, "gpt2": gpt2, "env": offline_env(root / "hf")}


def scorer_tensors(folder: Path) -> dict[str, torch.Tensor]:
    model = hf_neural_attn.from_pretrained(folder)
    return {name: parameter.detach() for name, parameter in hf_neural_attn.scorer_parameters(model).items()}


# Run by `accelerate launch` on every rank: the recipe's own Accelerator, what each rank sees of a dataset, and the
# models the recipe builds (sys.argv[2:]: model folders) with --train_only_new_params and weight decay: which
# parameters train and decay, and the counts it reports.
RANK_REPORT = """
import json, sys
from torch.utils.data import DataLoader
from build_report import build_report
from recipes.args import parse_args
from recipes.training import make_accelerator

accelerator = make_accelerator(parse_args(["--task", "clm", "--output_dir", sys.argv[1]]))
loader = accelerator.prepare(DataLoader(list(range(16)), batch_size=2))
seen = [int(item) for batch in loader for item in batch]
report = {"num_processes": accelerator.num_processes, "process_index": accelerator.process_index,
          "distributed_type": str(accelerator.distributed_type), "seen": seen,
          "models": {folder: build_report(folder, sys.argv[1]) for folder in sys.argv[2:]}}
with open(f"{sys.argv[1]}/rank_{accelerator.process_index}.json", "w") as handle:
    json.dump(report, handle)
"""

# What RANK_REPORT reports of each model the recipe builds, also run in the test's own process (no DeepSpeed): the
# same build must train, decay and count the same parameters.
BUILD_REPORT = """
import hf_neural_attn
from recipes import modeling
from recipes.args import parse_args
from recipes.optimization import build_optimizer
from recipes.tasks import get_task


def build_report(folder, output_dir):
    flags = ["--task", "clm", "--model_name_or_path", folder, "--scorer", "neural", "--train_only_new_params"]
    args = parse_args([*flags, "--weight_decay", "0.1", "--output_dir", output_dir])
    task = get_task(args.task)
    config = modeling.load_config(args, task)
    bundle = modeling.build_model(args, task, config, task.load_preprocessor(args, config), None)
    model = bundle.model
    decayed = [group for group in build_optimizer(model, args).param_groups if group["weight_decay"] > 0]
    names = {id(parameter): name for name, parameter in model.named_parameters()}
    embeddings = model.get_input_embeddings().weight
    return {
        # Every weight of the loaded model (the embeddings a resize made anew are whole on every process).
        "partitioned": all(
            hasattr(parameter, "ds_id")
            for name, parameter in model.named_parameters()
            if name not in bundle.new_parameters
        ),
        "embedding_rows": getattr(embeddings, "ds_shape", embeddings.shape)[0],  # DeepSpeed's whole shape
        "trainable": sorted(name for name, parameter in model.named_parameters() if parameter.requires_grad),
        "scorers": sorted(hf_neural_attn.scorer_parameters(model)),
        "new": sorted(bundle.new_parameters),
        "decayed": sorted(names[id(parameter)] for group in decayed for parameter in group["params"]),
        "parameters": modeling.count_parameters(model),
    }
"""


def test_zero3_launch_is_one_job_that_builds_the_models_of_one_process(workspace, tmp_path):
    """accelerate alone, on a machine without an accelerator, reports 1 process on each rank of a DeepSpeed launch
    (so each rank would read the whole dataset); the recipe's Accelerator makes the 2 processes one job.

    The recipe builds its model partitioned there (each rank holds an empty placeholder of every weight), and asks
    its questions of the whole tensors: with --train_only_new_params, the tiny GPT-2 trains its scorers only, and one
    whose vocabulary a larger tokenizer grows trains its embeddings too (tied to the LM head), as in one process;
    weight decay goes to the same matrices; the parameter counts are the whole model's."""
    from transformers import ByT5Tokenizer, GPT2Config

    small_vocab = tmp_path / "small-vocab"
    GPT2LMHeadModel(GPT2Config(vocab_size=300, n_embd=32, n_layer=2, n_head=2, n_positions=64)).save_pretrained(
        small_vocab
    )
    ByT5Tokenizer().save_pretrained(small_vocab)
    models = [str(workspace["gpt2"]), str(small_vocab)]
    (tmp_path / "rank_report.py").write_text(RANK_REPORT)
    (tmp_path / "build_report.py").write_text(BUILD_REPORT)
    env = {**workspace["env"], "PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}"}
    process = subprocess.run(
        [*launcher("deepspeed_zero3.yaml"), str(tmp_path / "rank_report.py"), str(tmp_path), *models],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    check(process)
    reports = [json.loads((tmp_path / f"rank_{rank}.json").read_text()) for rank in (0, 1)]
    for rank, report in enumerate(reports):
        assert report["num_processes"] == 2 and report["process_index"] == rank, report
        assert report["distributed_type"] == "DistributedType.DEEPSPEED", report
    # The data is split: each rank its own half, together every example once.
    assert not set(reports[0]["seen"]) & set(reports[1]["seen"])
    assert sorted(reports[0]["seen"] + reports[1]["seen"]) == list(range(16))

    sys.path.insert(0, str(tmp_path))
    try:
        from build_report import build_report
    finally:
        sys.path.remove(str(tmp_path))
    for folder in models:
        expected = build_report(folder, str(tmp_path / "one_process"))
        assert not expected["partitioned"]
        for report in reports:
            built = report["models"][folder]
            assert built["partitioned"], "the model was not built partitioned: the test proves nothing"
            assert built == {**expected, "partitioned": True}, folder
    unchanged, resized = (reports[0]["models"][folder] for folder in models)
    # Exactly the scorers, and a resized embedding matrix (GPT-2's LM head is the same tensor).
    assert unchanged["trainable"] == unchanged["scorers"] and unchanged["new"] == []
    assert resized["embedding_rows"] == len(ByT5Tokenizer()) > 300
    assert resized["trainable"] == sorted({*resized["scorers"], "transformer.wte.weight"})
    assert unchanged["parameters"]["trainable"] == unchanged["parameters"]["added_by_patch"] > 0
    assert unchanged["decayed"] and all(".attn_scorer." in name for name in unchanged["decayed"])


def test_zero3_is_one_job_matches_ddp_resumes_and_saves_a_patched_checkpoint(workspace, tmp_path):
    """With --train_only_new_params (and weight decay on the matrices): the library's tests train the whole model under
    ZeRO-3 (tests/integrations/test_deepspeed.py); here the recipe must freeze the same parameters as under DDP."""
    flags = [*workspace["flags"], "--model_name_or_path", str(workspace["gpt2"]), "--scorer", "qana"]
    flags += ["--learning_rate", "1e-3", "--gradient_checkpointing", "--train_only_new_params", "--weight_decay", "0.1"]
    zero3, resumed, ddp = tmp_path / "zero3", tmp_path / "resumed", tmp_path / "ddp"
    env = workspace["env"]
    zero3_launch = launcher("deepspeed_zero3.yaml")
    check(run_recipe([*flags, "--checkpointing_steps", "3", "--output_dir", str(zero3)], env, launcher=zero3_launch))
    check(run_recipe([*flags, "--output_dir", str(ddp)], env, launcher=launcher("ddp_2proc.yaml")))

    # One job of 2 processes (accelerate alone would count 1 on each rank here, see make_accelerator), each taking
    # half of the batch of 8.
    results, reference = read_results(zero3), read_results(ddp)
    assert results["num_processes"] == reference["num_processes"] == 2
    assert results["total_train_batch_size"] == reference["total_train_batch_size"] == 8
    # The scorers train, nothing else: the counts of the whole tensors, as under DDP.
    assert results["parameters"] == reference["parameters"]
    assert results["parameters"]["trainable"] == results["parameters"]["added_by_patch"] > 0
    # Same data order, seed and dropout masks; what differs is how gradients are summed and where they are clipped
    # (DeepSpeed clips at the config's gradient_clipping 1.0, the DDP run at --max_grad_norm 1.0). Measured: the
    # logged losses equal to every digit, the perplexity 1e-8 relative apart.
    assert results["perplexity"] == pytest.approx(reference["perplexity"], rel=1e-4)
    for (step, loss), (step_ddp, loss_ddp) in zip(
        read_history(zero3)["train_loss"], read_history(ddp)["train_loss"], strict=True
    ):
        assert step == step_ddp and loss == pytest.approx(loss_ddp, rel=1e-4)
    # The gathered save is an ordinary patched checkpoint holding the trained scorers: those of the DDP run, which
    # start from the same init (the recipe seeds it). Adam turns the rounding noise of gradients that are zero in
    # exact arithmetic into small steps: measured up to 5.6e-6 apart, against AdamW steps of up to 1e-3 per update.
    trained, trained_ddp = scorer_tensors(zero3), scorer_tensors(ddp)
    assert trained.keys() == trained_ddp.keys() and trained
    for name, tensor in trained.items():
        torch.testing.assert_close(tensor, trained_ddp[name], rtol=0, atol=1e-5, msg=name)
    gates = [tensor for name, tensor in trained.items() if name.endswith(".gate")]
    assert gates and any(not torch.all(gate == 1.0) for gate in gates), "the gates (1 at init) did not train"
    # The base is saved as it was loaded: the embeddings (and the LM head tied to them) did not move.
    base = GPT2LMHeadModel.from_pretrained(workspace["gpt2"]).state_dict()
    saved = hf_neural_attn.from_pretrained(zero3).state_dict()
    assert [name for name, tensor in base.items() if not torch.equal(saved[name], tensor)] == []

    # save_state under ZeRO-3 writes DeepSpeed's partitioned checkpoint: no model checkpoint, and the error says so;
    # its export (DeepSpeed's zero_to_fp32 gathers it) is the run's saved model, tensor for tensor.
    with pytest.raises(ValueError, match="is a training-state folder.*python -m recipes.export"):
        hf_neural_attn.from_pretrained(zero3 / "step_6")
    exported = hf_neural_attn.from_pretrained(export_checkpoint(zero3 / "step_6", tmp_path / "exported")).state_dict()
    assert exported.keys() == saved.keys() and all(torch.equal(exported[name], saved[name]) for name in saved)

    # save_state under ZeRO-3 (DeepSpeed's partitioned checkpoint) resumes to the uninterrupted run's end.
    check(
        run_recipe(
            [*flags, "--resume_from_checkpoint", str(zero3 / "step_3"), "--output_dir", str(resumed)],
            env,
            launcher=zero3_launch,
        )
    )
    assert read_results(resumed)["perplexity"] == results["perplexity"]
    assert read_history(resumed)["train_loss"] == read_history(zero3)["train_loss"]
    for name, tensor in scorer_tensors(resumed).items():
        assert torch.equal(tensor, trained[name]), name


def test_zero2_trains_the_new_parameters_only(workspace, tmp_path):
    """The shipped ZeRO-2 config (made for 8 GPUs in bf16) with 2 CPU processes in float32: the base is saved as
    it was loaded, and the Neural Attention scorers trained (the model at step 0 is the base, function-preserving,
    and its perplexity moves only through them)."""
    output = tmp_path / "zero2"
    flags = [*workspace["flags"], "--model_name_or_path", str(workspace["gpt2"]), "--scorer", "neural"]
    flags += ["--learning_rate", "1e-2", "--train_only_new_params", "--eval_at_start", "--output_dir", str(output)]
    overrides = ("--num_processes", "2", "--mixed_precision", "no")
    check(run_recipe(flags, workspace["env"], launcher=launcher("deepspeed_zero2.yaml", *overrides)))
    assert read_results(output)["num_processes"] == 2
    saved = hf_neural_attn.from_pretrained(output)
    base = type(saved).from_pretrained(workspace["gpt2"]).state_dict()
    saved_state = saved.state_dict()
    assert all(torch.equal(saved_state[name], tensor) for name, tensor in base.items())
    evaluations = [entry["perplexity"] for entry in read_history(output)["evaluations"]]
    assert len(evaluations) >= 2 and evaluations[-1] != pytest.approx(evaluations[0], rel=1e-4)
