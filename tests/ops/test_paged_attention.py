"""A serving engine's steps over a paged cache (``hf_neural_attn/paged_attention.py``, what the vLLM plugin calls)
give each request what one ordinary causal call of its whole sequence gives, on the torch paths (the keys gathered
back, decoding requests as one padded batch) and on the paged kernel (Triton's CPU interpreter).

The engine is simulated: three requests of a tiny patched Llama's layer 0 (4 heads on 2 kv heads, scorers far from
init), their tokens scheduled over four steps as vLLM schedules them: a prompt prefilled in two chunks, a decoding
request between two prefills in one step, steps of decodes in changing order, a finished request leaving. Each request
owns shuffled blocks of 4 slots from a larger pool in vLLM's CPU layout (a transposed view); every slot nobody wrote is
NaN, so a key read from the wrong place shows. fp32, within 1e-5.
"""

import pytest
import torch
from helpers.installed import needs_triton
from helpers.models import perturb_scorers, tiny_llama

import hf_neural_attn
from hf_neural_attn import attention
from hf_neural_attn.ops.dispatch import resolve_paged_impl
from hf_neural_attn.paged_attention import KEY_SIDE_ATTR, PagedStep, paged_scored_attention
from hf_neural_attn.record import EXTRAS_KWARG, SCORER_ATTR

BLOCK = 4
LENGTHS = [6, 11, 8]  # each request's whole sequence: prompt and decoded tokens
# Steps: (request, new tokens) in the order the step lays them out.
SCHEDULE = [
    [(0, 5), (1, 6)],  # request 0's prompt, request 1's first chunk
    [(1, 5), (0, 1), (2, 7)],  # request 1's second chunk, request 0 decoding between two prefills, request 2's prompt
    [(2, 1)],  # one decode alone (requests 0 and 1 have finished)
]


def _sequences(module, scorer, generator, device):
    """Per request: queries (heads, T, d), keys and values (kv_heads, T, d), hidden states (T, hidden)."""
    heads, kv_heads, d = module.config.num_attention_heads, module.config.num_key_value_heads, module.head_dim
    shapes = [(heads, d), (kv_heads, d), (kv_heads, d)]
    return [
        (
            *(torch.randn(rows, length, width, generator=generator).to(device) for rows, width in shapes),
            torch.randn(length, module.config.hidden_size, generator=generator).to(device),
        )
        for length in LENGTHS
    ]


def _expected(module, scorer, sequence):
    """One ordinary causal call of a request's whole sequence: (T, heads, d)."""
    query, key, value, hidden = sequence
    extras = scorer.query_extras(hidden[None], None) if scorer.needs_hidden_states else None
    output, _ = attention._attention(
        module, query[None], key[None], value[None], None, None, 0.0, extras, True, {}, context_shards=None
    )
    return output[0]


def _serve(module, scorer, sequences, schedule):
    """Runs the schedule on a paged cache; returns each request's outputs per position (T, heads, d)."""
    kv_heads, d = module.config.num_key_value_heads, module.head_dim
    device = sequences[0][0].device
    generator = torch.Generator().manual_seed(1)
    counts = [-(-length // BLOCK) for length in LENGTHS]
    pool = sum(counts) + 3
    free = iter(torch.randperm(pool, generator=generator).tolist())
    tables = [[next(free) for _ in range(count)] for count in counts]
    cache = torch.full((pool, kv_heads, 2 * BLOCK, d), float("nan"), device=device)  # vLLM's CPU layout
    key_blocks, value_blocks = (half.transpose(1, 2) for half in cache.view(pool, kv_heads, 2 * BLOCK, d).chunk(2, 2))
    done = [0] * len(LENGTHS)
    outputs = [torch.full((length, *sequences[0][0].shape[::2]), float("nan"), device=device) for length in LENGTHS]
    for step in schedule:
        spans = [(request, done[request], done[request] + count) for request, count in step]
        take = lambda part, axis: torch.cat([sequences[r][part].narrow(axis, a, b - a) for r, a, b in spans], axis)  # noqa: E731
        query, key, value, hidden = take(0, 1)[None], take(1, 1)[None], take(2, 1)[None], take(3, 0)[None]
        slots = torch.tensor([tables[r][p // BLOCK] * BLOCK + p % BLOCK for r, a, b in spans for p in range(a, b)])
        table = torch.tensor([tables[r] + [pool - 1] * (max(counts) - len(tables[r])) for r, _, _ in spans])
        starts = torch.tensor([0, *torch.tensor([b - a for _, a, b in spans]).cumsum(0).tolist()], dtype=torch.int32)
        lengths = torch.tensor([b for _, _, b in spans], dtype=torch.int32)
        paged = PagedStep.build(
            starts.to(device), lengths.to(device), table.to(device, torch.int32), slots.to(device), block_size=BLOCK
        )
        extras = {EXTRAS_KWARG: scorer.query_extras(hidden, None)} if scorer.needs_hidden_states else {}
        with torch.no_grad():
            output = paged_scored_attention(module, query, key, value, key_blocks, value_blocks, paged, None, **extras)
        row = 0
        for request, first, last in spans:
            outputs[request][first:last] = output[0, row : row + last - first]
            row += last - first
            done[request] = last
    return outputs


SCHEDULES = {
    "prefill chunks, a decode between prefills": SCHEDULE,
    "decodes in changing order": [[(0, 3), (1, 8), (2, 6)], [(2, 1), (0, 1), (1, 1)], [(1, 1), (0, 1)],
                                  [(0, 1), (1, 1), (2, 1)]],
}  # fmt: skip


# Neural Attention on a RoPE model scores the relative input by default (the query-network term, as QANA); with
# pair_input="concat" it is the pair MLP, whose key half R the kernel reads from a paged cache of its own.
SCORERS = {"qana": {}, "neural": {}, "neural concat": {"pair_input": "concat"}}


def _check(scorer_name: str, schedule, device: str = "cpu", **options):
    model = tiny_llama()
    hf_neural_attn.patch_model(model, scorer_name.split()[0], **SCORERS[scorer_name], **options)
    perturb_scorers(model)
    model.to(device)
    module = model.model.layers[0].self_attn
    scorer = getattr(module, SCORER_ATTR)
    sequences = _sequences(module, scorer, torch.Generator().manual_seed(0), device)
    served = _serve(module, scorer, sequences, schedule)
    for request, sequence in enumerate(sequences):
        with torch.no_grad():
            expected = _expected(module, scorer, sequence)
        length = sum(count for step in schedule for r, count in step if r == request)
        torch.testing.assert_close(served[request][:length], expected[:length], rtol=1e-5, atol=1e-5)
    return module


@pytest.mark.parametrize("schedule", SCHEDULES.values(), ids=SCHEDULES.keys())
@pytest.mark.parametrize("scorer_name", SCORERS)
def test_torch_paths_serve_each_request_as_alone(scorer_name, schedule):
    _check(scorer_name, schedule)


@needs_triton
@pytest.mark.parametrize("schedule", SCHEDULES.values(), ids=SCHEDULES.keys())
@pytest.mark.parametrize("scorer_name", SCORERS)
def test_paged_kernel_serves_each_request_as_alone(scorer_name, schedule, interpreter, monkeypatch):
    """impl="triton": the paged kernel (and nothing else: the torch paths are made to fail), the pair MLP's key half
    R kept in its own paged cache."""
    import hf_neural_attn.paged_attention as paged

    monkeypatch.setattr(paged, "decoding_attention", None)
    monkeypatch.setattr(paged, "attention_with_keys", None)
    module = _check(scorer_name, schedule, impl="triton")
    key_side = module.__dict__.get(KEY_SIDE_ATTR)
    assert (key_side is not None) == (scorer_name == "neural concat")


@needs_triton
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on a GPU machine)")
@pytest.mark.parametrize("scorer_name", SCORERS)
def test_paged_kernel_on_cuda(scorer_name, monkeypatch):
    """On CUDA, impl="auto" serves the steps with the paged kernel (the torch paths are made to fail), each request
    as its whole sequence's ordinary call on the fused kernels gives it, fp32 within 1e-5."""
    import hf_neural_attn.paged_attention as paged

    monkeypatch.setattr(paged, "decoding_attention", None)
    monkeypatch.setattr(paged, "attention_with_keys", None)
    for schedule in SCHEDULES.values():
        _check(scorer_name, schedule, device="cuda")


def test_paged_path_choice(monkeypatch):
    """The torch paths on a CPU under impl="auto"; impl="triton" without a GPU or the interpreter is refused by
    name, never served silently on another path; a scorer without a fused form is refused the kernel by name."""
    model = tiny_llama()
    hf_neural_attn.patch_model(model, "qana")
    scorer = getattr(model.model.layers[0].self_attn, SCORER_ATTR)
    assert resolve_paged_impl("auto", scorer, device="cpu") == "torch"
    assert resolve_paged_impl("reference", scorer, device="cpu") == "torch"
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises((ValueError, ImportError), match="triton"):
        resolve_paged_impl("triton", scorer, device="cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    deep = tiny_llama()
    hf_neural_attn.patch_model(deep, "neural", depth=2)
    with pytest.raises((ValueError, ImportError), match="depth=2"):
        resolve_paged_impl("triton", getattr(deep.model.layers[0].self_attn, SCORER_ATTR), device="cpu")
