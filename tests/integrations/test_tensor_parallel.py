"""Tensor parallelism: patched models sharded by head with their base (transformers' ``tp_plan`` and
``DistributedConfig``) on 2 CPU processes over gloo, against the same models in one process.

One launch checks every case (each launch costs 10-20 s of start-up): checkpoints saved patched (every scorer NSEA
aside, which refuses causal models; QANA's ``u_rank`` and ``key_dim``; a Neural Attention with projections and two
hidden layers; attention dropout on; a Phi-3, whose plan keeps the heads whole) loaded through
``hf_neural_attn.from_pretrained``, an Auto class with ``DistributedConfig`` and the model's own class; their logits,
a few SGD steps (one with gradient checkpointing) and the gathered save, which loads on one process; an adapter-only
checkpoint saved and loaded; ``patch_model`` after a tensor-parallel load, and ``unpatch_model``; the plan entries and
shards the scorers get; a scorer that does not declare its layout and heads that do not divide over the processes,
refused with the model unchanged. The tiny Llama has grouped-query attention (4 query heads, 2 key/value heads: one
per process). accelerate's ``ParallelismConfig(tp_size=...)`` refuses CPU processes (it needs GPUs), so it is not run
here.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
from helpers.models import TINY_DECODER, save_live_patched
from helpers.processes import launch_processes

import hf_neural_attn

pytestmark = [pytest.mark.spawns]

if not dist.is_available():
    pytest.skip("this torch has no torch.distributed", allow_module_level=True)

WORLD, STEPS, BATCH, SEQ = 2, 3, 2, 12
PATCH_SEED = 5
LR = 0.1  # SGD: updates linear in the gradients, so two processes differ from one by rounding only
# The sharded forward sums the rowwise projections' halves in another order than one process: rounding. After SGD
# steps that rounding grows with the step (QANA's key_dim model, from scratch, is the most sensitive: ~7e-6 measured).
LOGITS_TOL = {"rtol": 1e-5, "atol": 1e-5}
TRAINED_TOL = {"rtol": 1e-4, "atol": 1e-4}


class Case(NamedTuple):
    scorer: str
    options: dict
    config: dict  # the base config's overrides
    how: str  # how the processes load it: "library", "auto" (an Auto class, DistributedConfig), "class" (its own)
    trains: bool = True  # also trained, saved gathered and reloaded on one process (the loading routes need not be)
    family: str = "llama"  # phi3: transformers' plan keeps its heads whole on every process (qkv gathered)
    impl: str = "auto"  # the processes' compute path (one process runs "auto": the reference path at these sizes)


CHECKPOINTS = {
    "qana": Case("qana", {"h": 2}, {}, "library"),
    "qana-auto": Case("qana", {"h": 2}, {}, "auto", trains=False),
    "qana-own-class": Case("qana", {"h": 2}, {}, "class", trains=False),
    "neural": Case("neural", {"h": 2}, {}, "library"),
    "neural-proj-depth2": Case("neural", {"h": 4, "proj_dim": 4, "depth": 2}, {}, "auto"),
    "qana-u_rank": Case("qana", {"h": 2, "u_rank": 2}, {}, "library"),
    "qana-key_dim": Case("qana", {"h": 2, "key_dim": 4}, {}, "library"),
    "additive": Case("additive", {"h": 2}, {}, "class"),
    "general": Case("general", {}, {}, "library"),
    "hea": Case("hea", {"mode": "replace"}, {}, "class"),
    # The blockwise path under dropout: its operator carries the heads' place in the whole (and one process's
    # reference path drops the same entries).
    "qana-dropout": Case("qana", {"h": 2}, {"attention_dropout": 0.3}, "library", impl="chunked"),
    "neural-phi3": Case("neural", {"h": 2}, {}, "library", family="phi3"),
}
TRAINED = [name for name, case in CHECKPOINTS.items() if case.trains]
CHECKPOINTING = "qana"  # trained with gradient checkpointing: the scorers' shards are read again in the recompute
PATCHED_AFTER_LOAD = ("qana", "neural")


def batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(2)
    return [torch.randint(0, TINY_DECODER["vocab_size"], (BATCH, SEQ), generator=generator) for _ in range(STEPS)]


def train(model, checkpointing: bool = False) -> list[float]:
    """STEPS SGD steps on the whole batch (every process computes the same loss under tensor parallelism)."""
    if checkpointing:  # transformers 5.23 renamed gradient_checkpointing_enable
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step, ids in enumerate(batches()):
        torch.manual_seed(100 + step)  # the attention dropout's seeds, the same on every process and in one
        loss = model(ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    model.eval()
    return losses


def save_checkpoints(root: Path) -> dict[str, Path]:
    """A tiny patched Llama per case, its scorers moved off their init, and the base."""
    from transformers import LlamaConfig, LlamaForCausalLM, Phi3Config, Phi3ForCausalLM

    families = {"llama": (LlamaForCausalLM, LlamaConfig), "phi3": (Phi3ForCausalLM, Phi3Config)}
    paths = {}
    for name, case in CHECKPOINTS.items():
        torch.manual_seed(0)
        model_class, config_class = families[case.family]
        model = model_class(config_class(**TINY_DECODER, **case.config))
        paths[name] = save_live_patched(model, root / name, case.scorer, **case.options)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**TINY_DECODER)).save_pretrained(root / "base")
    uneven = {**TINY_DECODER, "hidden_size": 24, "num_attention_heads": 3, "num_key_value_heads": 3}
    LlamaForCausalLM(LlamaConfig(**uneven)).save_pretrained(root / "uneven")
    return paths


def load_sharded(path, how: str):
    from transformers import AutoModelForCausalLM, LlamaForCausalLM
    from transformers.distributed import DistributedConfig

    if how == "auto":
        return AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(tp_plan="auto"))
    if how == "class":
        return LlamaForCausalLM.from_pretrained(path, tp_plan="auto")
    return hf_neural_attn.from_pretrained(path, tp_plan="auto")


def base_is_sharded(model) -> bool:
    """Whether transformers sharded the base: every attention projection a DTensor."""
    attention = model.model.layers[0].self_attn
    names = ("qkv_proj",) if hasattr(attention, "qkv_proj") else ("q_proj", "k_proj", "v_proj")
    return all(type(getattr(attention, name).weight).__name__ == "DTensor" for name in names)


def scorer_plan(model) -> dict[str, str]:
    return {name: style for name, style in model.tp_plan.items() if ".attn_scorer." in f"{name}."}


def scorer_shards(model) -> dict[str, tuple]:
    """Layer 0's scorer parameters: (class, local shape, placements)."""
    return {
        name: (type(p).__name__, tuple(getattr(p, "_local_tensor", p).shape), str(getattr(p, "placements", "")))
        for name, p in model.named_parameters()
        if name.startswith("model.layers.0.self_attn.attn_scorer.")
    }


def _worker(rank: int, root: str) -> dict:
    from transformers import LlamaForCausalLM

    from hf_neural_attn.scorers import SCORERS, NeuralAttentionConfig, NeuralAttentionScorer

    results: dict = {}
    prompt = batches()[0]
    for name, case in CHECKPOINTS.items():
        model = hf_neural_attn.set_impl(load_sharded(f"{root}/{name}", case.how), case.impl)
        with torch.no_grad():
            results[f"{name}/logits"] = model(prompt).logits
        results[f"{name}/sharded"] = base_is_sharded(model)
        results[f"{name}/plan"] = scorer_plan(model)
        results[f"{name}/shards"] = scorer_shards(model)
        if name == "qana":  # an adapter-only checkpoint: saved gathered, loaded sharded
            hf_neural_attn.save_adapter(model, f"{root}/adapter", base_model_name_or_path=f"{root}/base")
            adapter = hf_neural_attn.from_pretrained(f"{root}/adapter", tp_plan="auto")
            with torch.no_grad():
                results["adapter/logits"] = adapter(prompt).logits
        if case.trains:
            results[f"{name}/losses"] = train(model, checkpointing=name == CHECKPOINTING)
            model.save_pretrained(f"{root}/trained/{name}")  # every process: transformers gathers the shards
    for scorer in PATCHED_AFTER_LOAD:
        model = LlamaForCausalLM.from_pretrained(f"{root}/base", tp_plan="auto")
        torch.manual_seed(PATCH_SEED)
        hf_neural_attn.patch_model(model, scorer, h=2)
        results[f"after/{scorer}/sharded"] = base_is_sharded(model)
        results[f"after/{scorer}/plan"] = scorer_plan(model)
        with torch.no_grad():
            results[f"after/{scorer}/logits"] = model(prompt).logits
        results[f"after/{scorer}/losses"] = train(model)
        model.save_pretrained(f"{root}/trained/after-{scorer}")

    class UndeclaredConfig(NeuralAttentionConfig):
        scorer_name = "undeclared"

    class UndeclaredScorer(NeuralAttentionScorer):
        """Neural Attention, saying nothing of how its parameters relate to the heads."""

        name, config_class = "undeclared", UndeclaredConfig

        def head_layout(self):
            return None

    SCORERS[UndeclaredScorer.name] = UndeclaredScorer
    model = LlamaForCausalLM.from_pretrained(f"{root}/base", tp_plan="auto")
    plan_before = dict(model.tp_plan)
    # unpatch_model takes the scorers and their plan entries out again: the sharded base as it was.
    hf_neural_attn.unpatch_model(hf_neural_attn.patch_model(model, "neural", h=2))
    results["unpatched/plan kept"] = model.tp_plan == plan_before
    with torch.no_grad():
        results["unpatched/logits"] = model(prompt).logits
    results["refused"] = {"undeclared": refusal(model, UndeclaredConfig(h=2))}
    results["refused/unchanged"] = (
        not hf_neural_attn.is_patched(model)
        and not any(".attn_scorer." in name for name, _ in model.named_parameters())
        and model.tp_plan == plan_before
        and model.config._attn_implementation != "hf_neural_attn"
    )
    with torch.no_grad():
        results["refused/logits"] = model(prompt).logits
    # 3 heads over 2 processes: transformers loads it (its shards are uneven), the scorers cannot follow.
    uneven = LlamaForCausalLM.from_pretrained(f"{root}/uneven", tp_plan="auto")
    results["refused"]["uneven heads"] = refusal(uneven, hf_neural_attn.QanaConfig(h=2))
    return results


def refusal(model, config) -> str | None:
    """What patch_model says when it refuses (None: it patched)."""
    try:
        hf_neural_attn.patch_model(model, config)
    except ValueError as error:
        return str(error)
    return None


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("tensor_parallel")
    paths = save_checkpoints(root)
    return root, paths, launch_processes(_worker, root, WORLD)


def assert_same_parameters(saved, model) -> None:
    trained = dict(model.named_parameters())
    for name, tensor in saved.named_parameters():
        torch.testing.assert_close(tensor, trained[name], **TRAINED_TOL, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_a_patched_checkpoint_loads_sharded_with_the_logits_of_one_process(sharded_run, name):
    _, paths, results = sharded_run
    assert results[f"{name}/sharded"], "transformers did not shard the base"
    with torch.no_grad():
        expected = hf_neural_attn.from_pretrained(paths[name])(batches()[0]).logits
    torch.testing.assert_close(results[f"{name}/logits"], expected, **LOGITS_TOL)


def test_an_adapter_saves_gathered_and_loads_sharded(sharded_run):
    root, paths, results = sharded_run
    with torch.no_grad():
        expected = hf_neural_attn.from_pretrained(paths["qana"])(batches()[0]).logits
        saved = hf_neural_attn.from_pretrained(root / "adapter")(batches()[0]).logits  # one process
    torch.testing.assert_close(saved, expected, **LOGITS_TOL)
    torch.testing.assert_close(results["adapter/logits"], expected, **LOGITS_TOL)


@pytest.mark.parametrize("name", TRAINED)
def test_training_steps_and_the_gathered_save_match_one_process(sharded_run, name):
    root, paths, results = sharded_run
    model = hf_neural_attn.from_pretrained(paths[name])
    losses = train(model, checkpointing=name == CHECKPOINTING)
    assert results[f"{name}/losses"] == pytest.approx(losses, rel=1e-5)
    saved = hf_neural_attn.from_pretrained(root / "trained" / name)  # one process, no tensor parallelism
    assert hf_neural_attn.patch_record(saved).scorer == CHECKPOINTS[name].scorer
    with torch.no_grad():
        torch.testing.assert_close(saved(batches()[0]).logits, model(batches()[0]).logits, **TRAINED_TOL)
    assert_same_parameters(saved, model)


@pytest.mark.parametrize("scorer", PATCHED_AFTER_LOAD)
def test_patch_model_after_a_sharded_load_is_the_one_process_patch(sharded_run, scorer):
    from transformers import LlamaForCausalLM

    root, _, results = sharded_run
    assert results[f"after/{scorer}/sharded"] and results[f"after/{scorer}/plan"], "not sharded"
    model = LlamaForCausalLM.from_pretrained(root / "base")
    torch.manual_seed(PATCH_SEED)  # rank 0's init is every process's: the same draw
    hf_neural_attn.patch_model(model, scorer, h=2)
    with torch.no_grad():
        torch.testing.assert_close(results[f"after/{scorer}/logits"], model(batches()[0]).logits, **LOGITS_TOL)
    assert results[f"after/{scorer}/losses"] == pytest.approx(train(model), rel=1e-5)
    saved = hf_neural_attn.from_pretrained(root / "trained" / f"after-{scorer}")
    assert_same_parameters(saved, model)


def test_each_scorer_parameter_gets_the_plan_entry_of_its_layout(sharded_run):
    _, _, results = sharded_run
    prefix = "model.layers.*.self_attn.attn_scorer."
    qana = results["qana/plan"]
    # The widened query is a per-head Linear: "colwise" like q_proj, module and parameters; the gates colwise.
    assert qana == {
        f"{prefix}query_extension.weight": "colwise",
        f"{prefix}query_extension": "colwise",
        f"{prefix}gate": "colwise",
    }
    # A per-head basis (heads, r, d): the library's registered style, which shards the first dimension.
    assert results["qana-u_rank/plan"][f"{prefix}basis"] == "hf_neural_attn_per_head"
    # Neural Attention's MLP is shared by every head: whole on every process, gradients summed; the gates per head.
    neural = results["neural/plan"]
    assert neural.pop(f"{prefix}gate") == "colwise"
    assert neural and set(neural.values()) == {"hf_neural_attn_shared"}
    assert set(results["neural-proj-depth2/plan"].values()) == {"colwise", "hf_neural_attn_shared"}
    assert set(results["additive/plan"].values()) == {"colwise", "hf_neural_attn_per_head"}
    assert results["general/plan"] == {f"{prefix}bilinear": "hf_neural_attn_per_head"}
    # key_dim's narrow query and key projections shard colwise like the ones they replace.
    key_dim_shards = results["qana-key_dim/shards"]
    assert key_dim_shards["model.layers.0.self_attn.attn_scorer.gate"][1] == (2,)
    # Each process holds its 2 of the 4 heads: the gate, and the widened query's rows (h*D + 2h + 1 = 21 per head).
    shards = results["qana/shards"]
    prefix0 = "model.layers.0.self_attn.attn_scorer."
    assert shards[f"{prefix0}gate"] == ("DTensor", (2,), "(Shard(dim=0),)")
    rows = ("DTensor", (2 * 21, TINY_DECODER["hidden_size"]), "(Shard(dim=0),)")
    assert shards[f"{prefix0}query_extension.weight"] == rows
    assert results["qana-u_rank/shards"][f"{prefix0}basis"][:2] == ("DTensor", (2, 2, 8))
    assert results["neural/shards"][f"{prefix0}pair_weight"][0] == "Parameter"  # shared: whole
    # Phi-3's plan gathers its fused qkv projection's output: the heads are whole on every process, so is the scorer.
    assert results["neural-phi3/plan"] == {}
    assert {kind for kind, _, _ in results["neural-phi3/shards"].values()} == {"Parameter"}


def test_unpatch_model_gives_back_the_sharded_base(sharded_run):
    from transformers import LlamaForCausalLM

    root, _, results = sharded_run
    assert results["unpatched/plan kept"]
    with torch.no_grad():
        expected = LlamaForCausalLM.from_pretrained(root / "base")(batches()[0]).logits
    torch.testing.assert_close(results["unpatched/logits"], expected, **LOGITS_TOL)


@pytest.mark.parametrize(
    "refused, words", [("undeclared", "head_layout"), ("uneven heads", "3 query heads and 3 key/value heads")]
)
def test_what_cannot_shard_is_refused_by_name_before_the_model_changes(sharded_run, refused, words):
    message = sharded_run[2]["refused"][refused]
    assert message is not None, f"the {refused} case was patched under tensor parallelism"
    assert "hf_neural_attn" in message and words in message and "The model was not changed" in message


def test_a_refused_model_is_left_as_it_was(sharded_run):
    from transformers import LlamaForCausalLM

    root, _, results = sharded_run
    assert results["refused/unchanged"]
    with torch.no_grad():
        expected = LlamaForCausalLM.from_pretrained(root / "base")(batches()[0]).logits
    torch.testing.assert_close(results["refused/logits"], expected, **LOGITS_TOL)
