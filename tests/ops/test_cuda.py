"""On a CUDA device: the compiled Triton kernels and the other paths at real shapes, and whole patched models:
attention dropout inside the kernels, models compiled by inductor on them, cached generation.

Skipped without a CUDA device (CI has none): run them on a GPU machine with ``pytest tests/ops/test_cuda.py -s`` (``-s``
prints the errors each check saw, for docs/benchmarks.md). test_triton.py checks the same kernels in Triton's CPU
interpreter on tiny shapes; this file checks what only a GPU runs: compiled kernels, real tile sizes, bf16, head_dim
64 and grouped-query attention at GPT-2 small's and SmolLM-135M's shapes.

Tolerances: each path is compared with the float64 reference of the same inputs. fp32: outputs within 2e-4, gradients
within 2e-4 of their largest magnitude (seen on an H100: at most 7.4e-6 and 4.9e-5; the kernels use IEEE fp32
products unless torch allows TF32 matmuls, which would need a wider bound). bf16 (8 mantissa bits: rounding the inputs alone moves outputs by ~3e-2 here): the kernels no more than 1.5 times
the error of the reference path computing in bf16 on the same device, plus 1e-3 (seen: 0.6-0.9 times); the chunked
path 2.5 times (seen on an H100: up to 2.0 times, in Neural Attention's gradients at SmolLM's grouped shape).
"""

from __future__ import annotations

import pytest
import torch
from helpers.installed import HAS_TRITON
from helpers.references import geometry, randomise
from helpers.scorers import FUSED_SCORERS

import hf_neural_attn
from hf_neural_attn.ops.dispatch import scored_attention
from hf_neural_attn.scorers import NeuralAttentionConfig, NeuralAttentionScorer, QanaConfig, QanaScorer

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not HAS_TRITON, reason="needs triton"),
]

# (heads, kv_heads, head_dim, hidden): GPT-2 small's attention (12 heads of 64), SmolLM-135M's (9 on 3 kv heads).
SHAPES = {"gpt2-small": (12, 12, 64, 768), "smollm-135m": (9, 3, 64, 576)}
FP32_TOLERANCE = 2e-4  # seen on an H100: at most 4.9e-5
BF16_FACTOR, BF16_SLACK = {"triton": 1.5, "chunked": 2.5, "reference": 1.0}, 1e-3


def make_scorer(name: str, shape: str, **options):
    heads, kv_heads, head_dim, hidden = SHAPES[shape]
    geo = geometry(hidden_size=hidden, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, dtype=torch.float64)
    config = QanaConfig(**options) if name == "qana" else NeuralAttentionConfig(**options)
    scorer = (QanaScorer if name == "qana" else NeuralAttentionScorer)(config, geo)
    randomise(scorer, std=0.05)  # scores of a trained model's size: logits of a few units
    return scorer


def make_inputs(shape: str, batch: int, seq: int, left_pad: int, seed: int = 0):
    """hidden (batch, seq, hidden), q (batch, heads, seq, d), k, v (batch, kv_heads, seq, d) in float64 on the CPU,
    and a causal additive mask with the second row's first ``left_pad`` keys padded."""
    heads, kv_heads, head_dim, hidden = SHAPES[shape]
    generator = torch.Generator().manual_seed(seed)

    def randn(*size):
        return torch.randn(*size, generator=generator, dtype=torch.float64)

    allowed = torch.ones(seq, seq, dtype=torch.bool).tril().expand(batch, 1, seq, seq).clone()
    allowed[1, ..., :left_pad] = False
    mask = torch.zeros(allowed.shape, dtype=torch.float64).masked_fill(~allowed, torch.finfo(torch.float64).min)
    tensors = (randn(batch, seq, hidden), randn(batch, heads, seq, head_dim), randn(batch, kv_heads, seq, head_dim))
    return (*tensors, randn(batch, kv_heads, seq, head_dim), mask, allowed.any(-1, keepdim=True))


def run_path(scorer, impl, inputs, dtype, device):
    """Output and gradients (hidden, q, k, v, every parameter) of one path, in float64 on the CPU for comparing."""
    scorer = scorer.to(device=device, dtype=dtype)
    scorer.config.impl = impl
    hidden, query, key, value, mask, valid = (t.to(device) for t in inputs)
    leaves = [t.to(dtype).requires_grad_() for t in (hidden, query, key, value)]
    mask = mask.clamp(min=torch.finfo(dtype).min).to(dtype)
    extras = scorer.query_extras(leaves[0], None) if scorer.name == "qana" else None
    output, _ = scored_attention(
        scorer, *leaves[1:], mask, scaling=query.shape[-1] ** -0.5, extras=extras, is_causal=True
    )
    valid = valid.transpose(1, 2)  # rows with no key to attend to have no defined output
    weights = torch.linspace(-1, 1, output.numel(), device=device).view_as(output).to(dtype) * valid
    grads = torch.autograd.grad((output * weights).sum(), [*leaves, *scorer.parameters()], allow_unused=True)
    return (output.detach() * valid).double().cpu(), [None if g is None else g.double().cpu() for g in grads]


def worst_errors(result, reference) -> tuple[float, float]:
    """The largest output error, and the largest gradient error relative to that gradient's largest magnitude."""
    (output, grads), (ref_output, ref_grads) = result, reference
    out_error = (output - ref_output).abs().max().item()
    assert [g is None for g in grads] == [r is None for r in ref_grads]
    pairs = [(g, r) for g, r in zip(grads, ref_grads) if r is not None]
    grad_error = max(((g - r).abs().max() / r.abs().max().clamp(min=1e-12)).item() for g, r in pairs)
    return out_error, grad_error


CASES = [
    ("qana", {"h": 4}),
    ("neural", {"h": 4, "proj_dim": 2}),
    ("neural", {"h": 4, "mode": "replace"}),
]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name,options", CASES, ids=lambda value: str(value))
@pytest.mark.parametrize("impl", ["triton", "chunked", "reference"])
def test_paths_match_float64_on_cuda(name, options, impl, shape):
    assert name in FUSED_SCORERS
    scorer = make_scorer(name, shape, **options)
    inputs = make_inputs(shape, batch=2, seq=300, left_pad=7)  # 300: not a tile multiple
    reference = run_path(scorer, "reference", inputs, torch.float64, "cpu")
    out_error, grad_error = worst_errors(run_path(scorer, impl, inputs, torch.float32, "cuda"), reference)
    print(f"{name} {options} {shape} {impl} fp32: output {out_error:.2e}, gradients {grad_error:.2e}")
    assert out_error <= FP32_TOLERANCE and grad_error <= FP32_TOLERANCE
    bf16_reference = worst_errors(run_path(scorer, "reference", inputs, torch.bfloat16, "cuda"), reference)
    out_error, grad_error = worst_errors(run_path(scorer, impl, inputs, torch.bfloat16, "cuda"), reference)
    print(
        f"{name} {options} {shape} {impl} bf16: output {out_error:.2e}, gradients {grad_error:.2e} "
        f"(reference path in bf16: {bf16_reference[0]:.2e}, {bf16_reference[1]:.2e})"
    )
    assert out_error <= BF16_FACTOR[impl] * bf16_reference[0] + BF16_SLACK
    assert grad_error <= BF16_FACTOR[impl] * bf16_reference[1] + BF16_SLACK


def gpt2_small(seed: int = 0):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # GPT-2 small, 124M
    return GPT2LMHeadModel(config).cuda()


@pytest.mark.parametrize("scorer", ["qana", "neural"])
def test_patched_gpt2_small_trains_alike_on_every_path(scorer):
    """Loss and gradients of GPT-2 small, patched in every layer with the scorers perturbed off their
    function-preserving start, agree across the paths on CUDA in fp32; and the patched model at init equals the
    unpatched one."""
    tokens = torch.randint(0, 50257, (2, 512), generator=torch.Generator().manual_seed(1)).cuda()
    model = gpt2_small()
    unpatched = model(input_ids=tokens).logits
    hf_neural_attn.patch_model(model, scorer, h=4)
    torch.testing.assert_close(model(input_ids=tokens).logits, unpatched, rtol=0, atol=1e-4)
    generator = torch.Generator(device="cuda").manual_seed(2)
    with torch.no_grad():
        for parameter in hf_neural_attn.scorer_parameters(model).values():
            parameter.add_(torch.randn(parameter.shape, generator=generator, device="cuda") * 0.05)
    results = {}
    for impl in ("reference", "chunked", "triton"):
        hf_neural_attn.set_impl(model, impl)
        model.zero_grad()
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        results[impl] = loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    ref_loss, ref_grads = results["reference"]
    for impl in ("chunked", "triton"):
        loss, grads = results[impl]
        worst = max(((grads[n] - g).abs().max() / g.abs().max().clamp(min=1e-12)).item() for n, g in ref_grads.items())
        print(f"GPT-2 small, {scorer}, {impl}: loss {loss:.6f} vs {ref_loss:.6f}, worst relative gradient {worst:.2e}")
        assert abs(loss - ref_loss) < 1e-3 and worst < 1e-2


def dropout_run(scorer, impl, inputs, seed):
    """:func:`run_path` in fp32 on CUDA, in training mode with attention dropout 0.1 drawn after
    ``torch.manual_seed(seed)``."""
    scorer = scorer.to(device="cuda", dtype=torch.float32)
    scorer.config.impl = impl
    hidden, query, key, value, mask, valid = (t.to("cuda") for t in inputs)
    leaves = [t.float().requires_grad_() for t in (hidden, query, key, value)]
    mask = mask.clamp(min=torch.finfo(torch.float32).min).float()
    extras = scorer.query_extras(leaves[0], None) if scorer.name == "qana" else None
    torch.manual_seed(seed)
    output, _ = scored_attention(
        scorer, *leaves[1:], mask, scaling=query.shape[-1] ** -0.5, extras=extras, is_causal=True, dropout=0.1,
        training=True,
    )  # fmt: skip
    valid = valid.transpose(1, 2)
    weights = torch.linspace(-1, 1, output.numel(), device="cuda").view_as(output) * valid
    grads = torch.autograd.grad((output * weights).sum(), [*leaves, *scorer.parameters()], allow_unused=True)
    return (output.detach() * valid).double().cpu(), [None if g is None else g.double().cpu() for g in grads]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name,options", CASES, ids=lambda value: str(value))
def test_kernels_drop_what_the_chunked_path_drops_on_cuda(name, options, shape):
    """Attention dropout 0.1 in the compiled kernels: at one seed the chunked path's output and gradients within the
    fp32 tolerance, at real tiles and shapes; another seed moves the output."""
    scorer = make_scorer(name, shape, **options)
    inputs = make_inputs(shape, batch=2, seq=300, left_pad=7)
    expected = dropout_run(scorer, "chunked", inputs, seed=11)
    out_error, grad_error = worst_errors(dropout_run(scorer, "triton", inputs, seed=11), expected)
    print(f"{name} {options} {shape} dropout 0.1, triton against chunked: output {out_error:.2e}, gradients "
          f"{grad_error:.2e}")  # fmt: skip
    assert out_error <= FP32_TOLERANCE and grad_error <= FP32_TOLERANCE
    assert (dropout_run(scorer, "triton", inputs, seed=12)[0] - expected[0]).abs().max() > 1e-3


def gpt2_small_default(seed: int = 0):
    """GPT-2 small from its default config, attention dropout 0.1 (residual and embedding dropout off, so that the
    paths differ only where the patch acts)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0)).cuda().train()


def perturbed(model, seed: int = 2):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    with torch.no_grad():
        for parameter in hf_neural_attn.scorer_parameters(model).values():
            parameter.add_(torch.randn(parameter.shape, generator=generator, device="cuda") * 0.05)
    return model


def training_step(forward, model, tokens, seed):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    logits = forward(input_ids=tokens).logits
    torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
    return logits.detach().float(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def relative_gradient_error(grads, ref_grads) -> float:
    assert grads.keys() == ref_grads.keys()
    return max(((grads[n] - g).abs().max() / g.abs().max().clamp(min=1e-12)).item() for n, g in ref_grads.items())


def paths_taken(monkeypatch) -> list[str]:
    """The paths (keys of dispatch.PATHS) that serve the attention calls made after this, in order (eager calls:
    inside a compiled graph the spy would be traced, see test_compiled_training_on_the_kernels_matches_eager_on_cuda)."""
    from hf_neural_attn.ops import dispatch

    taken = []
    for name, path in list(dispatch.PATHS.items()):
        monkeypatch.setitem(dispatch.PATHS, name, lambda *a, _n=name, _p=path, **k: taken.append(_n) or _p(*a, **k))
    return taken


@pytest.mark.parametrize("scorer", ["qana", "neural"])
def test_gpt2_small_trains_with_dropout_on_the_kernels_as_on_the_chunked_path(scorer, monkeypatch):
    """GPT-2 small's default attention dropout (0.1), every layer patched, fp32: impl="auto" runs the kernels on
    CUDA (checked: every call), and they agree with the chunked path at one seed, logits and every gradient."""
    tokens = torch.randint(0, 50257, (2, 512), generator=torch.Generator().manual_seed(1)).cuda()
    model = gpt2_small_default()
    hf_neural_attn.patch_model(model, scorer, h=4)
    perturbed(model)
    taken = paths_taken(monkeypatch)
    results = {}
    for impl in ("chunked", "auto"):
        hf_neural_attn.set_impl(model, impl)
        taken.clear()
        results[impl] = training_step(model, model, tokens, seed=5)
    assert taken == ["triton"] * 12, taken  # the auto step's calls, one per layer
    (ref_logits, ref_grads), (logits, grads) = results["chunked"], results["auto"]
    logit_error, grad_error = (logits - ref_logits).abs().max().item(), relative_gradient_error(grads, ref_grads)
    print(f"GPT-2 small, {scorer}, dropout 0.1, auto (kernels) against chunked: logits {logit_error:.2e}, "
          f"worst relative gradient {grad_error:.2e}")  # fmt: skip
    assert logit_error < 1e-3 and grad_error < 1e-2


@pytest.mark.compiles
@pytest.mark.parametrize("impl", ["triton", "auto"])
def test_compiled_training_on_the_kernels_matches_eager_on_cuda(impl, monkeypatch):
    """torch.compile(fullgraph=True) with inductor, GPT-2 small with its default attention dropout (0.1), every layer
    patched with QANA, on the kernels (named, or as impl="auto" takes them inside compiled models): Dynamo's graph holds
    the kernels' operator once per layer, and the compiled model gives the eager model's logits and gradients at one
    seed (``fallback_random``: the compiled graph draws the dropout seeds eager code draws)."""
    import torch._inductor.config

    monkeypatch.setattr(torch._inductor.config, "fallback_random", True)
    model = gpt2_small_default()
    hf_neural_attn.patch_model(model, "qana", h=4, impl=impl)
    perturbed(model)
    tokens = torch.randint(0, 50257, (2, 256), generator=torch.Generator().manual_seed(3)).cuda()
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(model)(input_ids=tokens)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    forward = torch.ops.hf_neural_attn.fused_attention_forward.default
    operators = [
        node.target for graph in explanation.graphs for node in graph.graph.nodes if node.op == "call_function"
    ]
    assert operators.count(forward) == 12, "the compiled model left the kernels"
    eager_logits, eager_grads = training_step(model, model, tokens, seed=6)
    torch._dynamo.reset()
    compiled_logits, compiled_grads = training_step(torch.compile(model, fullgraph=True), model, tokens, seed=6)
    logit_error = (compiled_logits - eager_logits).abs().max().item()
    grad_error = relative_gradient_error(compiled_grads, eager_grads)
    print(f"GPT-2 small, qana, {impl}, compiled against eager: logits {logit_error:.2e}, gradients {grad_error:.2e}")
    assert logit_error < 1e-3 and grad_error < 1e-2


def test_generation_with_the_cache_is_the_same_on_every_path():
    model = gpt2_small().eval()
    hf_neural_attn.patch_model(model, "qana", h=4)
    generator = torch.Generator(device="cuda").manual_seed(4)
    with torch.no_grad():
        for parameter in hf_neural_attn.scorer_parameters(model).values():
            parameter.add_(torch.randn(parameter.shape, generator=generator, device="cuda") * 0.05)
    prompt = torch.randint(0, 50257, (1, 40), generator=torch.Generator().manual_seed(5)).cuda()
    answers = {}
    for impl in ("reference", "triton"):
        hf_neural_attn.set_impl(model, impl)
        answers[impl] = model.generate(prompt, max_new_tokens=24, do_sample=False, pad_token_id=0)
    assert torch.equal(answers["triton"], answers["reference"])
