"""recipes/checkpointing.py in-process: atomic checkpoints, keeping the newest, resuming exactly, and refusing a
checkpoint of another run. Kill-and-resume across processes (SIGKILL) is in test_recipes_distributed.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from recipes_helpers import (  # fresh_accelerate_state, one_thread: autouse fixtures
    clm_flags,
    finetune_in_process,
    fresh_accelerate_state,  # noqa: F401
    one_thread,  # noqa: F401
    read_results,
    tiny_recipe_assets,
    without_times,
)

from recipes import checkpointing
from recipes.errors import RecipeError


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return tiny_recipe_assets(tmp_path_factory.mktemp("recipe_assets"))


def test_gate_warmup_resumes_exactly(assets, tmp_path, monkeypatch):
    from recipes import training

    original = training.save_checkpoint

    def save_then_die(state, name):
        original(state, name)
        raise KeyboardInterrupt("killed after the first checkpoint")

    common = clm_flags(assets, "--max_train_steps", "5", "--logging_steps", "1", "--checkpointing_steps", "2")
    common += ["--gate_schedule", "warmup", "--attention_map_layer", "none"]
    flags = [*common, "--gate_warmup_steps", "3"]
    monkeypatch.setattr(training, "save_checkpoint", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        finetune_in_process(tmp_path / "run", *flags)
    monkeypatch.setattr(training, "save_checkpoint", original)
    assert checkpointing.find_latest(tmp_path / "run") == tmp_path / "run" / "step_2"
    # Resumed at step 2 of a 3-step warmup: alpha 2/3, then 1 at step 3 and learned from there.
    resumed = finetune_in_process(tmp_path / "run", *flags, "--resume_from_checkpoint", "latest")
    reference = finetune_in_process(tmp_path / "reference", *flags)
    assert resumed["scorer_history"] == reference["scorer_history"]
    assert resumed["perplexity"] == reference["perplexity"]
    gates = [entry["layers"][0]["gate"][0] for entry in resumed["scorer_history"]]
    assert gates[:4] == pytest.approx([0.0, 1 / 3, 2 / 3, 1.0], abs=1e-7) and gates[5] != 1.0
    with pytest.raises(RecipeError, match="different settings.*gate_warmup_steps"):
        finetune_in_process(tmp_path / "run", *common, "--gate_warmup_steps", "2", "--resume_from_checkpoint", "latest")


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
        finetune_in_process(out, *flags)
    monkeypatch.setattr(Accelerator, "save_state", original)
    assert (out / ".step_4.partial").is_dir() and not (out / "step_4").exists()
    assert checkpointing.find_latest(out) == out / "step_2"

    resumed = finetune_in_process(out, *flags, "--resume_from_checkpoint", "latest")
    reference = finetune_in_process(tmp_path / "reference", *flags)
    assert resumed["perplexity"] == reference["perplexity"]
    assert without_times(resumed["history"]) == without_times(reference["history"])
    assert resumed["scorer_history"] == reference["scorer_history"]  # saved with the checkpoint, continued
    assert [entry["step"] for entry in resumed["scorer_history"]] == [0, 6]
    assert not (out / ".step_4.partial").exists() and (out / "step_4").is_dir()


def test_checkpoint_every_epoch_and_keep_only_the_newest(assets, tmp_path):
    out = tmp_path / "epochs"
    # 8 blocks of 32 tokens, batch 4: two steps per epoch, so 6 steps are three epochs.
    flags = clm_flags(assets, "--max_train_samples", "8", "--max_train_steps", "6", "--checkpointing_steps", "epoch")
    finetune_in_process(out, *flags, "--checkpoints_total_limit", "2")
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["epoch_1", "epoch_2"]
    progress = checkpointing.read_progress(out / "epoch_2")
    assert (progress.completed_steps, progress.epoch, progress.batches_in_epoch) == (6, 3, 0)
    # Resuming a finished run trains no further and reports the same metrics.
    again = finetune_in_process(out, *flags, "--resume_from_checkpoint", "latest")
    assert again["train_steps"] == 6 and again["perplexity"] == read_results(out)["perplexity"]


def test_resume_refuses_a_checkpoint_of_a_different_run(assets, tmp_path):
    out = tmp_path / "run"
    finetune_in_process(out, *clm_flags(assets, "--checkpointing_steps", "2", "--scorer", "qana"))
    resume = ("--resume_from_checkpoint", str(out / "step_2"))
    # Each of these would change the run: a resumed optimizer would silently keep the old learning rate,
    # a different h would not even fit the saved weights.
    for changed in (("--seed", "7"), ("--learning_rate", "0.5"), ("--h", "2"), ("--scorer", "neural")):
        flags = clm_flags(assets, *resume, "--scorer", "qana", *changed)
        with pytest.raises(RecipeError, match=f"different settings.*{changed[0][2:]}"):
            finetune_in_process(out, *flags)
    with pytest.raises(RecipeError, match="not a complete checkpoint"):
        finetune_in_process(out, *clm_flags(assets, "--resume_from_checkpoint", str(assets["gpt2"])))
