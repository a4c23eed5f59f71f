"""Models built on the meta device and offloaded models, from the user's side.

* A model built on meta (``with torch.device("meta")``, accelerate's ``init_empty_weights()``) can be patched:
  the scorer parameters are created on meta, drawn when the model is materialised (``to_empty``), and left
  alone by transformers' ``init_weights()``, so the materialised patched model equals the unpatched one.
* Mirrors of transformers' common model tests that failed on patched models: ``test_can_be_initialized_on_meta``,
  ``test_init_weights_can_init_buffers``, ``test_all_tensors_are_parameter_or_buffer``.
* Offloaded models (accelerate's hooks over meta tensors) are in ``test_offloading.py``.
"""

from __future__ import annotations

import pytest
import torch
from accelerate import init_empty_weights
from helpers.models import family_names, model_inputs, perturb_scorers, tiny_llama, tiny_model
from helpers.scorers import FUSED_SCORERS

import hf_neural_attn

MIRRORED = family_names(mirrored=True)  # the families transformers' common model tests were run against


def _output(model, inputs) -> torch.Tensor:
    """The first output tensor (logits, or BERT's last hidden state)."""
    with torch.no_grad():
        return model(**inputs)[0]


def _meta_model(family: str):
    with torch.device("meta"):
        return tiny_model(family)


# Those families with QANA and Neural Attention; the other parametrised scorers on Llama (cheap).
CASES = [(family, scorer) for family in MIRRORED for scorer in FUSED_SCORERS]
CASES += [("llama", "additive"), ("llama", "general")]


@pytest.mark.parametrize("family,scorer", CASES)
def test_can_be_initialized_on_meta(family, scorer):
    """transformers' test_can_be_initialized_on_meta, patched: building and patching on meta needs no values."""
    model = _meta_model(family)
    hf_neural_attn.patch_model(model, scorer)
    new = hf_neural_attn.scorer_parameters(model)
    assert new, "the patch added no parameters"
    assert all(p.device.type == "meta" for p in model.parameters())
    assert all(b.device.type == "meta" for b in model.buffers())


@pytest.mark.parametrize("family,scorer", CASES)
def test_materialised_meta_model_is_function_preserving(family, scorer):
    """Meta -> patch -> ``to_empty`` -> transformers' ``init_weights()``: the scorers are drawn at
    materialisation, ``init_weights`` leaves them as they are, and the model equals the unpatched one."""
    torch.manual_seed(0)
    model = _meta_model(family)
    hf_neural_attn.patch_model(model, scorer)
    model.to_empty(device="cpu")
    drawn = {name: p.detach().clone() for name, p in hf_neural_attn.scorer_parameters(model).items()}
    model.init_weights()
    model.eval()
    after_init = hf_neural_attn.scorer_parameters(model)
    for name, value in drawn.items():
        assert torch.equal(after_init[name], value), f"init_weights redrew {name}"
        assert torch.isfinite(value).all(), name
    # A trainable init, not the all-zero one: the gates (where there are any) start open.
    gates = [p for name, p in after_init.items() if name.endswith(".gate")]
    assert all(torch.equal(g, torch.ones_like(g)) for g in gates)
    inputs = model_inputs(family)
    patched = _output(model, inputs)
    hf_neural_attn.unpatch_model(model)
    torch.testing.assert_close(patched, _output(model, inputs), atol=1e-5, rtol=1e-5)


def test_meta_init_draws_at_the_configs_initializer_range():
    """On meta the query-weight std comes from the config, the std transformers' init draws W_Q at."""
    with torch.device("meta"):
        model = tiny_llama(initializer_range=0.05)
    hf_neural_attn.patch_model(model, "qana")
    scorer = model.model.layers[0].self_attn.attn_scorer
    assert scorer.geometry.query_weight_std == 0.05
    assert scorer.geometry.device.type == "meta"


@pytest.mark.parametrize("family", MIRRORED)
@pytest.mark.parametrize("scorer", FUSED_SCORERS)
def test_init_weights_can_init_buffers(family, scorer):
    """transformers' test_init_weights_can_init_buffers, patched: the buffers of a patched model built on meta,
    materialised and initialised by transformers equal those of a patched model built normally."""
    from_init = hf_neural_attn.patch_model(tiny_model(family), scorer)
    from_meta = hf_neural_attn.patch_model(_meta_model(family), scorer)
    from_meta.to_empty(device="cpu")
    from_meta.init_weights()
    buffers, meta_buffers = dict(from_init.named_buffers()), dict(from_meta.named_buffers())
    assert sorted(buffers) == sorted(meta_buffers)
    different = [name for name, value in buffers.items() if not torch.equal(value, meta_buffers[name])]
    assert not different, f"buffers not reinitialised by init_weights: {different}"


@pytest.mark.parametrize("family,scorer", CASES)
def test_all_tensors_are_parameter_or_buffer(family, scorer):
    """transformers' test_all_tensors_are_parameter_or_buffer, patched: no module keeps a tensor outside its
    parameters and buffers (it would stay on meta), and the materialised model runs."""
    model = _meta_model(family)
    hf_neural_attn.patch_model(model, scorer)
    for name, module in model.named_modules():
        # Registered parameters and buffers live in _parameters / _buffers, not in the instance dict.
        loose = [key for key, value in vars(module).items() if isinstance(value, torch.Tensor)]
        assert not loose, f"{name or 'model'} keeps unregistered tensors {loose}"
    model.to_empty(device="cpu")
    model.init_weights()
    output = _output(model.eval(), model_inputs(family))
    assert torch.isfinite(output).all()


def test_init_weights_on_a_real_patched_model_keeps_the_scorers():
    """transformers' init_weights() on a patched model with real weights does not redraw the scorers (they are
    flagged as initialised), so they stay in their function-preserving state."""
    model = hf_neural_attn.patch_model(tiny_llama(), "neural")
    before = {name: p.detach().clone() for name, p in hf_neural_attn.scorer_parameters(model).items()}
    model.init_weights()
    for name, parameter in hf_neural_attn.scorer_parameters(model).items():
        assert torch.equal(parameter, before[name]), name


def test_init_empty_weights_then_load_state_dict_with_assign():
    """accelerate's init_empty_weights(), patch on meta, then load a patched model's state dict with
    assign=True: the outputs equal the source model's."""
    source = hf_neural_attn.patch_model(tiny_llama(), "qana")
    perturb_scorers(source)
    inputs = model_inputs("llama")
    with init_empty_weights():
        model = tiny_llama()
    hf_neural_attn.patch_model(model, "qana")
    assert all(p.is_meta for p in hf_neural_attn.scorer_parameters(model).values())
    model.load_state_dict(source.state_dict(), assign=True)
    assert not any(p.is_meta for p in model.parameters())
    torch.testing.assert_close(_output(model.eval(), inputs), _output(source, inputs), atol=0, rtol=0)
