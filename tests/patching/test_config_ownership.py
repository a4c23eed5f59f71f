"""A patched model owns its config: siblings built from the same config object and the caller's object never
silently run, save or share a different model than the user believes (switching the implementation:
test_attn_implementation.py)."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest
import torch
from helpers.models import family_case, family_names, model_inputs, perturb_scorers, tiny_model
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    PretrainedConfig,
)

import hf_neural_attn
from hf_neural_attn.patching import patch_as_recorded

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


def _outputs(model, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """What the tiny model of a family returns: logits, or the bare encoder's hidden states (BERT)."""
    output = model(**inputs)
    return output.logits if "logits" in output else output.last_hidden_state


@pytest.mark.parametrize("family", family_names(mirrored=True))
def test_a_model_built_by_its_class_from_a_patched_config_is_patched_like_it(family, tmp_path):
    """``type(model)(model.config)``, as transformers' tests build a fresh model (an assistant for assisted decoding):
    patched as the config's record says, with fresh scorers, like ``AutoModel*.from_config(model.config)``; it owns
    its config, records the base implementation its source runs (never the patch's own name), switches, saves and
    loads as any patched model; the source model and its config stay as they were."""
    source = hf_neural_attn.patch_model(tiny_model(family), "neural", h=2)
    perturb_scorers(source)
    source.set_attn_implementation("eager")  # a base other than transformers' default (SDPA)
    inputs = model_inputs(family)
    before, config_before = _outputs(source, inputs), source.config.to_dict()

    torch.manual_seed(1)
    twin = type(source)(source.config).eval()
    assert hf_neural_attn.is_patched(twin) and twin.config is not source.config
    assert hf_neural_attn.patch_record(twin) == hf_neural_attn.patch_record(source)
    assert twin.config.base_attn_implementation == "eager"
    assert {id(p) for p in hf_neural_attn.scorer_parameters(twin).values()}.isdisjoint(
        id(p) for p in hf_neural_attn.scorer_parameters(source).values()
    )
    if family_case(family).causal:  # the same rule through the Auto class
        auto = AutoModelForCausalLM.from_config(source.config)
        assert hf_neural_attn.patch_record(auto) == hf_neural_attn.patch_record(twin)
    with pytest.raises(ValueError, match="already patched with scorer 'neural'"):
        hf_neural_attn.patch_model(twin, "qana")

    perturb_scorers(twin, seed=5)
    over_eager = _outputs(twin, inputs)
    twin.set_attn_implementation("sdpa")
    assert hf_neural_attn.patch_record(twin).base_attn_implementation == "sdpa"
    torch.testing.assert_close(_outputs(twin, inputs), over_eager, rtol=0, atol=1e-4)  # eager vs SDPA rounding
    twin.save_pretrained(tmp_path / "twin")
    reloaded = hf_neural_attn.from_pretrained(tmp_path / "twin").eval()
    assert hf_neural_attn.patch_record(reloaded).base_attn_implementation == "sdpa"
    torch.testing.assert_close(_outputs(reloaded, inputs), _outputs(twin, inputs), rtol=0, atol=TOL)

    # Unpatched and patched again: the record names the base it runs.
    hf_neural_attn.unpatch_model(twin)
    hf_neural_attn.patch_model(twin, "qana", h=2)
    assert hf_neural_attn.patch_record(twin).base_attn_implementation == "sdpa"
    twin.save_pretrained(tmp_path / "repatched")
    assert hf_neural_attn.patch_record(hf_neural_attn.from_pretrained(tmp_path / "repatched")).scorer == "qana"

    assert source.config.to_dict() == config_before and source.config.base_attn_implementation == "eager"
    torch.testing.assert_close(_outputs(source, inputs), before, rtol=0, atol=0)


@pytest.mark.parametrize("family", family_names(mirrored=True, causal=True))
def test_assisted_decoding_with_an_assistant_built_from_the_patched_config_equals_greedy(family):
    """transformers' test_assisted_decoding_matches_greedy_search with its random assistant,
    ``model_class(config)``: the target's live scorers decide every token, whatever the assistant drafts."""
    model = hf_neural_attn.patch_model(tiny_model(family), "qana", h=2)
    perturb_scorers(model, std=1.0)
    torch.manual_seed(3)
    assistant = type(model)(model.config).eval()
    prompt = model_inputs(family, batch=1, seq=6)["input_ids"]
    settings = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
    greedy = model.generate(prompt, **settings)
    assert torch.equal(model.generate(prompt, assistant_model=assistant, **settings), greedy)


def test_a_recorded_patch_that_fails_to_plan_leaves_the_model_on_its_configs():
    """``patch_as_recorded`` (what building a model from a patched config runs) gives the model private copies of its
    configs before it plans; a plan that fails (here the record names a layer the model lacks) puts back the config
    objects the model and its modules held, and the model stays unpatched."""
    source = hf_neural_attn.patch_model(tiny_model("llama"), "qana", h=2, layers=[1])
    recorded = copy.deepcopy(source.config)
    recorded.num_hidden_layers = 1  # the record's layer 1 is not there
    model = tiny_model("llama", num_hidden_layers=1)
    holders = [module for module in model.modules() if isinstance(vars(module).get("config"), PretrainedConfig)]
    for module in holders:  # the model as transformers builds it from the patched config: every module shares it
        module.config = recorded
    with pytest.raises(ValueError, match="layer"):
        patch_as_recorded(model, recorded)
    assert all(module.config is recorded for module in holders) and len(holders) > 1
    assert not hf_neural_attn.is_patched(model)
