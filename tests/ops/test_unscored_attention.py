"""The attention the patch does not score keeps the model's own semantics exactly, edge cases included.

Cross-attention and the layers left out by ``layers=`` run the model's original implementation with the mask
that implementation would get (SDPA's boolean mask, or None, over an SDPA base; the eager float mask over an
eager one). The scored layers accept every form of mask, so a patched model over an eager base and the same
model over an SDPA base agree (transformers' ``test_eager_matches_sdpa_inference``, with live scorers).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers.models import IMAGE, VOCAB, family_cases, padded_inputs, perturb_scorers, tiny_gpt2

import hf_neural_attn
from hf_neural_attn.families.base import call_argument

BASES = ["eager", "sdpa"]
# Eager and SDPA compute the same softmax attention in different orders: fp32 rounding, observed ~1e-7.
EAGER_VS_SDPA = 1e-5


def output(model, inputs: dict, **kwargs) -> torch.Tensor:
    with torch.no_grad():
        out = model(**inputs, **kwargs)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


class Recorder:
    """What every attention module of a model receives (its mask) and returns (its output), call by call."""

    def __init__(self, modules):
        self.masks, self.outputs = [], []
        self.handles = []
        for module in modules:
            self.handles.append(module.register_forward_pre_hook(self._pre, with_kwargs=True))
            self.handles.append(module.register_forward_hook(self._post))

    def _pre(self, module, args, kwargs):
        name = "encoder_attention_mask" if kwargs.get("encoder_hidden_states") is not None else "attention_mask"
        self.masks.append(call_argument(module, args, kwargs, name))

    def _post(self, module, args, result):
        self.outputs.append(result[0].detach())


def gpt2_attention_modules(model):
    """GPT-2's attention modules in call order: each block's self-attention, then its cross-attention if any."""
    return [m for block in model.transformer.h for m in (block.attn, getattr(block, "crossattention", None)) if m]


def scored_class_modules(model, patched) -> list:
    """The modules of ``model`` of the class the patch scores in ``patched`` (a model of the same family), in
    layer order."""
    scored_class = {type(m) for m in patched.modules() if hasattr(m, "attn_scorer")}.pop()
    return [m for m in model.modules() if type(m) is scored_class]


def patched_quietly(model, scorer: str, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the generic path says it is generic
        return hf_neural_attn.patch_model(model, scorer, **options)


def assert_same_mask(actual, expected, where: str) -> None:
    if expected is None:
        assert actual is None, f"{where}: the unpatched model's mask is None, the patched one is not"
        return
    assert actual is not None and actual.dtype == expected.dtype, f"{where}: {actual!r} vs {expected!r}"
    assert torch.equal(actual, expected), where


# ------------------------------------------------------------------------------------- cross-attention


def cross_inputs():
    """GPT-2 decoder inputs over encoder states; example 1's encoder input is all padding, example 0's partly."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(2, VOCAB, (2, 7), generator=generator)
    encoder = torch.randn(2, 5, 32, generator=generator)
    encoder_mask = torch.ones(2, 5, dtype=torch.long)
    encoder_mask[0, 3:] = 0
    encoder_mask[1] = 0
    return {"input_ids": ids, "encoder_hidden_states": encoder, "encoder_attention_mask": encoder_mask}


@pytest.mark.parametrize("base", BASES)
def test_cross_attention_respects_encoder_padding_mask(base):
    """As transformers' test of the same name: masked encoder states change nothing, even where a row's encoder
    input is all padding, and the patched model's cross-attention is the unpatched model's, to the bit."""
    inputs = cross_inputs()
    unpatched = tiny_gpt2(add_cross_attention=True, attn_implementation=base)
    recorded_unpatched = Recorder(gpt2_attention_modules(unpatched))
    expected = output(unpatched, inputs)
    model = tiny_gpt2(add_cross_attention=True, attn_implementation=base)
    hf_neural_attn.patch_model(model, "qana", layers=[1])
    perturb_scorers(model)
    recorded = Recorder(gpt2_attention_modules(model))
    patched = output(model, inputs)

    # Block 0 is not scored: its self- and cross-attention get the same masks and give the same outputs.
    for index, where in ((0, "block 0 self-attention"), (1, "block 0 cross-attention")):
        assert_same_mask(recorded.masks[index], recorded_unpatched.masks[index], where)
        assert torch.equal(recorded.outputs[index], recorded_unpatched.outputs[index]), where
    assert_same_mask(recorded.masks[3], recorded_unpatched.masks[3], "block 1 cross-attention")

    # Whatever the masked encoder states hold, the outputs stay: example 0's padding, and under SDPA all of
    # example 1's input. (Eager attention spreads a row with nothing to attend to uniformly over the masked
    # states, in the unpatched model too; there the patched model does the same, as the outputs above show.)
    changed = dict(inputs, encoder_hidden_states=inputs["encoder_hidden_states"].clone())
    changed["encoder_hidden_states"][0, 3:] += 5.0
    if base == "sdpa":
        changed["encoder_hidden_states"][1] += 5.0
    torch.testing.assert_close(output(model, changed), patched, rtol=0, atol=0)
    torch.testing.assert_close(output(unpatched, changed), expected, rtol=0, atol=0)


@pytest.mark.parametrize("base", BASES)
def test_unscored_cross_attention_matches_the_unpatched_model_at_init(base):
    """Every self-attention layer scored (function-preserving init), every cross-attention unscored."""
    inputs = cross_inputs()
    expected = output(tiny_gpt2(add_cross_attention=True, attn_implementation=base), inputs)
    model = tiny_gpt2(add_cross_attention=True, attn_implementation=base)
    hf_neural_attn.patch_model(model, "neural")
    torch.testing.assert_close(output(model, inputs), expected, rtol=0, atol=EAGER_VS_SDPA)


# --------------------------------------------------------------------------- layers left out by layers=


@pytest.mark.parametrize("base", BASES)
@pytest.mark.parametrize("case", family_cases(lambda case: case.inputs != IMAGE, sample=True))  # masked
def test_unscored_layers_get_the_unpatched_mask_and_output(case, base):
    """Padding (and the sliding windows of Mistral and StarCoder2, shorter than the input): the layer left out gets
    the mask the unpatched model builds and returns its output, to the bit; the scored layer's mask is the same
    mask."""
    inputs = padded_inputs(case.inputs)
    unpatched = case.build(attn_implementation=base)
    model = patched_quietly(case.build(attn_implementation=base), "qana", layers=[1])
    perturb_scorers(model)
    recorded_unpatched = Recorder(scored_class_modules(unpatched, model))
    output(unpatched, inputs)
    recorded = Recorder(scored_class_modules(model, model))
    output(model, inputs)
    for index in range(2):
        assert_same_mask(recorded.masks[index], recorded_unpatched.masks[index], f"layer {index}")
    assert torch.equal(recorded.outputs[0], recorded_unpatched.outputs[0]), "layer 0 is not scored"


# ----------------------------------------------------------------------------------- eager vs SDPA base


@pytest.mark.parametrize("layers", [None, [1]], ids=["all-layers", "layer-1"])
@pytest.mark.parametrize("case", family_cases(mirrored=True))
def test_eager_and_sdpa_bases_give_the_same_patched_outputs(case, layers):
    """transformers' test_eager_matches_sdpa_inference, patched with live scorers, on a padded batch. Compared
    at the real tokens (left-padding queries attend to nothing: eager spreads them uniformly, SDPA zeroes them,
    with or without the patch)."""
    inputs = padded_inputs(case.inputs)
    outputs = {}
    for base in BASES:
        model = case.build(attn_implementation=base)
        hf_neural_attn.patch_model(model, "qana", layers=layers)
        perturb_scorers(model)
        outputs[base] = output(model, inputs)
    valid = inputs.get("attention_mask", torch.ones(outputs["eager"].shape[:2])).bool()
    torch.testing.assert_close(outputs["sdpa"][valid], outputs["eager"][valid], rtol=0, atol=EAGER_VS_SDPA)
    unpatched = output(case.build(attn_implementation="eager"), inputs)
    assert (outputs["eager"] - unpatched).abs().max() > 1e-3, "the scorers are live"
