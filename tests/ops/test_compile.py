"""torch.compile with its default backend (inductor, C++ code on the CPU) and ``fullgraph=True`` trains and runs the
eager model: the same logits and gradients at the same seed, attention dropout on, for QANA and Neural Attention, on
every compute path: the reference path, the blockwise path (torch operators, hf_neural_attn/ops/blockwise/custom_ops.py)
and the generic chunked path (checkpointed blocks, hf_neural_attn/ops/chunked.py), with ``impl="auto"`` below and
above the scorer's threshold and with ``impl="chunked"``, on GPT-2 and Llama (grouped-query attention), and on
padded Llama and BERT batches.

Inductor runs with ``fallback_random=True``: the dropout seed is drawn inside the compiled graph
(hf_neural_attn/ops/dropout.py), and only with that flag does the compiled graph draw it from torch's generator as
eager code does. Each process compiles several cases, as compiling loads inductor, whose state the rest of the
suite should not share. Residual and embedding dropout are off. Tolerance 1e-5 on logits and on gradients (times
the largest gradient): compiled kernels reorder sums.

The thread-count test runs its cases in processes of their own thread count (the one-thread case alone, as
``accelerate launch`` runs one thread per process; the two-thread case first in the fullgraph test's process): a crash
(an earlier dropout hash relied on int32 wrap-around, which compiled C++ treats as undefined and which crashed
one-thread processes) fails the test instead of the suite.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from helpers.installed import needs_triton

pytestmark = [pytest.mark.spawns, pytest.mark.compiles]

# Builds a one-layer GPT-2, Llama or BERT (4 query heads; Llama's on 2 kv heads) from its config, patches it and moves
# every scorer parameter off its init (live scorers); compares a step of torch.compile(model, fullgraph=True) with
# the eager one. The loss is taken outside the model: transformers' loss function logs a warning, a graph break.
CASES = r"""
import torch
import torch._inductor.config
import transformers as tf
import hf_neural_attn
from hf_neural_attn.ops import dispatch
from hf_neural_attn.scorers import Scorer

torch._inductor.config.fallback_random = True  # compiled graphs draw the dropout seeds eager code draws


def build(family, scorer, impl, n, dropout, base="sdpa"):
    torch.manual_seed(0)
    if family == "llama":
        config = tf.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=n,
                                attention_dropout=dropout, attn_implementation=base)
        model = tf.LlamaForCausalLM(config)
    elif family == "gpt2":
        config = tf.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=4, n_positions=n, attn_pdrop=dropout,
                               resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=0, eos_token_id=1,
                               attn_implementation=base)
        model = tf.GPT2LMHeadModel(config)
    else:  # an encoder: full attention
        config = tf.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                               intermediate_size=64, max_position_embeddings=n, hidden_dropout_prob=0.0,
                               attention_probs_dropout_prob=dropout, pad_token_id=1, attn_implementation=base)
        model = tf.BertForMaskedLM(config)
    options = {"depth": 2} if scorer == "neural-deep" else {}  # no fused form: the generic chunked path
    hf_neural_attn.patch_model(model, scorer.removesuffix("-deep"), h=4, impl=impl, **options)
    with torch.no_grad():
        for parameter in hf_neural_attn.scorer_parameters(model).values():
            parameter.normal_(0, 0.3)
    return model


def path_taken(model, impl, inputs):
    scorer = next(module for module in model.modules() if isinstance(module, Scorer))
    batch, n = inputs["input_ids"].shape
    return dispatch.resolve_impl(impl, scorer, device="cpu", dtype=torch.float32, q_len=n, kv_len=n, head_dim=8,
                                 is_causal=True, batch=batch, heads=4)


def step(module, model, inputs, training):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(3)
    if not training:
        with torch.no_grad():
            return module(**inputs).logits, {}
    logits = module(**inputs).logits
    ids = inputs["input_ids"]
    torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
    return logits.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


# checkpointed: the compiled model recomputes its layers in backward (activation checkpointing), the eager one does
# not: the recompute must use the dropout seed the forward drew. padded: the second sequence half padding, on the
# left for decoders (which over an eager base get an additive mask with rows that see no key), on the right for
# BERT (whose eager paths score each sequence against its own keys).
def compiled_equals_eager(family, scorer, impl, n, training, checkpointed=False, padded=False, base="sdpa"):
    torch._dynamo.reset()
    model = build(family, scorer, impl, n, dropout=0.1, base=base).train(training)
    inputs = {"input_ids": torch.randint(0, 64, (2, n), generator=torch.Generator().manual_seed(1))}
    if family != "bert":
        inputs["use_cache"] = False
    if padded:
        inputs["attention_mask"] = torch.ones(2, n, dtype=torch.long)
        inputs["attention_mask"][1, slice(n // 2, None) if family == "bert" else slice(None, n // 2)] = 0
    eager_logits, eager_grads = step(model, model, inputs, training)
    if checkpointed:
        model.activation_checkpointing_enable()
    compiled_logits, compiled_grads = step(torch.compile(model, fullgraph=True), model, inputs, training)
    torch.testing.assert_close(compiled_logits, eager_logits, rtol=0, atol=1e-5)
    assert compiled_grads.keys() == eager_grads.keys()
    if training:
        assert any(".attn_scorer." in name for name in eager_grads), "no gradient reached the scorer"
        scale = max(grad.abs().max().item() for grad in eager_grads.values())
        for name, grad in eager_grads.items():
            torch.testing.assert_close(compiled_grads[name], grad, rtol=0, atol=1e-5 * scale, msg=name)
        # The dropout really ran: another seed gives other logits.
        torch.manual_seed(4)
        assert not torch.allclose(model(**inputs).logits, eager_logits, atol=1e-3)
    mode = ("train, checkpointed" if checkpointed else "train") if training else "eval"
    mode += f", {base} base padded" if padded else ""
    print(f"{family} {scorer} {impl} {mode} n={n} path={path_taken(model, impl, inputs)}: compiled = eager")
"""

# GPT-2 trained with ``scorer`` (sys.argv[1]) at each of ``lengths`` (sys.argv[2], comma-separated), impl="auto".
THREADS_SCRIPT = (
    CASES
    + r"""
import sys
scorer, lengths = sys.argv[1], [int(n) for n in sys.argv[2].split(",")]
for n in lengths:
    compiled_equals_eager("gpt2", scorer, "auto", n, training=True)
"""
)


def run_script(script: str, *args: str, threads: int = 2, interpret: bool = False) -> list[str]:
    """Run ``script`` in a fresh process with ``threads`` threads (and, with ``interpret``, Triton's CPU interpreter);
    the lines it printed for its cases."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    result = subprocess.run(
        [sys.executable, "-c", script, *args], env=env, capture_output=True, text=True, timeout=900, check=False
    )
    assert result.returncode == 0, f"rc {result.returncode}\n{result.stdout}\n{result.stderr[-4000:]}"
    return [line for line in result.stdout.splitlines() if line.endswith((": compiled = eager", ": no graph break"))]


# Above the thresholds (see NO_BREAK_CASES): several of the blockwise path's 64-query blocks, with a last partial one.
# The 2-thread case runs first in the process of the fullgraph test (two_thread_lines): one start of Python and of
# inductor for both.
THREAD_CASES = [(1, "qana", "16,160"), (2, "neural", "8,288")]


@pytest.mark.parametrize("threads,scorer,lengths", THREAD_CASES)
def test_compiled_training_with_attention_dropout_is_the_eager_model(threads, scorer, lengths, request):
    """GPT-2, ``impl="auto"``: the reference path below the threshold, the blockwise operators above it."""
    short, long = lengths.split(",")
    if threads == 1:
        lines = run_script(THREADS_SCRIPT, scorer, lengths, threads=1)
    else:
        lines = request.getfixturevalue("two_thread_lines")
    assert [line for line in lines if line.startswith(f"gpt2 {scorer} auto train") and "compiled" in line] == [
        f"gpt2 {scorer} auto train n={short} path=reference: compiled = eager",
        f"gpt2 {scorer} auto train n={long} path=blockwise: compiled = eager",
    ]


# (scorer, impl, tokens, the path it takes) for the graph-break check: batch 2 x 4 heads x n x n x h=4 scores is
# above QANA's threshold from n=129 on and above Neural Attention's from n=257 on.
NO_BREAK_CASES = [
    ("qana", "auto", 160, "blockwise"),
    ("neural", "auto", 288, "blockwise"),
    ("neural", "auto", 8, "reference"),
    ("qana", "chunked", 8, "blockwise"),
    ("neural", "chunked", 8, "blockwise"),
    ("neural-deep", "chunked", 40, "chunked"),
]

# After THREADS_SCRIPT's cases (sys.argv[1:3]), the fullgraph and graph-break cases (sys.argv[3]: NO_BREAK_CASES).
FULLGRAPH_SCRIPT = (
    THREADS_SCRIPT
    + r"""
import ast
from hf_neural_attn.ops import chunked

# The generic chunked path in blocks of 16 queries: its 24 and 40 tokens span several blocks, whose loop is
# compiled as a long sequence's is.
chunked.QUERY_BLOCK = 16
# Batch 2 x 4 heads x 256 x 256 x h=4 scores is above QANA's threshold: impl="auto" runs the blockwise path.
compiled_equals_eager("llama", "qana", "auto", 256, training=False)
compiled_equals_eager("llama", "neural", "chunked", 24, training=True, checkpointed=True)
compiled_equals_eager("gpt2", "neural-deep", "chunked", 24, training=True)
# Padded batches, whose eager paths read the mask's values to split the batch or find rows that see no key.
compiled_equals_eager("llama", "qana", "chunked", 16, training=False, padded=True, base="eager")
compiled_equals_eager("bert", "neural", "chunked", 16, training=False, padded=True)

# Without fullgraph, no graph break either (Dynamo alone: explain compiles nothing): train mode, dropout on.
for family in ("llama", "gpt2"):
    for scorer, impl, n, _ in ast.literal_eval(sys.argv[3]):
        torch._dynamo.reset()
        model = build(family, scorer, impl, n, dropout=0.1).train()
        inputs = {"input_ids": torch.randint(0, 64, (2, n))}
        explanation = torch._dynamo.explain(model)(**inputs)
        assert explanation.graph_break_count == 0, (family, scorer, impl, explanation.break_reasons)
        print(f"{family} {scorer} {impl} train n={n} path={path_taken(model, impl, inputs)}: no graph break")
"""
)


# The fused Triton kernels in Triton's CPU interpreter (set for the whole process, before triton is imported), in
# 4 x 4 forward and 8 x 4 backward tiles so that the short sequences span several tiles: inductor's compiled graph
# calls the kernels' operators (opaque: hf_neural_attn/ops/triton/custom_ops.py), in training with dropout, causal
# and padded, GPT-2 and Llama (grouped-query attention).
TRITON_SCRIPT = (
    CASES
    + r"""
from hf_neural_attn.ops.triton import launch

launch.BLOCK_SIZES, launch.BACKWARD_BLOCK_SIZES = (4, 4), (8, 4)
compiled_equals_eager("gpt2", "qana", "triton", 7, training=True)
compiled_equals_eager("llama", "neural", "triton", 6, training=True, padded=True, base="eager")
"""
)


@needs_triton
def test_compiled_training_on_the_triton_kernels_is_the_eager_model():
    """``torch.compile(model, fullgraph=True)`` (inductor) of a model on ``impl="triton"`` trains as the eager model:
    the same logits and gradients with attention dropout on (GPT-2 causal, QANA; a left-padded Llama over an eager
    base, Neural Attention), and another seed drops other entries."""
    lines = run_script(TRITON_SCRIPT, threads=1, interpret=True)  # one thread, as accelerate launch gives a process
    assert lines == [
        "gpt2 qana triton train n=7 path=triton: compiled = eager",
        "llama neural triton train, eager base padded n=6 path=triton: compiled = eager",
    ]


@pytest.fixture(scope="module")
def two_thread_lines() -> list[str]:
    """The lines of one 2-thread process: THREAD_CASES' 2-thread case, then FULLGRAPH_SCRIPT's own."""
    _, scorer, lengths = next(case for case in THREAD_CASES if case[0] == 2)
    return run_script(FULLGRAPH_SCRIPT, scorer, lengths, repr(NO_BREAK_CASES), threads=2)


def test_fullgraph_on_every_path_and_no_graph_break(two_thread_lines):
    """Llama above QANA's threshold in eval mode (the blockwise operators), ``impl="chunked"`` in training with
    dropout (the blockwise path under activation checkpointing, and the generic chunked path) and on padded batches
    (a left-padded Llama over an eager base, a right-padded BERT) compile with ``fullgraph=True`` and give the eager
    model; and Dynamo finds no graph break on any path of either family, below and above the thresholds."""
    assert two_thread_lines[2:] == [
        "llama qana auto eval n=256 path=blockwise: compiled = eager",
        "llama neural chunked train, checkpointed n=24 path=blockwise: compiled = eager",
        "gpt2 neural-deep chunked train n=24 path=chunked: compiled = eager",
        "llama qana chunked eval, eager base padded n=16 path=blockwise: compiled = eager",
        "bert neural chunked eval, sdpa base padded n=16 path=blockwise: compiled = eager",
        *(
            f"{family} {scorer} {impl} train n={n} path={path}: no graph break"
            for family in ("llama", "gpt2")
            for scorer, impl, n, path in NO_BREAK_CASES
        ),
    ]
