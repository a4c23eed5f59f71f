"""FSDP: a patched model trains fully sharded (PyTorch's FSDP2, ``fully_shard``) on 2 CPU processes over gloo, as it
trains in one process; with only the new parameters trainable (mixed ``requires_grad``, the known FSDP pitfall);
its sharded training state saves and resumes (torch.distributed.checkpoint); its full state dict saves as an
ordinary patched checkpoint.

Accelerate runs FSDP on GPUs only (on CPU it falls back to plain data parallel), so the recipe's FSDP path is
checked by the last test, which runs where CUDA is present; the command is in docs/recipes.md.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers.models import TINY_DECODER
from helpers.references import DISTRIBUTED_TOL
from recipes_helpers import finetune_in_process, in_process_runs, save_tiny_gpt2

import hf_neural_attn

fsdp = pytest.importorskip("torch.distributed.fsdp", reason="this torch has no FSDP")
if not hasattr(fsdp, "fully_shard") or not dist.is_available():
    pytest.skip("this torch has no FSDP2 (fully_shard) or no torch.distributed", allow_module_level=True)

STEPS, BATCH, SEQ = 3, 4, 12


def tiny_patched_llama(scorer: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY_DECODER))
    hf_neural_attn.patch_model(model, scorer, h=2)
    with torch.no_grad():  # the scorers' nonlinear term live, so their gradients are not trivial
        generator = torch.Generator().manual_seed(1)
        for parameter in hf_neural_attn.scorer_parameters(model).values():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.1)
    return model


def batches():
    generator = torch.Generator().manual_seed(2)
    return [torch.randint(0, 64, (BATCH, SEQ), generator=generator) for _ in range(STEPS)]


def freeze_base(model, only_new: bool) -> None:
    new = hf_neural_attn.scorer_parameters(model)
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(name in new or not only_new)


def train_steps(model, optimizer, steps, rank: int = 0, world: int = 1) -> None:
    for ids in steps:
        part = ids.chunk(world)[rank]  # each process its share of the batch; the mean loss over equal shares
        model(part, labels=part).loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def optimizer_for(model):
    """SGD with momentum: an optimizer state to save and resume, and updates linear in the gradients."""
    return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5, momentum=0.9)


# (scorer, train only the new parameters): every case runs in the one pair of processes (their start-up, not the
# training, is most of what a launch costs).
CASES = [("qana", False), ("qana", True), ("neural", True)]


def case_folder(out: str, scorer: str, only_new: bool) -> str:
    return os.path.join(out, f"{scorer}-{'new' if only_new else 'all'}")


def _sharded_worker(rank: int, world: int, init_file: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    for scorer, only_new in CASES:
        _sharded_case(rank, world, case_folder(out, scorer, only_new), scorer, only_new)
        dist.barrier()
    dist.destroy_process_group()


def _sharded_case(rank: int, world: int, out: str, scorer: str, only_new: bool) -> None:
    """One case in the running process group: the final full state dict, uninterrupted and resumed."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_state_dict,
        set_state_dict,
    )
    from torch.distributed.fsdp import fully_shard

    os.makedirs(out, exist_ok=True)

    def sharded():
        model = tiny_patched_llama(scorer)
        freeze_base(model, only_new)
        for layer in model.model.layers:  # the scorer is a submodule of its layer: sharded with it
            fully_shard(layer)
        fully_shard(model)
        return model, optimizer_for(model)

    steps = batches()
    # Uninterrupted: STEPS steps.
    model, optimizer = sharded()
    train_steps(model, optimizer, steps, rank, world)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    # Interrupted after one step: the sharded state saved, loaded into fresh shards, training continued.
    model, optimizer = sharded()
    train_steps(model, optimizer, steps[:1], rank, world)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=os.path.join(out, "dcp"))
    model, optimizer = sharded()
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=os.path.join(out, "dcp"))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    train_steps(model, optimizer, steps[1:], rank, world)
    resumed = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save({"full": full, "resumed": resumed}, os.path.join(out, "states.pt"))


@pytest.fixture(scope="module")
def sharded_runs(tmp_path_factory) -> str:
    """2 processes, fully sharded, once for every case of CASES: the folder that holds each case's folder."""
    out = tmp_path_factory.mktemp("fsdp")
    mp.start_processes(_sharded_worker, args=(2, str(out / "init"), str(out)), nprocs=2, start_method="spawn")
    return str(out)


@pytest.fixture(scope="module", params=CASES, ids=str)
def sharded_run(request, sharded_runs):
    """One case's final full state dict, uninterrupted and resumed after a kill-free save."""
    scorer, only_new = request.param
    return scorer, only_new, torch.load(os.path.join(case_folder(sharded_runs, scorer, only_new), "states.pt"))


@pytest.mark.spawns
def test_sharded_training_matches_one_process(sharded_run):
    scorer, only_new, states = sharded_run
    model = tiny_patched_llama(scorer)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    freeze_base(model, only_new)
    train_steps(model, optimizer_for(model), batches())
    new = hf_neural_attn.scorer_parameters(model)
    for name, parameter in model.named_parameters():
        torch.testing.assert_close(
            states["full"][name], parameter.detach(), **DISTRIBUTED_TOL, msg=lambda m, n=name: f"{n}: {m}"
        )
        if only_new and name not in new:
            assert torch.equal(states["full"][name], before[name]), f"{name} is frozen but moved"
    assert any(not torch.equal(states["full"][name], before[name]) for name in new)  # the scorers trained


@pytest.mark.spawns
def test_sharded_state_saves_and_resumes_exactly(sharded_run):
    _, _, states = sharded_run
    for name, tensor in states["full"].items():
        torch.testing.assert_close(states["resumed"][name], tensor, rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.spawns
def test_the_gathered_state_is_an_ordinary_patched_checkpoint(sharded_run, tmp_path):
    scorer, _, states = sharded_run
    model = tiny_patched_llama(scorer)
    model.load_state_dict(states["full"])
    model.save_pretrained(tmp_path)
    ids = batches()[0]
    loaded = hf_neural_attn.from_pretrained(tmp_path)
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)


def fsdp_recipe_flags(root: Path) -> list[str]:
    """The documented FSDP run's flags: a tiny pretrained GPT-2 (so --train_only_new_params has base weights to
    keep), QANA, a few steps."""
    base = save_tiny_gpt2(root / "base")
    flags = ["--dataset_name", "pydoc_data", "--model_name_or_path", str(base)]
    flags += ["--scorer", "qana", "--block_size", "64", "--max_train_steps", "4", "--max_eval_samples", "8"]
    return [*flags, "--max_train_samples", "64", "--train_only_new_params"]


def test_the_fsdp_recipe_flags_run_on_one_cpu_process(tmp_path):
    """The flags the GPU test below launches pass the recipe's own checks and train, here without FSDP: a GPU run
    of that test can only fail for FSDP's sake."""
    with in_process_runs():
        results = finetune_in_process(tmp_path / "run", *fsdp_recipe_flags(tmp_path))
    assert results["train_steps"] == 4 and results["patch"]["scorer"] == "qana"


@pytest.mark.spawns
@pytest.mark.skipif(not torch.cuda.is_available(), reason="Accelerate runs FSDP on GPUs only")
def test_the_recipe_trains_under_accelerate_fsdp(tmp_path):
    """The documented command, one process per GPU: the run trains, saves a loadable patched checkpoint, and
    --train_only_new_params keeps the base weights."""
    root = Path(__file__).resolve().parents[2]
    config = root / "recipes" / "accelerate_configs" / "fsdp.yaml"
    flags = [*fsdp_recipe_flags(tmp_path), "--output_dir", str(tmp_path / "run")]
    launcher = [shutil.which("accelerate") or "accelerate", "launch", "--config_file", str(config)]
    launcher += ["--num_processes", str(torch.cuda.device_count()), "--mixed_precision", "no"]
    result = subprocess.run(
        [*launcher, "-m", "recipes.finetune", *flags],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "run" / "all_results.json").is_file()
    assert hf_neural_attn.is_patched(hf_neural_attn.from_pretrained(tmp_path / "run"))
    assert sys.modules["hf_neural_attn"] is hf_neural_attn
