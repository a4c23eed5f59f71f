"""``patch_model`` as a plan and its application (hf_neural_attn/patch_plan.py), and the loaders on the same plan:
a plan changes nothing in the model until it is applied, and a load searches the model's attention once and changes
the class of no config but the one the patch makes patched."""

from __future__ import annotations

import contextlib
import dataclasses
import sys

import pytest
import torch
from helpers.models import model_inputs, tiny_llama
from transformers import AutoModelForCausalLM, LlamaConfig

import hf_neural_attn
from hf_neural_attn import families
from hf_neural_attn.patch_plan import apply_patch, plan_patch


def model_state(model) -> tuple:
    """What a patch changes in a model: its modules' classes and names, its parameters, its config's class, and the
    names the patch leaves on modules."""
    return (
        [(name, type(module)) for name, module in model.named_modules()],
        {name: (tuple(parameter.shape), parameter.data_ptr()) for name, parameter in model.named_parameters()},
        type(model.config),
        [sorted(vars(module)) for module in model.modules()],
        [len(module._forward_pre_hooks) for module in model.modules()],
    )


@pytest.mark.filterwarnings("ignore:key_dim=4 replaces")
@pytest.mark.parametrize("options", [{}, {"key_dim": 4}], ids=["qana", "qana-key_dim"])
def test_a_plan_changes_nothing_until_it_is_applied(options):
    model = tiny_llama()
    before = model_state(model)
    plan = plan_patch(model, "qana", h=2, layers=[1], options=options)
    assert model_state(model) == before and not hf_neural_attn.is_patched(model)
    assert sorted(plan.scorers) == [1] and plan.record.layers == (1,)
    assert bool(plan.narrow_projections[1]) == bool(options)
    with pytest.raises(dataclasses.FrozenInstanceError):  # frozen: what was checked is what is applied
        plan.record = None
    assert apply_patch(plan) is model and hf_neural_attn.is_patched(model)
    reference = hf_neural_attn.patch_model(tiny_llama(), "qana", h=2, layers=[1], **options)
    assert hf_neural_attn.patch_record(model) == hf_neural_attn.patch_record(reference)
    assert [name for name, _ in model.named_parameters()] == [name for name, _ in reference.named_parameters()]


class LoadCounter:
    """Counts, while :meth:`counting` is open, the attention searches (``find_attention``, wherever the library
    imported it) and the changes of a Llama config's class (``config.__class__ = ...``, as (from, to) names)."""

    def __init__(self, monkeypatch):
        self.searches = 0
        self.class_changes: list[tuple[str, str]] = []
        self.monkeypatch = monkeypatch

    @contextlib.contextmanager
    def counting(self):
        original_search = families.find_attention
        original_setattr = LlamaConfig.__setattr__

        def search(model):
            self.searches += 1
            return original_search(model)

        def setattr_(config, name, value):
            if name == "__class__":
                self.class_changes.append((type(config).__name__, value.__name__))
            return original_setattr(config, name, value)

        with self.monkeypatch.context() as patch:
            for name, module in list(sys.modules.items()):
                if name.startswith("hf_neural_attn") and getattr(module, "find_attention", None) is original_search:
                    patch.setattr(module, "find_attention", search)
            patch.setattr(LlamaConfig, "__setattr__", setattr_)
            yield self


@pytest.mark.filterwarnings("ignore:key_dim=4 replaces")
@pytest.mark.parametrize("options", [{}, {"key_dim": 4}], ids=["qana", "qana-key_dim"])
def test_a_load_searches_the_attention_once_and_patches_the_config_once(options, tmp_path, monkeypatch):
    model = hf_neural_attn.patch_model(tiny_llama(), "qana", h=2, layers=[1], **options)
    model.save_pretrained(tmp_path)
    inputs = model_inputs("llama")
    with torch.no_grad():
        expected = model(**inputs).logits

    library = LoadCounter(monkeypatch)
    with library.counting():
        loaded = hf_neural_attn.from_pretrained(tmp_path)
    # One search, made by the loader and handed to the patch's plan; the config.json is read as the base config
    # with its record, the base model built from it, and the patch makes that config patched: one class change.
    assert library.searches == 1
    assert library.class_changes == [("LlamaConfig", "LlamaConfigWithNeuralAttn")]

    auto = LoadCounter(monkeypatch)
    with auto.counting():
        loaded_by_auto = AutoModelForCausalLM.from_pretrained(tmp_path)
    # transformers' AutoConfig reads the checkpoint's config as a patched config (which routes the load to the
    # library); the loader's base copy is made as the base class, never switched back, and the patch switches once.
    assert auto.searches == 1
    assert auto.class_changes == [("LlamaConfig", "LlamaConfigWithNeuralAttn")] * 2
    for reloaded in (loaded, loaded_by_auto):
        with torch.no_grad():
            torch.testing.assert_close(reloaded(**inputs).logits, expected, rtol=0, atol=1e-5)
