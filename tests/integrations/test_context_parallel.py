"""Context and sequence parallelism on 2 CPU processes over gloo.

Context parallelism: under torch's ``context_parallel`` (what accelerate's ``cp_size`` runs: accelerate refuses its
``ParallelismConfig`` on CPU processes, so its mask hook, ``_attach_context_parallel_hooks``, is applied here by hand)
each process holds a slice of the sequence, and a patched model's logits at its positions and the gradients summed
over the processes are those of one process holding the whole sequence: torch's load-balanced split (32 tokens: each
process two chunks of 8) and the contiguous one (30 tokens), every softmax scorer and HEA, an eager base, attention
dropout, a bidirectional encoder. What cannot be made right is refused by name: a padding mask, NSEA, attention maps,
a layer the patch leaves on an eager base, a packed row.

Sequence parallelism (DeepSpeed's Ulysses, accelerate's ``sp_size``): refused by name, at DeepSpeed's registration
(what accelerate calls) and, for a registration that named the model by path, at the first scored call. One launch
checks every case (each launch costs 10-20 s of start-up).
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers.models import BERT_COMMON, TINY_DECODER, save_live_patched
from helpers.processes import launch_processes

import hf_neural_attn

pytestmark = [pytest.mark.spawns]

if not dist.is_available():
    pytest.skip("this torch has no torch.distributed", allow_module_level=True)
pytest.importorskip("torch.distributed.tensor.experimental", reason="this torch has no context_parallel")

WORLD, BATCH = 2, 2
TOL = {"rtol": 1e-5, "atol": 1e-5}
GRAD_TOL = {"rtol": 1e-4, "atol": 1e-6}  # two processes sum the keys' gradient contributions in another order


class Case(NamedTuple):
    kind: str  # "llama", or "bert": a bidirectional encoder
    scorer: str
    options: dict
    config: dict  # the base config's overrides
    seq: int  # 32 splits load-balanced over 2 processes (chunks of 8); 30 does not divide by 4: contiguous
    how: str  # "torch": torch's context_parallel alone; "accelerate": with accelerate's mask hook as cp_size adds it
    impl: str = "auto"  # the processes' compute path (one process runs "auto": the reference path at these sizes)


CASES = {
    "qana": Case("llama", "qana", {"h": 2}, {}, 32, "torch"),
    "qana-accelerate": Case("llama", "qana", {"h": 2}, {}, 32, "accelerate"),
    "qana-contiguous": Case("llama", "qana", {"h": 2}, {}, 30, "torch"),
    "neural": Case("llama", "neural", {"h": 2}, {}, 32, "torch"),
    "additive": Case("llama", "additive", {"h": 2}, {}, 32, "accelerate"),
    "general-eager": Case("llama", "general", {}, {"attn_implementation": "eager"}, 32, "torch"),
    "hea": Case("llama", "hea", {"mode": "replace"}, {}, 32, "torch"),
    # The blockwise path under dropout: its operator carries the rows' place in the sequence.
    "neural-dropout": Case("llama", "neural", {"h": 2}, {"attention_dropout": 0.3}, 32, "torch", impl="chunked"),
    "qana-bert": Case("bert", "qana", {"h": 2}, {}, 32, "torch"),
}
DROPOUT_SEED = 7


def tokens(seq: int) -> torch.Tensor:
    return torch.randint(0, TINY_DECODER["vocab_size"], (BATCH, seq), generator=torch.Generator().manual_seed(2))


def next_token_labels(ids: torch.Tensor) -> torch.Tensor:
    """Labels already shifted (each position's next token), so that a slice of the sequence holds its own: the
    model's own loss shifts within what it is given."""
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = ids[:, 1:]
    return labels


def loss_of(kind: str, output, labels: torch.Tensor, total: int) -> torch.Tensor:
    """The summed loss of the positions given, over ``total`` positions: a slice's share of the whole's mean."""
    if kind == "bert":
        return output.last_hidden_state.square().sum() / total
    logits = output.logits
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum") / total


def build(kind: str, config: dict):
    from transformers import BertConfig, BertModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if kind == "bert":
        return BertModel(BertConfig(**BERT_COMMON, **config))
    return LlamaForCausalLM(LlamaConfig(**TINY_DECODER, **config))


def save_cases(root: Path) -> dict[str, Path]:
    return {
        name: save_live_patched(build(case.kind, case.config), root / name, case.scorer, **case.options)
        for name, case in CASES.items()
    }


def one_process(path: Path, name: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The whole sequence in one process: the output (logits, or an encoder's hidden states) and every gradient."""
    kind, config, seq = CASES[name].kind, CASES[name].config, CASES[name].seq
    model = hf_neural_attn.from_pretrained(path)
    ids = tokens(seq)
    labels = next_token_labels(ids)
    if "attention_dropout" in config:
        model.train()
        torch.manual_seed(DROPOUT_SEED)
    output = model(ids)
    loss_of(kind, output, labels, int((labels != -100).sum()) if kind != "bert" else ids.numel()).backward()
    value = output.last_hidden_state if kind == "bert" else output.logits
    return value.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _run_case(path: str, name: str, mesh) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One case on this process's slice: the whole output reassembled from every process's slice, and the
    gradients summed over the processes."""
    from accelerate.big_modeling import _attach_context_parallel_hooks
    from torch.distributed.tensor.experimental import context_parallel

    kind, config, seq = CASES[name].kind, CASES[name].config, CASES[name].seq
    model = hf_neural_attn.from_pretrained(path, impl=CASES[name].impl)
    if CASES[name].how == "accelerate":
        _attach_context_parallel_hooks(model)
    ids = tokens(seq)
    labels = next_token_labels(ids)
    total = int((labels != -100).sum()) if kind != "bert" else ids.numel()
    positions = torch.arange(seq).expand(BATCH, seq).clone()
    if "attention_dropout" in config:
        model.train()
        torch.manual_seed(DROPOUT_SEED)
    buffers = [ids, positions, labels]
    with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[1, 1, 1], no_restore_buffers=set(buffers)):
        output = model(ids, position_ids=positions)
        loss_of(kind, output, labels, total).backward()
    local = (output.last_hidden_state if kind == "bert" else output.logits).detach()
    slices = [torch.empty_like(local) for _ in range(WORLD)]
    dist.all_gather(slices, local.contiguous())
    places = [torch.empty_like(positions) for _ in range(WORLD)]
    dist.all_gather(places, positions)
    whole = local.new_empty(BATCH, seq, local.shape[-1])
    for part, place in zip(slices, places, strict=True):
        whole[:, place[0]] = part
    grads = {}
    for parameter_name, parameter in model.named_parameters():
        if parameter.grad is not None:
            dist.all_reduce(parameter.grad)
            grads[parameter_name] = parameter.grad
    return whole, grads


def _refusals(paths: dict[str, str], mesh) -> dict[str, str | None]:
    """What each refused form says (None: it ran)."""
    from torch.distributed.tensor.experimental import context_parallel

    def attempt(path: str, scorer_layers=None, **call) -> str | None:
        model = hf_neural_attn.from_pretrained(path, **(scorer_layers or {}))
        ids = tokens(32)
        positions = torch.arange(32).expand(BATCH, 32).clone()
        buffers = [ids, positions]
        mask = call.pop("attention_mask", None)
        if mask is not None:
            buffers.append(mask)
        try:
            with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[1] * len(buffers)):
                model(ids, position_ids=positions, attention_mask=mask, **call)
        except ValueError as error:
            return str(error)
        return None

    padding = torch.ones(BATCH, 32, dtype=torch.long)
    padding[0, :5] = 0
    return {
        "padding": attempt(paths["qana"], attention_mask=padding),
        "maps": attempt(paths["qana"], output_attentions=True),
        "nsea": attempt(paths["nsea"]),
        "unscored-eager": attempt(paths["qana-layer0"], {"attn_implementation": "eager"}),
        # A packed row (two sequences of 16) whose bounds are the whole row's, not a process's slice.
        "packed": attempt(
            paths["qana"], cu_seq_lens_q=torch.tensor([0, 16, 32]), cu_seq_lens_k=torch.tensor([0, 16, 32])
        ),
    }


def _sequence_parallel(path: str) -> dict:
    """DeepSpeed's Ulysses registration (what accelerate's sp_size calls) on a patched model, then a registration
    that named the model by path (DeepSpeed then sets its groups up for any model) followed by a patched forward."""
    try:
        import deepspeed
        from deepspeed.runtime.sequence_parallel import parallel_state_sp
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    except ImportError:  # the test says so
        return None

    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)  # DeepSpeed's view of the processes
    model = hf_neural_attn.from_pretrained(path)
    found: dict = {}
    try:
        UlyssesSPAttentionHF.register_with_transformers(
            model_name_or_path=model, core_attn_implementation="sdpa", sequence_parallel_size=WORLD, micro_batch_size=1
        )
        found["registration"] = None
    except ValueError as error:
        found["registration"] = str(error)
    found["groups set up"] = parallel_state_sp._SEQUENCE_PARALLEL_GROUP is not None
    if not found["groups set up"]:
        parallel_state_sp.initialize_sequence_parallel(sequence_parallel_size=WORLD)
    try:
        model(tokens(16))
        found["forward"] = None
    except ValueError as error:
        found["forward"] = str(error)
    return found


def _worker(rank: int, root: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("cp",))
    results = {name: _run_case(f"{root}/{name}", name, mesh) for name in CASES}
    paths = {name: f"{root}/{name}" for name in ("qana", "nsea", "qana-layer0")}
    results["refusals"] = _refusals(paths, mesh)
    results["sequence parallel"] = _sequence_parallel(f"{root}/qana")
    return results


@pytest.fixture(scope="module")
def context_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("context_parallel")
    paths = save_cases(root)
    save_live_patched(build("bert", {}), root / "nsea", "nsea", mode="replace")
    save_live_patched(build("llama", {}), root / "qana-layer0", "qana", h=2, layers=[0])
    return paths, launch_processes(_worker, root, WORLD)


@pytest.mark.parametrize("name", list(CASES))
def test_each_process_scores_its_queries_against_every_key(context_run, name):
    paths, results = context_run
    output, grads = results[name]
    expected_output, expected_grads = one_process(paths[name], name)
    torch.testing.assert_close(output, expected_output, **TOL)
    assert set(grads) == set(expected_grads)
    for parameter_name, grad in expected_grads.items():
        torch.testing.assert_close(grads[parameter_name], grad, **GRAD_TOL, msg=lambda m, n=parameter_name: f"{n}: {m}")


@pytest.mark.parametrize(
    "form, words",
    [
        ("padding", "padding"),
        ("maps", "attention probabilities"),
        ("nsea", "depends on every query"),
        ("unscored-eager", "'eager' base"),
        ("packed", "packed call"),
    ],
)
def test_what_cannot_be_split_is_refused_by_name(context_run, form, words):
    _, results = context_run
    message = results["refusals"][form]
    assert message is not None, f"{form} ran under context parallelism"
    assert "hf_neural_attn" in message and "context parallelism" in message and words in message


def test_ulysses_sequence_parallelism_is_refused_by_name_with_what_to_use_instead(context_run):
    _, results = context_run
    found = results["sequence parallel"]
    if found is None:
        pytest.skip("Ulysses needs DeepSpeed: pip install 'hf-neural-attn[deepspeed]'")
    for where in ("registration", "forward"):
        message = found[where]
        assert message is not None, f"Ulysses went on at the {where}"
        assert "hf_neural_attn does not support DeepSpeed's Ulysses" in message and "cp_size" in message
    assert not found["groups set up"]  # refused before DeepSpeed set anything up
