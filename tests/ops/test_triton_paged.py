"""The paged kernel (``ops/triton/paged.py``) computes, for each request of a serving step, what the reference path
computes on that request's own contiguous keys.

Each case builds a synthetic paged cache from per-request contiguous keys and values: the blocks in a shuffled order
from a pool larger than needed, some blocks shared between two requests (prefix caching: the same keys, one copy),
every slot no request owns (the ends of last blocks, spare blocks, the block table's padding) filled with NaN, so a
key read from the wrong place or past a request's end shows in the output. The step's queries are the requests' last
keys end to end; the expected output of each request is ``reference_attention`` with a scorer far from init, causal,
on its contiguous keys. The kernel runs in Triton's CPU interpreter with 4 x 4 tiles (the ``interpreter`` fixture),
so block sizes of 3, 5 and 6 put block boundaries inside key tiles, and prefill chunks span several query tiles.

Caches in both layouts the vLLM plugin sees (``integrations/vllm/paged.py``'s ``block_views``): the GPU backends'
(2, blocks, block_size, kv_heads, head_dim) and vLLM's CPU one, (blocks, kv_heads, block_size, 2 * head_dim) seen
through a transposed view. Tolerance: fp32 within 1e-5 (the two paths sum the same terms in different orders).
"""

from pathlib import Path

import pytest
import torch
from helpers.installed import needs_triton
from helpers.processes import compile_kernels_for_gpu
from helpers.scorers import random_fused_scorer

from hf_neural_attn.ops import triton as ops_triton
from hf_neural_attn.ops.reference import reference_attention

HIDDEN, D = 6, 6  # D = 6 is not a power of two: the kernel pads it to 8 and masks the padding
SCALING = D**-0.5
TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}


def paged_cache(pool: int, block_size: int, kv_heads: int, width: int, layout: str) -> tuple[torch.Tensor, ...]:
    """Key and value blocks (pool, block_size, kv_heads, width) in ``layout`` ("gpu": two halves of one contiguous
    tensor; "cpu": vLLM's CPU cache through block_views' transposed view), every entry NaN."""
    if layout == "gpu":
        cache = torch.full((2, pool, block_size, kv_heads, width), float("nan"))
        return cache[0], cache[1]
    cache = torch.full((pool, kv_heads, block_size, 2 * width), float("nan"))
    halves = cache.view(pool, kv_heads, 2 * block_size, width).chunk(2, dim=2)
    return tuple(half.transpose(1, 2) for half in halves)


def block_tables(lengths: list[int], block_size: int, shared: tuple[int, int, int] | None, generator):
    """Each request's block ids (a shuffled pool, 3 spare blocks) and the pool's size. ``shared`` = (owner, user,
    n): the user's first n blocks are the owner's."""
    counts = [-(-length // block_size) for length in lengths]
    pool = sum(counts) - (shared[2] if shared else 0) + 3
    free = iter(torch.randperm(pool, generator=generator).tolist())
    tables = []
    for request, count in enumerate(counts):
        reused = tables[shared[0]][: shared[2]] if shared and request == shared[1] else []
        tables.append(reused + [next(free) for _ in range(count - len(reused))])
    return tables, pool, next(free)  # a spare block (all NaN) pads the table


def write_paged(blocks: torch.Tensor, table: list[int], rows: torch.Tensor) -> None:
    """Writes a request's rows (kv_heads, length, width) to its blocks in order."""
    block_size, length = blocks.shape[1], rows.shape[1]
    positions = torch.arange(length)
    ids = torch.tensor(table)[positions // block_size]
    blocks[ids, positions % block_size] = rows.transpose(0, 1)


@torch.no_grad()
def paged_step(scorer, heads, kv_heads, requests, block_size, layout, shared=None, seed=0):
    """A step over a synthetic paged cache, and each request's reference output.

    ``requests``: (number of keys, number of queries) per request. The shared requests (see :func:`block_tables`)
    get the same keys and values over the shared blocks. Returns the paged call's arguments and the expected output
    (1, heads, tokens, D)."""
    generator = torch.Generator().manual_seed(seed)
    tables, pool, pad = block_tables([length for length, _ in requests], block_size, shared, generator)
    key_blocks, value_blocks = paged_cache(pool, block_size, kv_heads, D, layout)
    key_side = None
    if scorer.name == "neural":
        key_side = paged_cache(pool, block_size, kv_heads, scorer.config.h, layout)[0]
    queries, hiddens, expected = [], [], []
    contiguous = []
    for request, (length, q_len) in enumerate(requests):
        keys, values = (torch.randn(1, kv_heads, length, D, generator=generator) for _ in range(2))
        if shared and request == shared[1]:
            prefix = shared[2] * block_size
            keys[..., :prefix, :], values[..., :prefix, :] = (t[..., :prefix, :] for t in contiguous[shared[0]])
        contiguous.append((keys, values))
        query = torch.randn(1, heads, q_len, D, generator=generator)
        hidden = torch.randn(1, q_len, HIDDEN, generator=generator)
        extras = scorer.query_extras(hidden, None)
        expected.append(
            reference_attention(
                scorer, query, keys, values, None, scaling=SCALING, dropout=None, extras=extras, is_causal=True
            )[0]
        )
        write_paged(key_blocks, tables[request], keys[0])
        write_paged(value_blocks, tables[request], values[0])
        if key_side is not None:
            write_paged(key_side, tables[request], scorer.fused_inputs(query, keys, None).tensors[1][0])
        queries.append(query)
        hiddens.append(hidden)
    query = torch.cat(queries, dim=2)
    fused = scorer.fused_inputs(query, contiguous[0][0], scorer.query_extras(torch.cat(hiddens, dim=1), None))
    width = max(len(table) for table in tables)
    block_table = torch.tensor([table + [pad] * (width - len(table)) for table in tables], dtype=torch.int32)
    if layout == "cpu":
        block_table = block_table.t().contiguous().t()  # any strides: column-major here
    seq_lens = torch.tensor([length for length, _ in requests], dtype=torch.int32)
    query_start_loc = torch.tensor([0, *torch.tensor([q for _, q in requests]).cumsum(0).tolist()], dtype=torch.int32)
    arguments = (fused, query, key_blocks, value_blocks, block_table, seq_lens, query_start_loc)
    return arguments, key_side, torch.cat(expected, dim=2)


CASES = [
    # scorer, options, (heads, kv_heads), requests as (keys, queries), block_size, layout, shared (owner, user, n)
    pytest.param("qana", {"h": 4}, (2, 1), [(9, 1), (5, 1), (13, 1), (1, 1)], 3, "cpu", (0, 2, 2), id="qana-decode"),
    pytest.param("qana", {"h": 3, "activation": "silu"}, (2, 2), [(11, 6)], 4, "gpu", None, id="qana-prefill-chunk"),
    pytest.param("qana", {"h": 2, "activation": "relu"}, (2, 1), [(7, 7)], 5, "cpu", None, id="qana-whole-prompt"),
    pytest.param(
        "qana", {"h": 4}, (4, 2), [(12, 5), (7, 7), (10, 1), (11, 1)], 5, "cpu", (0, 3, 2), id="qana-mixed-gqa"
    ),
    pytest.param(
        "neural", {"h": 3, "proj_dim": 2}, (4, 2), [(11, 6), (6, 6), (8, 1)], 3, "gpu", (0, 2, 2), id="neural-mixed-gqa"
    ),
    pytest.param(
        "neural",
        {"h": 4, "mode": "replace", "activation": "sigmoid"},
        (2, 1),
        [(13, 1), (9, 4), (6, 6)],
        3,
        "cpu",
        (0, 1, 1),
        id="neural-replace",
    ),
    # The Neural Attention authors' score scale (unscaled replace form) and biased down-projections.
    pytest.param(
        "neural",
        {"h": 2, "mode": "replace", "scale_mlp": False, "proj_dim": 2, "proj_bias": True},
        (2, 2),
        [(10, 2), (7, 7)],
        6,
        "gpu",
        None,
        id="neural-replace-unscaled",
    ),
]


@needs_triton
@pytest.mark.parametrize("name,options,heads,requests,block_size,layout,shared", CASES)
def test_paged_kernel_matches_reference_per_request(
    interpreter, name, options, heads, requests, block_size, layout, shared
):
    scorer = random_fused_scorer(name, *heads, hidden_size=HIDDEN, head_dim=D, **options)
    arguments, key_side, expected = paged_step(scorer, *heads, requests, block_size, layout, shared)
    assert ops_triton.paged_kernel_unsupported_reason(*arguments, key_side_blocks=key_side) is None
    output = ops_triton.paged_fused_attention(*arguments, SCALING, key_side_blocks=key_side)
    assert output.shape == expected.shape
    torch.testing.assert_close(output, expected, **TOLERANCE)


@needs_triton
def test_paged_kernel_says_which_calls_it_cannot_serve(interpreter, monkeypatch):
    scorer = random_fused_scorer("neural", 2, 1, hidden_size=HIDDEN, head_dim=D, h=3)
    arguments, key_side, _ = paged_step(scorer, 2, 1, [(5, 2)], 4, "gpu")
    fused, query, key_blocks, value_blocks, *indices = arguments
    reason = ops_triton.paged_kernel_unsupported_reason

    assert "key_side_blocks" in reason(*arguments)  # the pair MLP reads R from the paged cache
    assert "dtype" in reason(fused, query, key_blocks.double(), value_blocks, *indices, key_side_blocks=key_side)
    assert "(1, heads, tokens, head_dim)" in reason(fused, query.expand(2, -1, -1, -1), *arguments[2:], key_side)
    wide = type(fused)(fused.term, fused.tensors, fused.activation, 17, fused.replace_scaled)
    assert "h=17" in reason(wide, *arguments[1:], key_side_blocks=key_side)
    # The call is checked before any work: a refused call raises, naming the reason.
    with pytest.raises(ValueError, match="key_side_blocks"):
        ops_triton.paged_fused_attention(*arguments, SCALING)
    assert reason(*arguments, key_side_blocks=key_side) is None
    monkeypatch.delenv("TRITON_INTERPRET")  # CPU tensors without the interpreter: the machine is named
    assert "CUDA" in reason(*arguments, key_side_blocks=key_side)


COMPILE_SCRIPT = """
kernel = kernels("paged_kernel").paged_forward_kernel
# (KIND, tiles, warps): a decoding step's 16-row tile for the query network, prefill tiles for both pair-MLP forms.
for kind, (block_m, block_n, warps) in ((0, (16, 64, 4)), (1, (64, 32, 8)), (2, (64, 32, 4))):
    constexprs = dict(KIND=kind, ACT=0, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=64, HID_PAD=4, PRECISION="tf32")
    compile_sm90(kernel, constexprs, warps)
    print(kind, "compiled")
"""


@pytest.mark.compiles
@pytest.mark.spawns
@needs_triton
def test_paged_kernel_compiles_for_a_gpu_without_one(tmp_path):
    """The interpreter runs the kernel as Python; the GPU compiler is stricter (tile shapes, loop-carried types, the
    early exit). Compiling for sm_90 needs no GPU: Triton ships the compiler and ptxas."""
    output = compile_kernels_for_gpu(COMPILE_SCRIPT, Path(ops_triton.__file__).parent.parent, tmp_path)
    assert output.count("compiled") == 3
