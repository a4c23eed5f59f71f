"""DeepSpeed ZeRO-3: a patched model built, patched, trained, saved, reloaded and generating with its parameters
partitioned across 2 CPU processes (gloo), compared with the same model trained in one process without DeepSpeed.

The processes build the base from a checkpoint with an ``HfDeepSpeedConfig`` alive, as accelerate's
``zero3_init_flag: true`` and transformers' DeepSpeed integration do, so every base weight is partitioned before
``patch_model`` sees it. ``stage3_param_persistence_threshold: 0`` keeps DeepSpeed from leaving small tensors whole
(the tiny model's are all small), so every scorer parameter really is gathered where it is read. The recipe under
``accelerate launch`` with a ZeRO-3 config is tested in ``tests/recipes/test_recipes_deepspeed.py``.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from helpers.models import TINY_DECODER
from helpers.references import DISTRIBUTED_TOL

import hf_neural_attn

pytest.importorskip("deepspeed", reason="the DeepSpeed tests need it: pip install 'hf-neural-attn[deepspeed]'")
pytestmark = [pytest.mark.deepspeed, pytest.mark.spawns]

WORLD, STEPS, BATCH, SEQ = 2, 3, 4, 12
PATCH_SEED = 5  # the scorers' random init: rank 0's draw is broadcast, so the reference draws with the same seed
# No gradient clipping (DeepSpeed clips at 1.0 unless told), so the runs differ only by how gradients are summed.
ZERO3 = {
    "train_micro_batch_size_per_gpu": BATCH // WORLD,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 0.0,
    "zero_allow_untested_optimizer": True,  # the reference's plain SGD, so the updates are linear in the gradients
    "zero_optimization": {
        "stage": 3,
        "stage3_param_persistence_threshold": 0,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
}


def batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(2)
    return [torch.randint(0, TINY_DECODER["vocab_size"], (BATCH, SEQ), generator=generator) for _ in range(STEPS)]


def liven_scorers(model) -> None:
    """Move the scorers off their function-preserving init, so their nonlinear term and its gradients are live."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, parameter in sorted(hf_neural_attn.scorer_parameters(model).items()):
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.1)


def trainable(model, only_new: bool) -> list[torch.nn.Parameter]:
    new = hf_neural_attn.scorer_parameters(model)
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(name in new or not only_new)
    return [parameter for parameter in model.parameters() if parameter.requires_grad]


def optimizer_for(parameters):
    return torch.optim.SGD(parameters, lr=0.5, momentum=0.9)


def prepare_for_training(model, checkpointing: bool) -> None:
    model.config.use_cache = False
    if checkpointing:  # transformers 5.23 renamed gradient_checkpointing_enable
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.train()


def _zero3_worker(rank: int, init_file: str, base: str, root: str) -> None:
    """Every case of CASES in turn, in the same two processes (each case's files under ``root/<name>``): one start
    of the processes, DeepSpeed and transformers for all of them."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    import deepspeed
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    for name, case in CASES.items():
        _zero3_case(rank, base, f"{root}/{name}", case)
        dist.barrier()
    dist.destroy_process_group()


def _zero3_case(rank: int, base: str, out: str, case: dict) -> None:
    import deepspeed
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, LlamaForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    Path(out).mkdir(parents=True, exist_ok=True)
    ds_config = HfDeepSpeedConfig(ZERO3)  # noqa: F841 (alive = transformers builds the model partitioned)
    results: dict = {}

    model = LlamaForCausalLM.from_pretrained(base)
    torch.manual_seed(PATCH_SEED)
    hf_neural_attn.patch_model(model, case["scorer"], h=2)
    scorer_parameters = hf_neural_attn.scorer_parameters(model)
    results["partitioned"] = all(p.numel() == 0 and hasattr(p, "ds_id") for p in scorer_parameters.values())
    prompt = batches()[0]
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        results["logits_at_init"] = model(prompt).logits.tolist()
    with deepspeed.zero.GatheredParameters(list(scorer_parameters.values()), modifier_rank=0):
        liven_scorers(model)

    prepare_for_training(model, case["checkpointing"])
    optimizer = optimizer_for(trainable(model, case["only_new"]))
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ZERO3)
    losses = []
    for ids in batches():
        part = ids.chunk(WORLD)[rank]  # each process its half of the batch: the mean loss over equal halves
        loss = engine(part, labels=part).loss
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / WORLD)
    results["losses"] = losses

    # What accelerate's get_state_dict does under ZeRO-3 with stage3_gather_16bit_weights_on_model_save.
    state = engine._zero3_consolidated_16bit_state_dict()
    if rank == 0:
        engine.module.save_pretrained(f"{out}/trained", state_dict=state)
    dist.barrier()

    # save_adapter on every process, as save_pretrained runs: the partitioned tensors it saves and checks are
    # gathered, and process 0 writes. Then the trained model's logits (DeepSpeed's hooks gather each layer).
    results["partitioned_at_save"] = all(p.numel() == 0 for p in scorer_parameters.values())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hf_neural_attn.save_adapter(engine.module, f"{out}/adapter")
    results["adapter_warnings"] = [str(warning.message) for warning in caught]
    engine.module.eval()
    with torch.no_grad():
        results["trained_logits"] = engine.module(prompt).logits.tolist()

    # generate on the unwrapped model: DeepSpeed's hooks gather each layer's parameters, the scorers' included.
    engine.module.eval()
    engine.module.config.use_cache = True
    results["generated"] = engine.module.generate(prompt[:1, :6], max_new_tokens=5, do_sample=False).tolist()

    # Reloaded under ZeRO-3, by the library and by an Auto class: partitioned again, holding the trained tensors.
    for loader in ("hf_neural_attn", "auto"):
        if loader == "auto":
            reloaded = AutoModelForCausalLM.from_pretrained(f"{out}/trained")
        else:
            reloaded = hf_neural_attn.from_pretrained(f"{out}/trained")
        reloaded_scorers = hf_neural_attn.scorer_parameters(reloaded)
        results[f"{loader}_partitioned"] = all(p.numel() == 0 for p in reloaded_scorers.values())
        with deepspeed.zero.GatheredParameters(list(reloaded_scorers.values())):  # collective: every rank enters
            if rank == 0:  # the consolidated state dict is rank 0's only
                results[f"{loader}_equal"] = all(
                    torch.equal(parameter, state[name]) for name, parameter in reloaded_scorers.items()
                )
    # unpatch_model takes the scorers out again: the partitioned base gives the base model's logits.
    hf_neural_attn.unpatch_model(reloaded)
    with deepspeed.zero.GatheredParameters(list(reloaded.parameters())):
        results["unpatched_logits"] = reloaded(prompt).logits.tolist()
    if rank == 0:
        Path(f"{out}/results.json").write_text(json.dumps(results))


def reference_run(base: str, case: dict) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The same patch and training in one process, without DeepSpeed."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(base)
    torch.manual_seed(PATCH_SEED)
    hf_neural_attn.patch_model(model, case["scorer"], h=2)
    liven_scorers(model)
    prepare_for_training(model, case["checkpointing"])
    optimizer = optimizer_for(trainable(model, case["only_new"]))
    losses = []
    for ids in batches():
        loss = model(ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


CASES = {
    "qana": {"scorer": "qana", "only_new": False, "checkpointing": False},
    "neural-new-params-only": {"scorer": "neural", "only_new": True, "checkpointing": False},
    "qana-new-params-only-checkpointing": {"scorer": "qana", "only_new": True, "checkpointing": True},
    "neural-checkpointing": {"scorer": "neural", "only_new": False, "checkpointing": True},
}


@pytest.fixture(scope="module")
def zero3_runs(tmp_path_factory):
    """The base checkpoint, its logits on the first batch, and the folder holding each case's files."""
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("zero3")
    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(**TINY_DECODER))
    base.save_pretrained(root / "base")
    with torch.no_grad():
        base_logits = base(batches()[0]).logits
    mp.spawn(_zero3_worker, args=(str(root / "init"), str(root / "base"), str(root)), nprocs=WORLD)
    return base, base_logits, root


@pytest.mark.parametrize("name", list(CASES))
def test_zero3_patch_train_save_reload_generate(name, zero3_runs):
    base, base_logits, root = zero3_runs
    case, case_dir = CASES[name], root / name
    results = json.loads((case_dir / "results.json").read_text())

    # patch_model on partitioned weights: partitioned scorers, and the function-preserving model of one process.
    assert results["partitioned"]
    torch.testing.assert_close(torch.tensor(results["logits_at_init"]), base_logits, rtol=1e-5, atol=1e-5)
    # Training: the losses and the trained tensors of one process without DeepSpeed.
    losses, trained = reference_run(str(root / "base"), case)
    assert results["losses"] == pytest.approx(losses, rel=1e-5)
    saved = hf_neural_attn.from_pretrained(case_dir / "trained")
    saved_state = saved.state_dict()
    for tensor_name, tensor in trained.items():
        torch.testing.assert_close(saved_state[tensor_name], tensor, **DISTRIBUTED_TOL, msg=tensor_name)
    moved = [n for n, p in hf_neural_attn.scorer_parameters(saved).items() if not torch.allclose(p, trained[n] * 0)]
    assert moved, "the scorers were saved empty"
    if case["only_new"]:  # a frozen base is saved as it was loaded
        base_state = base.state_dict()
        assert all(torch.equal(saved_state[n], base_state[n]) for n in base_state)
    # Reloaded under ZeRO-3: partitioned, holding the saved tensors; generate gathers the scorers.
    for loader in ("hf_neural_attn", "auto"):
        assert results[f"{loader}_partitioned"] and results[f"{loader}_equal"], loader
    if not case["only_new"]:  # the trained base, unpatched
        unpatched = hf_neural_attn.unpatch_model(hf_neural_attn.from_pretrained(case_dir / "trained"))
        with torch.no_grad():
            expected_logits = unpatched(batches()[0]).logits
    else:
        expected_logits = base_logits
    torch.testing.assert_close(torch.tensor(results["unpatched_logits"]), expected_logits, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        expected = saved.generate(batches()[0][:1, :6], max_new_tokens=5, do_sample=False)
    assert results["generated"] == expected.tolist()


@pytest.mark.parametrize("name", list(CASES))
def test_zero3_save_adapter_gathers_what_it_saves_and_checks(name, zero3_runs):
    """``save_adapter`` of the ZeRO-3 model (every process calls it, process 0 writes) saves the whole scorer tensors,
    those of the consolidated checkpoint, and real checksums of the base. Where the scorers alone trained, it warns of
    nothing and the adapter loads onto a fresh base (one process, no DeepSpeed) with the ZeRO-3 model's logits
    (rtol 1e-5, atol 1e-5, as the logits above); where the base trained too, it says so, and loading refuses the
    adapter on the base it was not saved on."""
    from safetensors.torch import load_file

    _, _, root = zero3_runs
    case, case_dir = CASES[name], root / name
    results = json.loads((case_dir / "results.json").read_text())
    assert results["partitioned_at_save"]  # what save_adapter has to gather
    adapter = case_dir / "adapter"
    metadata = json.loads((adapter / "hf_neural_attn_adapter.json").read_text())
    saved = load_file(adapter / "hf_neural_attn_adapter.safetensors")
    consolidated = load_file(case_dir / "trained" / "model.safetensors")
    assert saved and all(torch.equal(tensor, consolidated[tensor_name]) for tensor_name, tensor in saved.items())
    assert metadata["num_parameters"] == sum(tensor.numel() for tensor in saved.values())
    trained_base = [
        message for message in results["adapter_warnings"] if "more than the scorers was trained" in message
    ]
    if case["only_new"]:
        assert trained_base == []
        loaded = hf_neural_attn.from_pretrained(adapter)
        with torch.no_grad():
            logits = loaded(batches()[0]).logits
        torch.testing.assert_close(logits, torch.tensor(results["trained_logits"]), rtol=1e-5, atol=1e-5)
    else:
        assert trained_base
        with pytest.raises(ValueError, match="was saved on base weights other than those of"):
            hf_neural_attn.from_pretrained(adapter)
