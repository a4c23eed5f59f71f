"""The recipe as separate processes: two-process DDP (Accelerate over gloo, on CPU) and resume after SIGKILL.

These start `python -m recipes.finetune` / `accelerate launch ... -m recipes.finetune` subprocesses offline
(HF_HUB_OFFLINE=1), one thread per process so that float results are reproducible from run to run; the one-process
run the DDP runs are compared with is the recipe's `run` in this process, also on one thread.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from recipes_helpers import (  # fresh_accelerate_state, one_thread: autouse fixtures (in-process runs)
    FINETUNE,
    ROOT,
    TINY_GPT2_OVERRIDES,
    finetune_in_process,
    fresh_accelerate_state,  # noqa: F401
    glue_file_args,
    offline_env,
    one_thread,  # noqa: F401
    read_history,
    read_results,
    run_recipe,
    save_tiny_gpt2,
    save_tiny_vit,
    without_times,
    write_glue_files,
    write_image_folders,
    write_text_files,
)

import hf_neural_attn
from recipes.export import export_checkpoint

pytestmark = [pytest.mark.spawns]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("recipe_processes")
    train, validation = write_text_files(root / "text", train_lines=160, validation_lines=40)
    images_train, images_validation = write_image_folders(root / "images")
    return {
        "root": root,
        # Dropout off for the one-vs-two-process comparison: each process would draw its own masks.
        "gpt2": save_tiny_gpt2(root / "tiny-gpt2"),
        # Dropout on for the resume test: a resumed run must also draw the same dropout masks.
        "gpt2_dropout": save_tiny_gpt2(root / "tiny-gpt2-dropout", dropout=0.1),
        "vit": save_tiny_vit(root / "tiny-vit"),
        "train": train,
        "validation": validation,
        "glue": write_glue_files(root / "glue", "mrpc", train_rows=32, eval_rows=17),
        "images_train": images_train,
        "images_validation": images_validation,
    }


def accelerate_launcher() -> list[str]:
    """`accelerate launch` with the shipped two-process DDP config (torchrun underneath, a free port)."""
    accelerate = shutil.which("accelerate", path=str(Path(sys.executable).parent)) or "accelerate"
    return [accelerate, "launch", "--config_file", str(ROOT / "recipes" / "accelerate_configs" / "ddp_2proc.yaml")]


def check(process: subprocess.CompletedProcess) -> None:
    message = f"exit code {process.returncode}\n{process.stdout[-3000:]}\n{process.stderr[-6000:]}"
    assert process.returncode == 0, message


def task_flags(kind: str, workspace) -> tuple[list[str], int, dict[str, float]]:
    """Flags for a small run of each task kind, the global batch size, and the tolerance of each metric."""
    if kind == "clm":
        flags = ["--task", "clm", "--train_file", str(workspace["train"])]
        flags += ["--validation_file", str(workspace["validation"]), "--config_overrides", TINY_GPT2_OVERRIDES]
        flags += ["--block_size", "32", "--max_train_samples", "64", "--max_train_steps", "6", "--eval_steps", "3"]
        flags += ["--scorer", "qana", "--learning_rate", "1e-3"]
        return flags, 8, {"perplexity": 1e-4}
    if kind == "mrpc":
        flags = ["--task", "mrpc", "--model_name_or_path", str(workspace["gpt2"]), *glue_file_args(workspace["glue"])]
        flags += ["--max_seq_length", "32", "--max_train_steps", "3", "--eval_steps", "3"]
        flags += ["--scorer", "neural", "--proj_dim", "2"]
        # This seed and learning rate leave the tiny classifier predicting both classes (larger rates collapse it
        # onto the majority class), so equal accuracy and F1 mean equal predictions, not two constant ones.
        flags += ["--seed", "2", "--learning_rate", "1e-5"]
        return flags, 8, {"accuracy": 0.0, "f1": 0.0}
    flags = ["--task", "image", "--model_name_or_path", str(workspace["vit"])]
    flags += ["--train_dir", str(workspace["images_train"]), "--validation_dir", str(workspace["images_validation"])]
    flags += ["--max_train_steps", "2", "--eval_steps", "2", "--scorer", "qana", "--learning_rate", "1e-3"]
    return flags, 6, {"accuracy": 0.0}


@pytest.mark.parametrize("kind", ["clm", "mrpc", "image"])
def test_two_processes_give_the_metrics_of_one(kind, workspace, tmp_path):
    flags, batch, tolerances = task_flags(kind, workspace)
    # Evaluation batches of 3: the evaluation sets do not split evenly over 2 processes, so the padding
    # duplicates Accelerate adds must be dropped again when predictions are gathered.
    flags += ["--logging_steps", "1", "--per_device_eval_batch_size", "3"]
    env = offline_env(tmp_path / "hf_home")
    one, two = tmp_path / "one", tmp_path / "two"
    # The one-process reference runs in this process (the recipe's own run; its CLI is tested elsewhere).
    finetune_in_process(one, *flags, "--per_device_train_batch_size", str(batch))
    # Two CPU processes: the DDP config (distributed_type MULTI_GPU) makes `accelerate launch` start them with
    # torchrun; with no GPU the recipe's Accelerator runs on CPU and Accelerate joins the processes with DDP
    # over gloo. Each process takes half the batch: the same examples per step as the single process.
    half = ["--per_device_train_batch_size", str(batch // 2), "--output_dir", str(two)]
    if kind == "clm":  # a checkpoint at the last step, exported below
        half += ["--checkpointing_steps", "6"]
    check(run_recipe([*flags, *half], env, launcher=accelerate_launcher()))

    single, double = read_results(one), read_results(two)
    assert (single["num_processes"], double["num_processes"]) == (1, 2)
    assert single["total_train_batch_size"] == double["total_train_batch_size"] == batch
    assert double["eval_samples"] == single["eval_samples"]
    # Same examples in each step (the seeded sampler shuffles the same way on every process; each takes every
    # other batch), the same evaluation examples (gathered, duplicates dropped) and learning rates. What differs
    # is float summation order: DDP averages two half-batch gradients instead of taking one full-batch mean, and
    # each process multiplies smaller matrices. Measured on the clm run: ~3e-8 relative in perplexity, while
    # training on 7 instead of 8 examples per step moves it by ~2e-3 relative: 1e-4 sits between the two.
    # Accuracy and F1 count argmax decisions, which such round-off does not flip here: they must be equal.
    if kind == "mrpc":
        assert 0 < single["f1"] and single["accuracy"] not in (8 / 17, 9 / 17), "constant predictions"
    for metric, tolerance in tolerances.items():
        assert double[metric] == pytest.approx(single[metric], rel=tolerance, abs=1e-12), metric
    history_one, history_two = read_history(one), read_history(two)
    for a, b in zip(history_one["train_loss"], history_two["train_loss"], strict=True):
        assert a[0] == b[0] and b[1] == pytest.approx(a[1], rel=1e-4)
    assert [e["step"] for e in history_one["evaluations"]] == [e["step"] for e in history_two["evaluations"]]
    if kind == "clm":
        # The DDP checkpoint (its weights under the wrapper's module. names) exports to the run's saved model.
        assert export_checkpoint(two / "step_6", tmp_path / "exported") == tmp_path / "exported"
        exported = hf_neural_attn.from_pretrained(tmp_path / "exported").state_dict()
        saved = hf_neural_attn.from_pretrained(two).state_dict()
        assert exported.keys() == saved.keys() and all(torch.equal(exported[n], saved[n]) for n in saved)


def test_resume_after_sigkill_ends_with_the_uninterrupted_metrics(workspace, tmp_path):
    flags = ["--task", "clm", "--model_name_or_path", str(workspace["gpt2_dropout"]), "--scorer", "qana"]
    flags += ["--train_file", str(workspace["train"]), "--validation_file", str(workspace["validation"])]
    flags += ["--block_size", "32", "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2"]
    # 80 steps: the first checkpoint (step 5) comes seconds before the end, so the kill lands mid-run.
    flags += ["--max_train_steps", "80", "--checkpointing_steps", "5", "--eval_steps", "40", "--logging_steps", "7"]
    flags += ["--learning_rate", "1e-3", "--lr_scheduler_type", "cosine", "--num_warmup_steps", "10"]
    flags += ["--max_eval_samples", "10"]
    env = offline_env(tmp_path / "hf_home")
    killed = tmp_path / "killed"
    command = [sys.executable, *FINETUNE, *flags, "--output_dir", str(killed)]
    process = subprocess.Popen(command, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 240
        while not list(killed.glob("step_*")):
            assert process.poll() is None, (
                f"the run ended before its first checkpoint:\n{process.stderr.read()[-4000:]}"
            )
            assert time.time() < deadline, "no checkpoint appeared in 240 s"
            time.sleep(0.02)
        time.sleep(0.3)  # let it run on past the checkpoint, possibly into the next save
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
        process.stderr.close()
    assert process.returncode == -signal.SIGKILL
    assert not (killed / "all_results.json").exists(), "the run finished before it was killed; the test proved nothing"
    checkpoints = sorted(int(p.name.split("_")[1]) for p in killed.glob("step_*"))
    assert checkpoints and checkpoints[-1] < 80

    resumed_process = run_recipe([*flags, "--output_dir", str(killed), "--resume_from_checkpoint", "latest"], env)
    check(resumed_process)
    assert f"Resuming from {killed / f'step_{checkpoints[-1]}'}" in resumed_process.stderr
    uninterrupted = tmp_path / "uninterrupted"
    check(run_recipe([*flags, "--output_dir", str(uninterrupted)], env))

    resumed, reference = read_results(killed), read_results(uninterrupted)
    # Same seed, CPU, one thread: the resumed run replays the uninterrupted one exactly (same batches in the
    # same order, same dropout masks, same optimizer and scheduler state), so the numbers are equal, not close.
    assert resumed["perplexity"] == reference["perplexity"]
    assert resumed["train_steps"] == reference["train_steps"] == 80
    assert without_times(read_history(killed)) == without_times(read_history(uninterrupted))
    assert not list(killed.glob(".*.partial")), "a half-written checkpoint was left behind after the resumed run"


def test_a_refusal_under_accelerate_launch_reaches_the_launchers_summary(tmp_path):
    """docs/recipes.md, "Bad input": under `accelerate launch` every process refuses with the one-line message and exit
    code 2; the launcher (torch's elastic agent) then fails the job its own way, torch's ChildFailedError and exit
    code 1, and its summary shows the message rather than a pointer to torch's docs."""
    missing = tmp_path / "missing.txt"
    flags = ["--task", "clm", "--train_file", str(missing), "--output_dir", str(tmp_path / "out")]
    process = run_recipe(flags, offline_env(tmp_path / "hf_home"), launcher=accelerate_launcher())
    message = f"finetune.py: error: --train_file {missing} does not exist."
    assert process.returncode == 1, process.stderr[-3000:]
    assert "ChildFailedError" in process.stderr and "exitcode  : 2" in process.stderr
    assert f"traceback : {message}" in process.stderr, process.stderr[-3000:]
