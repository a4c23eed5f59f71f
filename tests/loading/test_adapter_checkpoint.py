"""Adapter-only checkpoints: save_adapter / push_adapter_to_hub write the scorer tensors, the patch record and the
base model's id; hf_neural_attn.from_pretrained(adapter) loads the base model, patches it and fills the tensors.

The round trip of every kind of checkpoint, adapters included: tests/loading/test_checkpoint.py. Everything runs
offline: base models are saved to local folders. Pushing adapters to the Hub and loading them by repo id:
tests/integrations/test_hub_http.py (a Hub-compatible server on 127.0.0.1). Damaged adapters:
tests/loading/test_damaged_checkpoints.py."""

import json

import pytest
import torch
from helpers.checkpoints import load_patched, save_base, save_checkpoint
from helpers.models import logits, model_inputs, perturb_scorers, tiny_gpt2, tiny_llama
from safetensors.torch import load_file

import hf_neural_attn
from hf_neural_attn.loading.adapters import ADAPTER_CONFIG_NAME, ADAPTER_WEIGHTS_NAME

ADAPTER_FILES = {ADAPTER_CONFIG_NAME, ADAPTER_WEIGHTS_NAME, "README.md"}


def test_an_adapter_holds_the_scorer_tensors_and_names_its_base(tmp_path, family, scorer_name):
    model, adapter = save_checkpoint(tmp_path, "adapter", family, scorer_name)
    base = tmp_path / "base"  # where save_checkpoint saved the base model

    # Only the adapter's three small files: the tensors, the JSON, the card; no base weight.
    assert {path.name for path in adapter.iterdir()} == ADAPTER_FILES
    saved = load_file(adapter / ADAPTER_WEIGHTS_NAME)
    scorer_params = hf_neural_attn.scorer_parameters(model)
    assert len(saved) == len(scorer_params)
    assert sorted(t.numel() for t in saved.values()) == sorted(p.numel() for p in scorer_params.values())
    assert all(".attn_scorer." in name for name in saved)
    weights_bytes = (adapter / ADAPTER_WEIGHTS_NAME).stat().st_size
    assert weights_bytes < 4 * sum(p.numel() for p in scorer_params.values()) + 4096  # fp32 tensors + header
    assert weights_bytes < (base / "model.safetensors").stat().st_size
    metadata = json.loads((adapter / ADAPTER_CONFIG_NAME).read_text())
    assert metadata["base_model_name_or_path"] == str(base.resolve())
    assert metadata["architectures"] == [type(model).__name__]
    assert metadata["patch"] == model.config.hf_neural_attn


def test_options_layers_and_attention_implementation_survive(tmp_path):
    base = save_base(tmp_path / "base", attn_implementation="eager")
    model = type(tiny_llama()).from_pretrained(base, attn_implementation="eager").eval()
    hf_neural_attn.patch_model(model, "neural", h=3, proj_dim=2, layers=[-1])
    perturb_scorers(model)
    hf_neural_attn.save_adapter(model, tmp_path / "adapter")
    loaded = hf_neural_attn.from_pretrained(tmp_path / "adapter")
    assert loaded.config.hf_neural_attn == model.config.hf_neural_attn
    assert loaded.config.hf_neural_attn["layers"] == [1]
    inputs = model_inputs("llama")
    assert torch.equal(logits(loaded, inputs), logits(model, inputs))
    hf_neural_attn.unpatch_model(loaded)
    assert loaded.config._attn_implementation == "eager"


def test_hf_kwargs_reach_the_base_model(tmp_path):
    model, adapter = save_checkpoint(tmp_path, "adapter")
    loaded = hf_neural_attn.from_pretrained(adapter, dtype=torch.bfloat16)
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}
    inputs = model_inputs("llama")
    # bf16 keeps ~3 significant digits (same bound as the full-checkpoint test).
    torch.testing.assert_close(logits(loaded, inputs), logits(model.to(torch.bfloat16), inputs), rtol=0, atol=1e-2)


def test_weights_the_base_checkpoint_lacks_are_named(tmp_path):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    base = save_base(tmp_path / "base")  # a causal LM: no classification head in the checkpoint
    model = LlamaForSequenceClassification.from_pretrained(base, num_labels=3)
    hf_neural_attn.patch_model(model, "qana")
    perturb_scorers(model)
    hf_neural_attn.save_adapter(model, tmp_path / "adapter")
    config = LlamaConfig.from_pretrained(base, num_labels=3)
    with pytest.warns(
        UserWarning, match=r"lacks 1 weight.*transformers' load report.*not in the adapter.*Save the full"
    ):
        loaded = hf_neural_attn.from_pretrained(tmp_path / "adapter", config=config)
    assert not hasattr(config, "hf_neural_attn") and config._attn_implementation is None  # caller's config as it was
    saved = hf_neural_attn.scorer_parameters(model)
    assert all(torch.equal(p, saved[n]) for n, p in hf_neural_attn.scorer_parameters(loaded).items())


def test_unknown_base_model_needs_the_argument(tmp_path):
    model = tiny_llama()  # built from a config: model.config.name_or_path is empty
    base = tmp_path / "base"
    model.save_pretrained(base)
    hf_neural_attn.patch_model(model, "qana")
    perturb_scorers(model)
    with pytest.raises(ValueError, match="base model of this model is unknown.*base_model_name_or_path="):
        hf_neural_attn.save_adapter(model, tmp_path / "adapter")
    assert not (tmp_path / "adapter").exists()
    hf_neural_attn.save_adapter(model, tmp_path / "adapter", base_model_name_or_path=base, base_model_revision="v1")
    metadata = json.loads((tmp_path / "adapter" / ADAPTER_CONFIG_NAME).read_text())
    assert metadata["base_model_name_or_path"] == str(base.resolve())
    assert metadata["base_model_revision"] == "v1"  # recorded as given (a local folder ignores it on load)
    inputs = model_inputs("llama")
    torch.testing.assert_close(
        logits(hf_neural_attn.from_pretrained(tmp_path / "adapter"), inputs), logits(model, inputs), rtol=0, atol=1e-6
    )


def test_moved_base_model_is_found_with_an_override(tmp_path):
    model, adapter = save_checkpoint(tmp_path, "adapter")
    moved = tmp_path / "elsewhere"
    (tmp_path / "base").rename(moved)
    with pytest.raises(
        OSError, match="(?s)needs its base model.*does not exist on this machine.*base_model_name_or_path="
    ):
        hf_neural_attn.from_pretrained(adapter)
    loaded = hf_neural_attn.from_pretrained(adapter, base_model_name_or_path=moved)
    inputs = model_inputs("llama")
    torch.testing.assert_close(logits(loaded, inputs), logits(model, inputs), rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    "wrong_base,message",
    [
        (lambda folder: save_base(folder, hidden_size=48), "other shapes"),
        (lambda folder: save_base(folder, num_hidden_layers=1), "patches attention layers \\[0, 1\\].* has 1"),
        (lambda folder: save_base(folder, "gpt2"), "'llama' model.* 'gpt2' model"),
    ],
    ids=["wider", "fewer-layers", "other-family"],
)
def test_wrong_base_model_is_refused(tmp_path, wrong_base, message):
    _, adapter = save_checkpoint(tmp_path, "adapter")
    with pytest.raises(ValueError, match=message):
        hf_neural_attn.from_pretrained(adapter, base_model_name_or_path=wrong_base(tmp_path / "wrong"))


def test_save_adapter_refuses_what_it_cannot_save(tmp_path):
    from peft import LoraConfig, get_peft_model

    base = save_base(tmp_path / "base")
    plain = type(tiny_llama()).from_pretrained(base)
    with pytest.raises(ValueError, match="not patched"):
        hf_neural_attn.save_adapter(plain, tmp_path / "a")
    model = load_patched(base)
    # A folder holding a full checkpoint is refused, and left as it was.
    with pytest.raises(ValueError, match="full model checkpoint"):
        hf_neural_attn.save_adapter(model, base)
    assert not (base / ADAPTER_CONFIG_NAME).exists()
    peft_model = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"]))
    with pytest.raises(TypeError, match="not a PEFT model"):
        hf_neural_attn.save_adapter(peft_model, tmp_path / "a")
    assert not (tmp_path / "a").exists()


def test_base_override_is_refused_for_a_full_checkpoint(tmp_path):
    model = tiny_gpt2()
    hf_neural_attn.patch_model(model, "qana")
    model.save_pretrained(tmp_path / "full")
    with pytest.raises(ValueError, match="not an adapter-only checkpoint"):
        hf_neural_attn.from_pretrained(tmp_path / "full", base_model_name_or_path=tmp_path / "full")
