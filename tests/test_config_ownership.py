"""A patched model owns its config: siblings built from the same config object and the caller's object never
silently run, save or share a different model than the user believes (switching the implementation:
test_attn_implementation.py)."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest
import torch
from helpers import family_names, model_inputs, perturb_scorers, tiny_model
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    PretrainedConfig,
)

import hf_neural_attn

TOL = 1e-5  # fp32, same weights, same inputs


def _shared_config(family: str):
    """A model class and a fresh config object of the tiny test shapes."""
    model = tiny_model(family)
    return type(model), copy.deepcopy(model.config)


def _siblings(family: str):
    """Three models of one shared config object, the way transformers 5 users build them."""
    model_class, config = _shared_config(family)
    torch.manual_seed(0)
    first = model_class(config).eval()
    torch.manual_seed(1)
    second = AutoModelForCausalLM.from_config(config).eval()
    torch.manual_seed(2)
    baseline = model_class(config).eval()
    assert first.config is config and second.config is config  # the premise: transformers shares the object
    return config, first, second, baseline


@pytest.mark.parametrize("family", family_names(core=True, causal=True))  # AutoModelForCausalLM
def test_patching_one_sibling_changes_no_other_model_nor_the_callers_config(family, tmp_path):
    config, first, second, baseline = _siblings(family)
    inputs = model_inputs(family)
    before = {name: model(**inputs).logits for name, model in (("second", second), ("baseline", baseline))}
    config_before = config.to_dict()

    hf_neural_attn.patch_model(first, "qana", h=4)
    perturb_scorers(first, seed=3)
    hf_neural_attn.patch_model(second, "neural", proj_dim=2)
    perturb_scorers(second, seed=4)

    # The caller's object is untouched and the unpatched sibling still runs as the plain model.
    assert type(config) is type(baseline).config_class  # not the patched config class
    assert config.to_dict() == config_before
    assert not hasattr(config, "hf_neural_attn")
    torch.testing.assert_close(baseline(**inputs).logits, before["baseline"], rtol=0, atol=0)
    assert not hf_neural_attn.is_patched(baseline)

    # Each patched sibling carries its own record and reloads as itself.
    assert first.config.hf_neural_attn["scorer"] == "qana"
    assert second.config.hf_neural_attn["scorer"] == "neural"
    expected = {}
    for name, model in (("first", first), ("second", second)):
        expected[name] = model(**inputs).logits
        model.save_pretrained(tmp_path / name)
    for name in ("first", "second"):
        reloaded = hf_neural_attn.from_pretrained(tmp_path / name).eval()
        torch.testing.assert_close(reloaded(**inputs).logits, expected[name], rtol=0, atol=TOL)
    assert (expected["second"] - before["second"]).abs().max() > 1e-5  # the scorer is live (rounding is ~1e-7)

    # Unpatching one sibling leaves the other's record, outputs and checkpoint alone.
    hf_neural_attn.unpatch_model(first)
    assert second.config.hf_neural_attn["scorer"] == "neural"
    torch.testing.assert_close(second(**inputs).logits, expected["second"], rtol=0, atol=0)
    second.save_pretrained(tmp_path / "second-again")
    reloaded = hf_neural_attn.from_pretrained(tmp_path / "second-again").eval()
    torch.testing.assert_close(reloaded(**inputs).logits, expected["second"], rtol=0, atol=TOL)
    torch.testing.assert_close(baseline(**inputs).logits, before["baseline"], rtol=0, atol=0)


def test_every_module_of_a_patched_model_reads_its_private_config():
    _, model, _, _ = _siblings("llama")
    hf_neural_attn.patch_model(model, "qana")
    configs = {
        id(value)
        for module in model.modules()
        for value in vars(module).values()
        if isinstance(value, PretrainedConfig)
    }
    assert configs == {id(model.config)}


def test_a_patched_config_survives_deepcopy_and_pickle():
    _, model, _, _ = _siblings("gpt2")
    hf_neural_attn.patch_model(model, "neural")
    for copied in (copy.deepcopy(model.config), pickle.loads(pickle.dumps(model.config))):
        assert type(copied) is type(model.config)
        assert copied.hf_neural_attn == model.config.hf_neural_attn
        assert copied._attn_implementation == "hf_neural_attn"
        assert isinstance(copied, GPT2Config) and copied.model_type == "gpt2"


@pytest.mark.parametrize("layers", ["all", [0, "1"], 1.0])
def test_layers_that_are_not_indices_are_refused_by_name(layers):
    _, model, _, _ = _siblings("llama")
    with pytest.raises(ValueError, match="layers must be None .* got"):
        hf_neural_attn.patch_model(model, "qana", layers=layers)
    assert not hf_neural_attn.is_patched(model)


def test_layers_accept_numpy_and_tensor_integers():
    _, model, _, _ = _siblings("llama")
    hf_neural_attn.patch_model(model, "qana", layers=[np.int64(1), torch.tensor(-2)])
    assert model.config.hf_neural_attn["layers"] == [0, 1]


def test_impl_triton_where_triton_cannot_run_fails_at_patch_time(monkeypatch):
    # This machine has no CUDA device; without Triton's CPU interpreter the kernels cannot run.
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    _, model, _, _ = _siblings("llama")
    with pytest.raises(ValueError, match="triton"):
        hf_neural_attn.patch_model(model, "qana", impl="triton")
    assert not hf_neural_attn.is_patched(model) and type(model.config) is LlamaConfig


def test_output_attentions_set_on_the_config_returns_every_map():
    _, model, _, _ = _siblings("gpt2")
    hf_neural_attn.patch_model(model, "qana", layers=[1])
    model.config.output_attentions = True  # transformers refuses this for any implementation but eager
    attentions = model(**model_inputs("gpt2")).attentions
    assert len(attentions) == 2
    for probs in attentions:
        torch.testing.assert_close(probs.sum(-1), torch.ones(probs.shape[:-1]), rtol=0, atol=1e-5)


def test_a_single_layer_may_be_a_0d_tensor():
    _, model, _, _ = _siblings("llama")
    hf_neural_attn.patch_model(model, "qana", layers=torch.tensor(1))
    assert model.config.hf_neural_attn["layers"] == [1]
