"""Models whose layers accelerate offloads to the CPU or disk, from the user's side.

accelerate offloads a module by leaving meta tensors in it and a hook that loads them for each call
(``cpu_offload``, ``dispatch_model`` with "disk" entries, ``from_pretrained(device_map=..., offload_folder=...)``).
Patching such a model works: the query weights are loaded while the patch reads them, the new scorers live on the
module's execution device, and the base weights stay offloaded. A model patched first and offloaded afterwards
has its scorers offloaded with their layers, and loaded for each call. Checkpoints and adapters load with an offloading
``device_map`` and reproduce the saved model; saving from an offloaded model round-trips.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from accelerate import cpu_offload, dispatch_model, init_empty_weights
from accelerate.hooks import ModelHook, add_hook_to_module
from helpers.models import TINY_DECODER, model_inputs, perturb_scorers, tiny_llama
from helpers.scorers import FUSED_SCORERS
from transformers import LlamaConfig, LlamaForCausalLM

import hf_neural_attn

# Layer 1 on "disk" (accelerate keeps its tensors in offload_dir and loads them per call); the rest on the CPU.
DISK_LAYER_1 = {
    "model.embed_tokens": "cpu",
    "model.rotary_emb": "cpu",
    "model.layers.0": "cpu",
    "model.layers.1": "disk",
    "model.norm": "cpu",
    "lm_head": "cpu",
}
INPUTS = model_inputs("llama")


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(**INPUTS).logits


def _offloaded_layer_is_still_offloaded(model) -> bool:
    """The disk layer's base weights are meta (loaded per call), its scorer's parameters are real tensors."""
    attention = model.model.layers[1].self_attn
    scorer_real = all(not p.is_meta for p in attention.attn_scorer.parameters())
    return attention.q_proj.weight.is_meta and attention.o_proj.weight.is_meta and scorer_real


@pytest.mark.parametrize("scorer", FUSED_SCORERS)
def test_patching_a_disk_offloaded_model(scorer, tmp_path):
    """Patch after dispatch_model with a disk layer: the patched model equals the unpatched one at init (1e-5),
    the offloaded layer stays offloaded, trained scorers change the outputs, unpatching restores them exactly."""
    model = tiny_llama()
    reference = _logits(model)
    dispatch_model(model, DISK_LAYER_1, offload_dir=str(tmp_path))
    hf_neural_attn.patch_model(model, scorer)
    assert _offloaded_layer_is_still_offloaded(model)
    torch.testing.assert_close(_logits(model), reference, atol=1e-5, rtol=1e-5)
    perturb_scorers(model)
    assert (_logits(model) - reference).abs().max() > 1e-4
    hf_neural_attn.unpatch_model(model)
    torch.testing.assert_close(_logits(model), reference, atol=0, rtol=0)


@pytest.mark.parametrize("scorer", FUSED_SCORERS)
def test_patched_model_offloaded_afterwards(scorer, tmp_path):
    """Patch first, then dispatch with a disk layer: accelerate offloads the scorer with its layer, the
    attention function loads it for each call, and the logits and greedy generation stay the same."""
    model = hf_neural_attn.patch_model(tiny_llama(), scorer)
    perturb_scorers(model)
    reference = _logits(model)
    prompt = INPUTS["input_ids"][:1]
    expected = model.generate(prompt, max_new_tokens=4, do_sample=False)
    dispatch_model(model, DISK_LAYER_1, offload_dir=str(tmp_path))
    offloaded_scorer = model.model.layers[1].self_attn.attn_scorer
    assert all(p.is_meta for p in offloaded_scorer.parameters())
    torch.testing.assert_close(_logits(model), reference, atol=1e-6, rtol=0)
    assert torch.equal(model.generate(prompt, max_new_tokens=4, do_sample=False), expected)
    assert all(p.is_meta for p in offloaded_scorer.parameters())  # back on disk after each call


def test_patching_a_cpu_offloaded_model_reads_the_real_query_weights():
    """cpu_offload leaves every weight on meta; the scorers are drawn at the std of the real query weights (as
    on the model before offloading), not at the config's initializer_range."""
    plain = tiny_llama()
    reference = _logits(plain)
    expected_std = float(plain.model.layers[0].self_attn.q_proj.weight.detach().std())
    cpu_offload(plain, execution_device="cpu")
    hf_neural_attn.patch_model(plain, "qana")
    geometry = plain.model.layers[0].self_attn.attn_scorer.geometry
    assert geometry.query_weight_std == pytest.approx(expected_std, rel=1e-6)
    assert geometry.device == torch.device("cpu")
    assert plain.model.layers[0].self_attn.q_proj.weight.is_meta
    torch.testing.assert_close(_logits(plain), reference, atol=1e-5, rtol=1e-5)


def test_checkpoint_loads_with_an_offloading_device_map(tmp_path):
    """from_pretrained(device_map with "disk", offload_folder) reproduces the saved model's logits and greedy
    generation; save_pretrained from the offloaded model reloads (without offloading) as the same model."""
    model = hf_neural_attn.patch_model(tiny_llama(), "qana")
    perturb_scorers(model)
    reference = _logits(model)
    prompt = INPUTS["input_ids"][:1]
    expected = model.generate(prompt, max_new_tokens=4, do_sample=False)
    model.save_pretrained(tmp_path / "checkpoint")
    loaded = hf_neural_attn.from_pretrained(
        tmp_path / "checkpoint", device_map=DISK_LAYER_1, offload_folder=tmp_path / "offload"
    )
    assert _offloaded_layer_is_still_offloaded(loaded)
    torch.testing.assert_close(_logits(loaded), reference, atol=1e-6, rtol=0)
    assert torch.equal(loaded.generate(prompt, max_new_tokens=4, do_sample=False), expected)
    loaded.save_pretrained(tmp_path / "resaved")
    torch.testing.assert_close(
        _logits(hf_neural_attn.from_pretrained(tmp_path / "resaved")), reference, atol=1e-6, rtol=0
    )


def test_adapter_loads_and_saves_with_an_offloading_device_map(tmp_path):
    """An adapter loads onto an offloaded base (its base checksums are checked on the offloaded weights), and
    save_adapter from that model compares the offloaded base with the base folder without a false warning."""
    base = tiny_llama()
    base.save_pretrained(tmp_path / "base")
    model = hf_neural_attn.patch_model(LlamaForCausalLM.from_pretrained(tmp_path / "base"), "neural")
    perturb_scorers(model)
    reference = _logits(model)
    hf_neural_attn.save_adapter(model, tmp_path / "adapter", base_model_name_or_path=str(tmp_path / "base"))
    loaded = hf_neural_attn.from_pretrained(
        tmp_path / "adapter", device_map=DISK_LAYER_1, offload_folder=tmp_path / "offload"
    )
    assert _offloaded_layer_is_still_offloaded(loaded)
    torch.testing.assert_close(_logits(loaded), reference, atol=1e-6, rtol=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        hf_neural_attn.save_adapter(loaded, tmp_path / "again", base_model_name_or_path=str(tmp_path / "base"))


def test_adapter_refuses_a_changed_offloaded_base(tmp_path):
    """The base checksums are read from offloaded weights too: a changed base is refused."""
    base = tiny_llama()
    base.save_pretrained(tmp_path / "base")
    model = hf_neural_attn.patch_model(LlamaForCausalLM.from_pretrained(tmp_path / "base"), "neural")
    hf_neural_attn.save_adapter(model, tmp_path / "adapter", base_model_name_or_path=str(tmp_path / "base"))
    with torch.no_grad():
        base.model.layers[1].self_attn.q_proj.weight.add_(0.1)  # the last layer: one the checksums cover
    base.save_pretrained(tmp_path / "base")
    with pytest.raises(ValueError, match="q_proj"):
        hf_neural_attn.from_pretrained(tmp_path / "adapter", device_map=DISK_LAYER_1, offload_folder=tmp_path / "off")


def test_meta_weights_under_an_unknown_hook_are_refused_and_nothing_changes():
    """Meta weights with an accelerate hook that does not offload (nothing can load them): a ValueError that
    names offloading, and the model is left as it was."""
    with init_empty_weights():
        model = LlamaForCausalLM(LlamaConfig(**TINY_DECODER))
    add_hook_to_module(model.model.layers[0].self_attn.q_proj, ModelHook())
    names = sorted(name for name, _ in model.named_parameters())
    with pytest.raises(ValueError, match="offloaded"):
        hf_neural_attn.patch_model(model, "qana")
    assert not hf_neural_attn.is_patched(model)
    assert not hasattr(model.config, "hf_neural_attn")
    assert sorted(name for name, _ in model.named_parameters()) == names
