"""The fused Triton kernels compute what the reference path computes, and ``impl`` picks the right path.

The kernels run in Triton's CPU interpreter (``TRITON_INTERPRET=1``) on tiny shapes with 4 x 4 tiles
(8 x 4 in backward), so sequence lengths are not tile multiples, causal tiles get skipped, and
grouped-query heads share a key tile. Speed and bf16 need a GPU and are not checked here (the interpreter's bf16 ``tl.dot`` is broken).

Attention dropout runs inside the kernels, from the hash every path shares (``ops/dropout.py``): at one seed the
kernels drop exactly the entries the chunked path drops (outputs and gradients within the tolerance below), on every
mask form, grouped-query heads and causal tiles, for a call that is a part of a larger whole (tensor and context
parallelism's heads and rows), and through whole models (GPT-2 with its default ``attn_pdrop=0.1``, packed batches).

The kernels run as torch operators (``ops/triton/custom_ops.py``): opcheck checks them, and a compiled patched model
keeps them in its graph, without graph breaks (inductor: tests/ops/test_compile.py).

Tolerances: fp32 outputs and gradients within ``atol=1e-5, rtol=1e-5`` of the reference path (the two
sum the same terms in different orders; gradients of the larger parameters reach ~10, where fp32
rounding alone is ~1e-6).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.installed import HAS_TRITON, needs_triton
from helpers.models import model_inputs, packed_attention_call, perturb_scorers, tiny_gpt2, tiny_llama
from helpers.paths import IMPLS, PORTABLE_IMPLS, always_blockwise
from helpers.processes import compile_kernels_for_gpu
from helpers.scorers import FUSED_SCORERS, random_fused_scorer
from torch.utils._pytree import tree_map_only

import hf_neural_attn
from hf_neural_attn.ops import dispatch
from hf_neural_attn.ops import triton as ops_triton
from hf_neural_attn.ops.dispatch import resolve_impl, scored_attention
from hf_neural_attn.ops.dropout import DropoutPlacement
from hf_neural_attn.ops.triton import fused

HIDDEN, D = 6, 6  # D = 6 is not a power of two: the kernels pad it to 8 and mask the padding
TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}


def make_scorer(name, heads, kv_heads, dtype=torch.float32, **options):
    return random_fused_scorer(name, heads, kv_heads, hidden_size=HIDDEN, head_dim=D, dtype=dtype, **options)


def attention_case(heads, kv_heads, q_len, kv_len, mask_kind, dtype=torch.float32, seed=0):
    """Inputs of one call. ``mask_kind``: "causal" (queries aligned to the end of the keys, as with a KV
    cache), "left_padded" (causal, and the second sequence's first 3 keys padded: its first rows see no
    key at all), "padding" (bidirectional, a (batch, 1, 1, kv_len) key-padding mask, -inf where padded),
    or "none"."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(dtype).requires_grad_()

    batch = 2
    hidden = randn(batch, q_len, HIDDEN)
    query, key, value = (
        randn(batch, heads, q_len, D),
        randn(batch, kv_heads, kv_len, D),
        randn(batch, kv_heads, kv_len, D),
    )
    allowed = torch.ones(batch, 1, q_len, kv_len, dtype=torch.bool)
    mask = None
    if mask_kind in ("causal", "left_padded"):
        allowed = allowed & torch.ones(q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len)
        if mask_kind == "left_padded":
            allowed[1, ..., :3] = False
        mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    elif mask_kind == "padding":
        mask = torch.zeros(batch, 1, 1, kv_len, dtype=dtype)
        mask[1, ..., -2:] = float("-inf")  # the reference clamps -inf to the dtype's minimum; so must the kernels
    valid_rows = allowed.any(-1, keepdim=True)  # (batch, 1, q_len, 1)
    return hidden, query, key, value, mask, valid_rows


def run(scorer, impl, hidden, query, key, value, mask, valid_rows, causal):
    """Output and the gradients of hidden states (QANA's query slices come from them), q, k, v and every
    scorer parameter, for an upstream gradient that ignores rows with no allowed key (their output is
    uniform over whichever keys a path visits)."""
    scorer.config.impl = impl
    tensors = [hidden, query, key, value, *scorer.parameters()]
    for tensor in tensors:
        tensor.grad = None
    extras = scorer.query_extras(hidden, None) if scorer.name == "qana" else None
    output, _ = scored_attention(scorer, query, key, value, mask, scaling=D**-0.5, extras=extras, is_causal=causal)
    valid = valid_rows.transpose(1, 2)  # output is (batch, q_len, heads, head_dim)
    weights = torch.linspace(-1, 1, output.numel()).view_as(output).to(output.dtype) * valid
    (output * weights).sum().backward()
    return output.detach() * valid, [t.grad for t in tensors]


CASES = [
    # scorer, options, (heads, kv_heads), q_len, kv_len, mask
    ("qana", {"h": 4}, (2, 1), 7, 7, "causal"),
    ("qana", {"h": 1, "activation": "relu"}, (2, 1), 5, 9, "left_padded"),
    ("qana", {"h": 3, "activation": "tanh"}, (2, 2), 6, 6, "none"),
    ("qana", {"h": 4, "activation": "silu"}, (2, 1), 6, 5, "padding"),
    ("qana", {"h": 2, "activation": "sigmoid"}, (2, 1), 1, 6, "causal"),  # one decoding step against a cache
    ("neural", {"h": 3, "proj_dim": 2}, (2, 1), 7, 7, "left_padded"),
    ("neural", {"h": 4, "mode": "replace", "activation": "sigmoid"}, (2, 1), 5, 9, "causal"),
    ("neural", {"h": 2, "activation": "silu"}, (2, 2), 6, 6, "none"),
    ("neural", {"h": 4, "proj_dim": 3, "activation": "relu"}, (2, 1), 6, 5, "padding"),
    ("neural", {"h": 1, "mode": "replace", "activation": "tanh"}, (2, 1), 5, 5, "left_padded"),
    # The authors' code's score scale and projections (unscaled replace form, biased down-projections), one layer.
    (
        "neural",
        {"h": 3, "proj_dim": 2, "proj_bias": True, "mode": "replace", "scale_mlp": False},
        (2, 1),
        7,
        7,
        "causal",
    ),
]


@needs_triton
@pytest.mark.parametrize("name,options,heads,q_len,kv_len,mask_kind", CASES)
def test_kernels_match_reference_in_fp32(interpreter, triton_calls, name, options, heads, q_len, kv_len, mask_kind):
    scorer = make_scorer(name, *heads, **options)
    case = attention_case(*heads, q_len, kv_len, mask_kind)
    causal = mask_kind in ("causal", "left_padded")
    ref_out, ref_grads = run(scorer, "reference", *case, causal)
    out, grads = run(scorer, "triton", *case, causal)
    assert len(triton_calls) == 1
    torch.testing.assert_close(out, ref_out, **TOLERANCE)
    assert len(grads) == len(ref_grads)
    for index, (grad, ref_grad) in enumerate(zip(grads, ref_grads)):
        assert (grad is None) == (ref_grad is None), index
        if grad is not None:
            assert ref_grad.abs().max() > 0, f"gradient {index} is zero: the case checks nothing"
            torch.testing.assert_close(grad, ref_grad, **TOLERANCE, msg=lambda m, i=index: f"gradient {i}: {m}")


@needs_triton
@pytest.mark.parametrize("name", FUSED_SCORERS)
def test_kernels_in_fp16_stay_close_to_fp32_reference(interpreter, triton_calls, name):
    """fp16 inputs and parameters, fp32 scores and accumulation, against the fp32 reference on the same
    values before rounding. Errors seen: outputs ~1e-3, gradients <= 5e-3 on magnitudes up to 7."""
    options = {"h": 4, "proj_dim": 2} if name == "neural" else {"h": 4}
    ref_out, ref_grads = run(
        make_scorer(name, 2, 1, **options), "reference", *attention_case(2, 1, 7, 7, "left_padded"), True
    )
    half = make_scorer(name, 2, 1, dtype=torch.float16, **options)  # the same parameters, rounded to fp16
    case16 = attention_case(2, 1, 7, 7, "left_padded", dtype=torch.float16)  # the same inputs, rounded
    out, grads = run(half, "triton", *case16, True)
    assert len(triton_calls) == 1 and out.dtype == torch.float16
    torch.testing.assert_close(out.float(), ref_out, rtol=0, atol=5e-3)
    for index, (grad, ref_grad) in enumerate(zip(grads, ref_grads)):
        assert (grad is None) == (ref_grad is None), index
        if grad is not None:
            assert grad.dtype == torch.float16, index
            torch.testing.assert_close(grad.float(), ref_grad, rtol=1e-2, atol=1e-2, msg=lambda m, i=index: f"{i}: {m}")


@needs_triton
@pytest.mark.parametrize("scorer_name", FUSED_SCORERS)
def test_patched_llama_matches_reference(interpreter, triton_calls, scorer_name):
    """A whole model (2 layers, 4 query heads on 2 key/value heads): logits and every parameter's gradient."""
    models = {impl: tiny_llama() for impl in ("reference", "triton")}
    inputs = model_inputs("llama", seq=6)
    results = {}
    for impl, model in models.items():
        hf_neural_attn.patch_model(model, scorer_name, impl=impl)
        perturb_scorers(model)
        model.train()
        out = model(**inputs, labels=inputs["input_ids"])
        out.loss.backward()
        results[impl] = out.logits.detach(), {n: p.grad for n, p in model.named_parameters()}
    assert len(triton_calls) == 2  # one per layer
    (ref_logits, ref_grads), (logits, grads) = results["reference"], results["triton"]
    torch.testing.assert_close(logits, ref_logits, **TOLERANCE)
    for name, ref_grad in ref_grads.items():
        torch.testing.assert_close(grads[name], ref_grad, **TOLERANCE, msg=lambda m, n=name: f"{n}: {m}")


# --- attention dropout in the kernels ---------------------------------------------------------------------

DROPOUT = 0.3


def run_with_dropout(
    scorer, impl, hidden, query, key, value, mask, valid_rows, causal, seed, p=DROPOUT, placement=None
):
    """:func:`run` in training mode with attention dropout ``p``, its seed drawn after ``torch.manual_seed(seed)``
    (or ``placement``'s: a part of a larger attention)."""
    scorer.config.impl = impl
    tensors = [hidden, query, key, value, *scorer.parameters()]
    for tensor in tensors:
        tensor.grad = None
    extras = scorer.query_extras(hidden, None) if scorer.name == "qana" else None
    torch.manual_seed(seed)
    output, _ = scored_attention(
        scorer, query, key, value, mask, scaling=D**-0.5, extras=extras, is_causal=causal, dropout=p, training=True,
        dropout_placement=placement,
    )  # fmt: skip
    valid = valid_rows.transpose(1, 2)
    weights = torch.linspace(-1, 1, output.numel()).view_as(output).to(output.dtype) * valid
    (output * weights).sum().backward()
    return output.detach() * valid, [t.grad for t in tensors]


def assert_same(result, expected):
    (out, grads), (ref_out, ref_grads) = result, expected
    torch.testing.assert_close(out, ref_out, **TOLERANCE)
    for index, (grad, ref_grad) in enumerate(zip(grads, ref_grads, strict=True)):
        assert (grad is None) == (ref_grad is None), index
        if grad is not None:
            torch.testing.assert_close(grad, ref_grad, **TOLERANCE, msg=lambda m, i=index: f"gradient {i}: {m}")


# Every mask form, both terms, grouped-query heads in most: (scorer, options, (heads, kv_heads), q_len, kv_len, mask).
# The 7 x 7 causal case skips tiles above the diagonal in all three kernels (4 x 4 and 8 x 4 tiles).
DROPOUT_CASES = [CASES[0], CASES[1], CASES[2], CASES[4], CASES[5], CASES[6], CASES[8]]


@needs_triton
@pytest.mark.parametrize("name,options,heads,q_len,kv_len,mask_kind", DROPOUT_CASES)
def test_kernels_drop_what_the_chunked_path_drops(interpreter, triton_calls, name, options, heads, q_len, kv_len,
                                                  mask_kind):  # fmt: skip
    """At one seed the kernels give the chunked (blockwise) path's output and every gradient; another seed drops
    other entries."""
    scorer = make_scorer(name, *heads, **options)
    case = attention_case(*heads, q_len, kv_len, mask_kind)
    causal = mask_kind in ("causal", "left_padded")
    expected = run_with_dropout(scorer, "chunked", *case, causal, seed=5)
    assert_same(run_with_dropout(scorer, "triton", *case, causal, seed=5), expected)
    assert len(triton_calls) == 1
    other_seed = run_with_dropout(scorer, "triton", *case, causal, seed=6)[0]
    assert (other_seed - expected[0]).abs().max() > 1e-3


@needs_triton
@pytest.mark.parametrize("p", [0.9, 1.0])
def test_kernels_drop_at_every_probability(interpreter, triton_calls, p):
    """A high probability keeps few entries, each scaled by 10; p = 1 keeps none: the output and the values'
    gradient are zero on both paths (the kernels' threshold is capped to a 32-bit word, their scale set to 0)."""
    scorer = make_scorer("neural", 2, 1, h=3, proj_dim=2)
    case = attention_case(2, 1, 7, 7, "causal")
    expected = run_with_dropout(scorer, "chunked", *case, True, seed=2, p=p)
    result = run_with_dropout(scorer, "triton", *case, True, seed=2, p=p)
    assert_same(result, expected)
    if p == 1.0:
        assert result[0].abs().max() == 0 and result[1][3].abs().max() == 0  # the output, the values' gradient


@needs_triton
@pytest.mark.parametrize("name,options", [("qana", {"h": 2}), ("neural", {"h": 3, "proj_dim": 2})])
def test_kernels_drop_a_part_as_the_whole_drops(interpreter, triton_calls, name, options):
    """A call that is a part of a larger attention (tensor parallelism: heads 2-3 of 6; context parallelism: rows
    from 11 on) drops what the chunked path drops at that place: the kernels' streams and rows are the whole's."""
    scorer = make_scorer(name, 2, 1, **options)
    case = attention_case(2, 1, 5, 9, "causal")
    placement = DropoutPlacement(torch.tensor(1234), head_offset=2, total_heads=6, row_offset=11)
    expected = run_with_dropout(scorer, "chunked", *case, True, seed=0, placement=placement)
    assert_same(run_with_dropout(scorer, "triton", *case, True, seed=0, placement=placement), expected)
    at_start = DropoutPlacement(torch.tensor(1234))
    assert (
        run_with_dropout(scorer, "triton", *case, True, seed=0, placement=at_start)[0] - expected[0]
    ).abs().max() > 1e-3


def train_step(model, inputs, seed):
    """One training forward and backward after ``torch.manual_seed(seed)``: loss, logits and every gradient."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out = model(**inputs, labels=inputs["input_ids"])
    out.loss.backward()
    return out.loss.detach(), out.logits.detach(), {n: p.grad for n, p in model.named_parameters()}


@needs_triton
def test_gpt2_trains_with_its_default_attention_dropout_on_the_kernels(interpreter, triton_calls):
    """A tiny GPT-2 with GPT-2's default ``attn_pdrop=0.1``, in training mode, QANA: ``impl="triton"`` gives
    ``impl="chunked"``'s loss, logits and every gradient at the same torch seed; another seed drops other entries.
    (Neural Attention through a whole model: the packed batch below.)"""
    scorer_name = "qana"
    models = {impl: tiny_gpt2(attn_pdrop=0.1, n_layer=1) for impl in ("chunked", "triton")}
    inputs = model_inputs("gpt2", seq=7)
    results = {}
    for impl, model in models.items():
        hf_neural_attn.patch_model(model, scorer_name, impl=impl)
        perturb_scorers(model)
        results[impl] = train_step(model.train(), inputs, seed=7)
    assert len(triton_calls) == 1
    (ref_loss, ref_logits, ref_grads), (loss, logits, grads) = results["chunked"], results["triton"]
    torch.testing.assert_close(loss, ref_loss, **TOLERANCE)
    torch.testing.assert_close(logits, ref_logits, **TOLERANCE)
    assert any(".attn_scorer." in name and grad is not None for name, grad in grads.items())
    for name, ref_grad in ref_grads.items():
        torch.testing.assert_close(grads[name], ref_grad, **TOLERANCE, msg=lambda m, n=name: f"{n}: {m}")
    other_logits = train_step(models["triton"], inputs, seed=8)[1]
    assert not torch.allclose(other_logits, logits, atol=1e-3)


# --- serving shapes on the kernels -------------------------------------------------------------------------


@needs_triton
@pytest.mark.parametrize("scorer_name", FUSED_SCORERS)
def test_packed_calls_and_decoding_steps_run_on_the_kernels(interpreter, triton_calls, scorer_name):
    """A packed call as continuous batching makes it (no mask; a prefilling request beside decoding ones, one query
    against its cache each) runs every part on the kernels: the decoding requests together (one call, a padded batch
    with a request per row), the prefill alone, and gives the reference path's output within the tolerance."""
    from hf_neural_attn import attention

    model = tiny_llama().eval()
    hf_neural_attn.patch_model(model, scorer_name)
    perturb_scorers(model)
    # Requests 0, 1 and 3 decode one token against caches of 7, 12 and 9 keys; request 2 prefills 3 of its 5.
    module, (query, key, value, kwargs) = packed_attention_call(model, [1, 1, 3, 1], [7, 12, 5, 9])
    outputs = {}
    for impl in ("reference", "triton"):
        hf_neural_attn.set_impl(model, impl)
        with torch.no_grad():
            outputs[impl], _ = attention.attention_with_keys(module, query, key, value, None, **dict(kwargs))
    # (batch, queries) of each kernel call: requests 0, 1 and 3 as rows of one batch, then the prefill
    assert [(shape[0], shape[-2]) for shape in triton_calls] == [(3, 1), (1, 3)]
    torch.testing.assert_close(outputs["triton"], outputs["reference"], **TOLERANCE)


@needs_triton
def test_a_packed_training_batch_with_dropout_runs_on_the_kernels(interpreter, triton_calls):
    """DataCollatorWithFlattening's packed row (one sequence after another, cu_seq_lens_q/k), in training mode with
    attention dropout, Neural Attention over a grouped-query Llama: each sequence on the kernels, the chunked path's
    loss, logits and gradients at the same seed."""
    from transformers import DataCollatorWithFlattening

    prompts = [[5, 9, 12, 3, 7], [8, 2, 30, 31, 40, 41, 42], [17, 18, 19]]
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=True)([{"input_ids": p} for p in prompts])
    batch.pop("labels")  # train_step's labels are the ids
    results = {}
    for impl in ("chunked", "triton"):
        model = tiny_llama(attention_dropout=0.2)
        hf_neural_attn.patch_model(model, "neural", proj_dim=2, impl=impl)
        perturb_scorers(model)
        results[impl] = train_step(model.train(), batch, seed=3)
    assert len(triton_calls) == 2 * len(prompts)  # each sequence, each layer
    (ref_loss, ref_logits, ref_grads), (loss, logits, grads) = results["chunked"], results["triton"]
    torch.testing.assert_close(loss, ref_loss, **TOLERANCE)
    torch.testing.assert_close(logits, ref_logits, **TOLERANCE)
    for name, ref_grad in ref_grads.items():
        torch.testing.assert_close(grads[name], ref_grad, **TOLERANCE, msg=lambda m, n=name: f"{n}: {m}")


# --- the kernels as torch operators -----------------------------------------------------------------------

# torch.library.opcheck's checks, all of them: schema, autograd registration, fake implementations, and AOTAutograd
# tracing the operators (opaque, so it runs the fakes, never the kernels, on fake tensors).
OPCHECKS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@needs_triton
@pytest.mark.parametrize(
    "name,options,dropout",
    [("qana", {"h": 3}, 0.2), ("neural", {"h": 3, "proj_dim": 2}, 0.0), ("neural", {"h": 2, "mode": "replace"}, 0.2)],
)
def test_kernels_are_torch_operators(interpreter, name, options, dropout):
    """fused_attention's output is that of torch.ops.hf_neural_attn.fused_attention_forward, and both operators
    pass opcheck: schema, autograd registration, fake implementations whose outputs have the real ones' shapes,
    dtypes and strides, and AOTAutograd's tracing (QANA, the pair MLP with a gate and in its replace form, which has
    none; with and without a dropout seed)."""
    scorer = make_scorer(name, 2, 1, **options)
    hidden, query, key, value, mask, _ = attention_case(2, 1, 5, 5, "causal")
    inputs = scorer.fused_inputs(query, key, scorer.query_extras(hidden, None) if name == "qana" else None)
    seed = torch.tensor(99)
    call = {"scaling": D**-0.5, "is_causal": True, "dropout": fused.KernelDropout(seed, dropout) if dropout else None}
    output = fused.fused_attention(inputs, query, key, value, mask, **call)
    arguments = fused.operator_arguments(inputs, query, key, value, mask, **call)
    # Leaf tensors (opcheck copies its arguments), requiring a gradient where the call's tensors do.
    arguments = tree_map_only(torch.Tensor, lambda t: t.detach().requires_grad_(t.requires_grad), arguments)
    forward = torch.ops.hf_neural_attn.fused_attention_forward
    out, row_max, row_sum = forward(*arguments)
    torch.testing.assert_close(out, output, rtol=0, atol=0)
    torch.library.opcheck(forward, arguments, test_utils=OPCHECKS)
    grad_out = torch.linspace(-1, 1, out.numel()).view_as(out)
    backward_arguments = tree_map_only(torch.Tensor, torch.Tensor.detach, (grad_out, out, row_max, row_sum, *arguments))
    torch.library.opcheck(torch.ops.hf_neural_attn.fused_attention_backward, backward_arguments, test_utils=OPCHECKS)


@pytest.fixture
def fresh_dynamo():
    """Dynamo's caches emptied before and after the test, so that it compiles what the test gives it."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.compiles
@needs_triton
def test_compiled_patched_llama_holds_the_operator_and_matches_reference(interpreter, fresh_dynamo):
    """torch.compile's Dynamo keeps the forward operator in its graph, once per layer, with no graph break (it does
    not trace the launch code), and the compiled model gives the reference path's logits and gradients through the
    operators' autograd. Dynamo's graph runs on the eager backend here; inductor's, in a process of its own:
    tests/ops/test_compile.py."""
    models = {impl: tiny_llama() for impl in ("reference", "triton")}
    inputs = model_inputs("llama", seq=6)
    for impl, model in models.items():
        hf_neural_attn.patch_model(model, "qana", impl=impl)
        perturb_scorers(model)
        model.train()
    explanation = torch._dynamo.explain(models["triton"])(**inputs)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    operators = [
        node.target for graph in explanation.graphs for node in graph.graph.nodes if node.op == "call_function"
    ]
    forward = torch.ops.hf_neural_attn.fused_attention_forward.default
    assert operators.count(forward) == 2
    compiled = torch.compile(models["triton"], backend="eager", fullgraph=True)
    results = {}
    for impl, model in (("reference", models["reference"]), ("triton", compiled)):
        out = model(**inputs, labels=inputs["input_ids"])
        out.loss.backward()
        results[impl] = out.logits.detach(), {n: p.grad for n, p in models[impl].named_parameters()}
    (ref_logits, ref_grads), (logits, grads) = results["reference"], results["triton"]
    torch.testing.assert_close(logits, ref_logits, **TOLERANCE)
    for name, ref_grad in ref_grads.items():
        torch.testing.assert_close(grads[name], ref_grad, **TOLERANCE, msg=lambda m, n=name: f"{n}: {m}")


FIRST_CALL_SCRIPT = """
import sys
import torch
from hf_neural_attn.ops.terms import PAIR_MLP, FusedInputs
from hf_neural_attn.ops.triton import fused

def attend(query, key, value, P, R, w, gate):
    inputs = FusedInputs(PAIR_MLP, (P, R, w, gate), "gelu", 2)
    return fused.fused_attention(inputs, query, key, value, None, scaling=0.5, is_causal=True)

shapes = ((1, 2, 3, 4), (1, 1, 3, 4), (1, 1, 3, 4), (1, 2, 3, 2), (1, 1, 3, 2), (2,), (2,))
generator = torch.Generator().manual_seed(0)
tensors = [torch.randn(*shape, generator=generator) for shape in shapes]
assert "hf_neural_attn.ops.triton.custom_ops" not in sys.modules
explanation = torch._dynamo.explain(attend)(*tensors)
assert "hf_neural_attn.ops.triton.custom_ops" in sys.modules
print(explanation.graph_break_count)
print(*[node.target for graph in explanation.graphs for node in graph.graph.nodes if node.op == "call_function"])
"""


@pytest.mark.compiles
@pytest.mark.spawns
@needs_triton
def test_first_compiled_call_defines_the_operators_without_graph_break():
    """The operators are defined when :mod:`.custom_ops` is first imported, by the first call of fused_attention; in
    a compiled function Dynamo runs that import instead of tracing it, so even that first call compiles whole. (A
    fresh interpreter with ``TRITON_INTERPRET=1`` from the start: in this one the operators may exist already.)"""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    finished = subprocess.run(
        [sys.executable, "-c", FIRST_CALL_SCRIPT], check=False, capture_output=True, text=True, timeout=300, env=env
    )
    assert finished.returncode == 0, finished.stderr[-3000:]
    graph_breaks, operators = finished.stdout.strip().splitlines()[-2:]
    assert graph_breaks == "0"
    assert "hf_neural_attn.fused_attention_forward.default" in operators.split()


# --- choosing the path ----------------------------------------------------------------------------------


def resolve(scorer, impl, device="cpu", dtype=torch.float32, q_len=8, kv_len=8, **kwargs):
    return resolve_impl(
        impl, scorer, device=device, dtype=dtype, q_len=q_len, kv_len=kv_len, head_dim=D, is_causal=True, **kwargs
    )


def cuda_calls(batch: int = 2) -> dict[str, dict]:
    """The calls a patched model makes, by what makes them (keywords of :func:`resolve`): training and inference,
    padded batches under either mask form, a packed call's parts, a decoding step against a long cache."""
    allowed = torch.ones(batch, 1, 8, 8, dtype=torch.bool).tril()
    allowed[1, ..., :3] = False  # a left-padded second sequence
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    # Three decoding requests of a packed call scored as one group: a block-diagonal (1, 1, 3, 40) boolean mask.
    group = torch.zeros(1, 1, 3, 40, dtype=torch.bool)
    group[..., 0, :9], group[..., 1, 9:30], group[..., 2, 30:] = True, True, True
    return {
        "long": {"q_len": 4096, "kv_len": 4096},
        "short": {},
        "bf16 on cuda:1": {"device": torch.device("cuda", 1), "dtype": torch.bfloat16, "q_len": 4096, "kv_len": 4096},
        "padded, boolean mask": {"attention_mask": allowed, "batch": batch},
        "padded, additive mask": {"attention_mask": additive, "batch": batch},
        "a packed call's prefill": {"q_len": 3, "kv_len": 12, "batch": 1},
        "a packed call's decoding group": {"q_len": 3, "kv_len": 40, "attention_mask": group, "batch": 1},
        "a decoding step": {"q_len": 1, "kv_len": 4096},
    }


@pytest.mark.parametrize("name", FUSED_SCORERS)
def test_auto_takes_the_kernels_for_every_cuda_call_they_serve(monkeypatch, name):
    """With dispatch.TRITON_IN_AUTO (set since the kernels were verified on a GPU), every CUDA call the kernels
    support goes to them: long and short, padded, a packed call's parts, decoding steps; while torch.compile traces
    too (the kernels are opaque operators there). Training with dropout too: the choice does not read it
    (``resolve_impl`` takes no dropout), and the kernels drop what every path drops (the tests above). Switched off,
    CUDA calls get the CPU's rule; CPU calls never go to the kernels. The calls they do not serve:
    test_unsupported_configs_fall_back_under_auto_and_raise_under_triton."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    scorer = make_scorer(name, 2, 1)
    assert dispatch.TRITON_IN_AUTO
    for compiling in (False, True):
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda compiling=compiling: compiling)
        for call, shapes in cuda_calls().items():
            shapes = {"device": "cuda", **shapes}
            expected = "triton" if HAS_TRITON else resolve(scorer, "auto", **{**shapes, "device": "cpu"})
            assert resolve(scorer, "auto", **shapes) == expected, (call, compiling)
            assert resolve(scorer, "auto", **{**shapes, "device": "cpu"}) != "triton", call
    monkeypatch.setattr(dispatch, "TRITON_IN_AUTO", False)
    long = {"q_len": 4096, "kv_len": 4096}
    assert resolve(scorer, "auto", device="cuda") == "reference"
    assert resolve(scorer, "auto", device="cuda", **long) == "blockwise"
    monkeypatch.setattr(dispatch, "TRITON_IN_AUTO", True)
    # Calls that need the probabilities go to the reference path, whatever impl says (an explicit path warns once).
    for impl in IMPLS:
        assert resolve(scorer, impl, device="cuda", need_weights=True) == "reference"
    assert resolve(scorer, "reference", device="cuda") == "reference"
    assert resolve(scorer, "chunked", device="cuda") == "blockwise"  # the chunked choice, in its fused form
    with pytest.raises(ValueError, match="impl='fused' is not supported"):
        resolve(scorer, "fused")


def test_auto_runs_the_chunked_path_above_the_threshold(monkeypatch):
    calls = []
    original = dispatch.PATHS["blockwise"]

    def spy(*args, **kwargs):
        calls.append(args[2].shape)  # the keys it was given: their kv heads, not repeated
        return original(*args, **kwargs)

    monkeypatch.setitem(dispatch.PATHS, "blockwise", spy)
    always_blockwise(monkeypatch)
    scorer = make_scorer("neural", 2, 1, impl="auto")
    _, query, key, value, mask, _ = attention_case(2, 1, 5, 5, "causal")
    output, probs = scored_attention(scorer, query, key, value, mask, scaling=D**-0.5, is_causal=True)
    assert calls == [(2, 1, 5, D)] and output.shape == (2, 5, 2, D) and probs is None
    # Calls that need the probabilities still get them, from the reference path.
    _, probs = scored_attention(scorer, query, key, value, mask, scaling=D**-0.5, is_causal=True, need_weights=True)
    assert len(calls) == 1 and probs.shape == (2, 2, 5, 5)


@needs_triton
def test_unsupported_configs_fall_back_under_auto_and_raise_under_triton(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(dispatch, "TRITON_IN_AUTO", True)
    deep = make_scorer("neural", 2, 1, h=4, depth=2)
    cases = [
        (deep, {}, "depth=2"),
        (make_scorer("qana", 2, 1, h=32), {}, "h=32"),
        (make_scorer("qana", 2, 1), {"dtype": torch.float64}, "float64"),
        (make_scorer("qana", 2, 1), {"q_len": 9, "kv_len": 8}, "at least as many keys"),
        (make_scorer("qana", 2, 1), {"attention_mask": torch.zeros(1, 1, 8, 8, dtype=torch.int8)}, "additive float"),
        (make_scorer("qana", 2, 1), {"value_head_dim": D + 2}, "one head_dim"),
    ]
    for scorer, overrides, message in cases:
        assert resolve(scorer, "auto", device="cuda", **overrides) == "reference"  # the CPU rule, at these sizes
        with pytest.raises(ValueError, match=message):
            resolve(scorer, "triton", device="cuda", **overrides)
    # CPU tensors outside the interpreter: say that the kernels need CUDA.
    with pytest.raises(ValueError, match="run on CUDA tensors"):
        resolve(make_scorer("qana", 2, 1), "triton", device="cpu")


@needs_triton
def test_triton_error_reaches_the_caller_through_a_patched_model(interpreter):
    model = tiny_gpt2()
    hf_neural_attn.patch_model(model, "neural", h=4, depth=2, impl="triton")
    with pytest.raises(ValueError, match="depth=2.*impl='chunked'"):
        model(**model_inputs("gpt2"))


def test_without_triton_auto_falls_back_and_triton_says_how_to_install(monkeypatch):
    monkeypatch.setattr(ops_triton, "triton_available", lambda: False)
    monkeypatch.setattr(dispatch, "TRITON_IN_AUTO", True)
    monkeypatch.setattr(dispatch, "_WARNED", set())
    scorer = make_scorer("qana", 2, 1)
    with pytest.warns(UserWarning, match="pip install triton"):
        assert resolve(scorer, "auto", device="cuda", q_len=4096, kv_len=4096) == "blockwise"
    with pytest.raises(ImportError, match="pip install triton"):
        resolve(scorer, "triton", device="cuda")
    hidden, query, key, value, mask, _ = attention_case(2, 1, 4, 4, "causal")
    scorer.config.impl = "triton"
    with pytest.raises(ImportError, match="pip install triton"):
        scored_attention(scorer, query, key, value, mask, scaling=1.0, extras=scorer.query_extras(hidden, None))


def test_check_impl_names_what_triton_is_missing(monkeypatch):
    """``check_impl`` (called at patch time) raises ValueError naming the missing piece: the package, a CUDA
    device, or the interpreter; it accepts what can run and every other path."""
    monkeypatch.setattr(ops_triton, "triton_available", lambda: True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for impl in PORTABLE_IMPLS:
        dispatch.check_impl(impl)
        dispatch.check_impl(impl, torch.device("cpu"))
    with pytest.raises(ValueError, match="needs a CUDA device.*TRITON_INTERPRET=1"):
        dispatch.check_impl("triton")
    with pytest.raises(ValueError, match="on 'cpu'.*TRITON_INTERPRET=1.*not enabled"):
        dispatch.check_impl("triton", torch.device("cpu"))

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    dispatch.check_impl("triton")
    dispatch.check_impl("triton", torch.device("cuda", 0))
    with pytest.raises(ValueError, match="on 'cpu'"):
        dispatch.check_impl("triton", torch.device("cpu"))  # CUDA exists, but these tensors are not on it

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    dispatch.check_impl("triton")
    dispatch.check_impl("triton", torch.device("cpu"))

    monkeypatch.setattr(ops_triton, "triton_available", lambda: False)
    with pytest.raises(ValueError, match="needs the triton package.*pip install triton"):
        dispatch.check_impl("triton")
    dispatch.check_impl("auto")  # falls back to the chunked path instead


def test_kernel_layer_imports_no_scorer():
    """ops/triton sees tensors only: scorers reach it through fused_unsupported_reason / fused_inputs."""
    import ast

    for path in Path(ops_triton.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            assert not any("scorers" in name for name in names), f"{path.name} imports {names}"


@pytest.mark.spawns
def test_package_imports_without_triton():
    """In a fresh interpreter where ``import triton`` fails: the package imports, patches, runs on the
    default paths, and impl='triton' is refused at patch time, naming the missing package."""
    script = """
import sys
sys.modules["triton"] = None  # makes `import triton` raise ImportError
import torch, hf_neural_attn
from transformers import GPT2Config, GPT2LMHeadModel
from hf_neural_attn.ops.triton import triton_available
assert not triton_available()
config = GPT2Config(vocab_size=16, n_embd=8, n_layer=1, n_head=2, n_positions=8)
ids = torch.tensor([[1, 2, 3]])
for impl in ("auto", "reference", "triton"):
    model = GPT2LMHeadModel(config).eval()
    try:
        hf_neural_attn.patch_model(model, "qana", impl=impl)
        model(ids)
        print(impl, "ran")
    except ValueError as error:
        print(impl, "ValueError", error, "patched" if hf_neural_attn.is_patched(model) else "unpatched")
"""
    finished = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=120)
    assert finished.returncode == 0, finished.stderr
    lines = finished.stdout.strip().splitlines()
    assert lines[:2] == ["auto ran", "reference ran"]
    assert lines[2].startswith("triton ValueError") and "pip install triton" in lines[2]
    assert lines[2].endswith("unpatched")


COMPILE_SCRIPT = """
common = kernels("common")
assert not any(name.startswith("transformers") or name.startswith("hf_neural_attn") for name in sys.modules)
# (KIND, tiles, warps, dropout, kernels): each term's three kernels, with dropout for one (its code is the terms'
# shared helpers), and a decoding step's 16-row forward tile.
ALL = (common.forward_kernel, common.backward_query_kernel, common.backward_key_kernel)
for kind, (block_m, block_n, warps), dropout, fns in (
    (0, (64, 32, 8), True, ALL), (1, (64, 32, 8), False, ALL), (0, (16, 64, 4), False, ALL[:1])
):
    for fn in fns:
        constexprs = dict(KIND=kind, ACT=0, HAS_MASK=True, IS_CAUSAL=True, BLOCK_M=block_m, BLOCK_N=block_n,
                          BLOCK_D=64, HID_PAD=4, PRECISION="tf32", HAS_DROPOUT=dropout)
        compile_sm90(fn, constexprs, warps)
        print(kind, fn.__name__, "compiled")
"""


@pytest.mark.compiles
@pytest.mark.spawns
@needs_triton
def test_kernels_compile_for_a_gpu_without_one(tmp_path):
    """The interpreter runs the kernels as Python; the GPU compiler is stricter (tile shapes, types,
    constexpr branches). Compiling for sm_90 needs no GPU: Triton ships the compiler and ptxas."""
    output = compile_kernels_for_gpu(COMPILE_SCRIPT, Path(ops_triton.__file__).parent.parent, tmp_path)
    assert output.count("compiled") == 7
