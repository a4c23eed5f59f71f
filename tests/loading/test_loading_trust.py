"""Loading never silently gives a different model: from the user's side, build a tiny model from a config, patch,
save, load, and compare logits, files and errors.

* the compute path (``impl``) is a run-time setting: a checkpoint whose record carries one (older versions saved
  it, ``"triton"`` on GPU machines) loads as it would without it, on the ``impl=`` asked for on load (more in
  tests/ops/test_impl_runtime.py);
* an adapter records checksums of its base weights: saving one after training the base warns, and loading one
  on other base weights raises;
* ``from_pretrained`` takes what transformers' ``from_pretrained`` takes (config overrides, ``output_loading_info``,
  ``ignore_mismatched_sizes``, ``dtype``, ``device_map``, ``revision``, ``model_class``);
* the adapter's model card says how to load it.

Damaged records and files: tests/loading/test_damaged_checkpoints.py.
"""

import json
import warnings

import pytest
import torch
from helpers.checkpoints import CHECKPOINT_KINDS, edit_record, save_checkpoint
from helpers.models import logits, model_inputs, tiny_llama
from helpers.paths import scorer_impls
from transformers import LlamaModel

import hf_neural_attn
from hf_neural_attn.loading.adapters import ADAPTER_CONFIG_NAME, ADAPTER_WEIGHTS_NAME

# ------------------------------------------------------------------------------------ the compute path (5)


@pytest.mark.parametrize("kind", CHECKPOINT_KINDS)
def test_a_checkpoint_that_recorded_impl_loads_on_the_path_asked_for(tmp_path, kind):
    model, folder = save_checkpoint(tmp_path, kind)

    # As older versions saved it on a GPU machine: a record of format 1 (no format number) with impl="triton" in its
    # options (patching with it needs no GPU).
    def as_saved_before_format_2(record):
        record.pop("format", None)
        record["options"].update(impl="triton")

    edit_record(folder, kind, as_saved_before_format_2)
    inputs = model_inputs("llama")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # read and ignored: nothing to warn about, wherever Triton can or cannot run
        loaded = hf_neural_attn.from_pretrained(folder)
    assert scorer_impls(loaded) == {"auto"}  # the default, not the recorded value
    assert loaded.config.hf_neural_attn == model.config.hf_neural_attn  # a save writes no impl again
    # Same scores on another path: equal to float32 rounding, not bit for bit.
    torch.testing.assert_close(logits(loaded, inputs), logits(model, inputs), rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind", CHECKPOINT_KINDS)
def test_impl_can_be_chosen_on_load(tmp_path, kind):
    model, folder = save_checkpoint(tmp_path, kind)
    inputs = model_inputs("llama")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an explicit choice is not worth a warning
        loaded = hf_neural_attn.from_pretrained(folder, impl="chunked")
    assert scorer_impls(loaded) == {"chunked"}
    assert "impl" not in loaded.config.hf_neural_attn["options"]
    torch.testing.assert_close(logits(loaded, inputs), logits(model, inputs), rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="impl='fast' is not supported; choose one of"):
        hf_neural_attn.from_pretrained(folder, impl="fast")


# --------------------------------------------------------------------------------- adapter base checksums (7)


def test_adapter_records_base_checksums_and_refuses_a_changed_base(tmp_path):
    model, adapter = save_checkpoint(tmp_path, "adapter")
    base = tmp_path / "base"
    checksums = json.loads((adapter / ADAPTER_CONFIG_NAME).read_text())["base_checksums"]
    # The first and last tensor of each kind, so any trained module type, and the top and bottom layers, are seen.
    assert {"model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.q_proj.weight"} <= set(checksums)
    assert "model.embed_tokens.weight" in checksums and not any("attn_scorer" in name for name in checksums)

    # The base folder is overwritten by a fine-tuned version (same shapes, no revision pinned).
    tuned = type(model).from_pretrained(base)
    with torch.no_grad():
        tuned.model.layers[0].self_attn.q_proj.weight.add_(1e-3)
    tuned.save_pretrained(base)
    with pytest.raises(ValueError, match=r"saved on base weights other than.*q_proj.*would not reproduce"):
        hf_neural_attn.from_pretrained(adapter)


def test_saving_an_adapter_after_training_the_base_warns(tmp_path):
    base = tmp_path / "base"
    tiny_llama().save_pretrained(base)
    model = type(tiny_llama()).from_pretrained(base).eval()
    hf_neural_attn.patch_model(model, "qana")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an untouched base saves without a word
        hf_neural_attn.save_adapter(model, tmp_path / "clean")
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.mul_(1.01)  # the base was trained too
    with pytest.warns(UserWarning, match=r"base weights of this model differ.*down_proj.*save_pretrained"):
        hf_neural_attn.save_adapter(model, tmp_path / "trained")
    # What it warned about: that adapter does not load on the untouched base.
    with pytest.raises(ValueError, match="saved on base weights other than"):
        hf_neural_attn.from_pretrained(tmp_path / "trained")


def test_base_checksums_allow_a_lower_precision_load(tmp_path):
    _, adapter = save_checkpoint(tmp_path, "adapter")
    loaded = hf_neural_attn.from_pretrained(adapter, dtype=torch.bfloat16)  # no false alarm from the cast
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}


# ------------------------------------------------------------------------- transformers' keywords (10)


def test_config_overrides_apply_as_in_transformers(tmp_path):
    model, _ = save_checkpoint(tmp_path, "full")
    inputs = model_inputs("llama")
    loaded = hf_neural_attn.from_pretrained(tmp_path / "full", output_hidden_states=True)
    assert loaded.config.output_hidden_states is True
    output = loaded(**inputs)
    assert len(output.hidden_states) == 3
    torch.testing.assert_close(output.logits, logits(model, inputs), rtol=0, atol=1e-6)


def test_output_loading_info_returns_the_model_and_transformers_info(tmp_path):
    save_checkpoint(tmp_path, "full")
    model, info = hf_neural_attn.from_pretrained(tmp_path / "full", output_loading_info=True)
    assert hf_neural_attn.is_patched(model)
    assert {"missing_keys", "unexpected_keys", "mismatched_keys"} <= set(info)
    assert not info["unexpected_keys"] and not info["missing_keys"]  # scorer weights are not "unexpected"

    _, adapter = save_checkpoint(tmp_path / "a", "adapter")
    model, info = hf_neural_attn.from_pretrained(adapter, output_loading_info=True)
    assert hf_neural_attn.is_patched(model) and not info["unexpected_keys"]


def test_dtype_device_map_and_revision_reach_transformers(tmp_path):
    model, _ = save_checkpoint(tmp_path, "full")
    loaded = hf_neural_attn.from_pretrained(tmp_path / "full", device_map="cpu", revision="main", dtype=torch.float64)
    assert {p.dtype for p in loaded.parameters()} == {torch.float64}
    assert {p.device.type for p in loaded.parameters()} == {"cpu"}
    inputs = model_inputs("llama")
    torch.testing.assert_close(logits(loaded, inputs).float(), logits(model, inputs), rtol=0, atol=1e-5)
    _, adapter = save_checkpoint(tmp_path / "a", "adapter")
    loaded = hf_neural_attn.from_pretrained(adapter, device_map="cpu", output_attentions=True)
    assert loaded.config.output_attentions is True


def test_model_class_builds_another_head_of_the_same_checkpoint(tmp_path):
    model, _ = save_checkpoint(tmp_path, "full")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the head's weights left over are expected, as in transformers
        bare = hf_neural_attn.from_pretrained(tmp_path / "full", model_class=LlamaModel)
    assert type(bare) is LlamaModel and hf_neural_attn.is_patched(bare)
    inputs = model_inputs("llama")
    expected = model.model(**inputs).last_hidden_state
    torch.testing.assert_close(bare(**inputs).last_hidden_state, expected, rtol=0, atol=1e-6)
    # The Auto-class integration passes the config object it read.
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tmp_path / "full")
    bare = hf_neural_attn.from_pretrained(tmp_path / "full", model_class=LlamaModel, config=config)
    torch.testing.assert_close(bare(**inputs).last_hidden_state, expected, rtol=0, atol=1e-6)
    _, adapter = save_checkpoint(tmp_path / "a", "adapter")
    assert type(hf_neural_attn.from_pretrained(adapter, model_class=LlamaModel)) is LlamaModel


# -------------------------------------------------------------------------------------------- model card


def test_adapter_card_metadata_and_usage(tmp_path):
    from huggingface_hub import ModelCard

    _, adapter = save_checkpoint(tmp_path, "adapter", "gpt2", "neural")
    card = ModelCard.load(adapter / "README.md")
    assert card.data.library_name == "hf-neural-attn"
    assert card.data.tags == ["hf-neural-attn", "neural"]
    assert "import hf_neural_attn" in card.text and "hf_neural_attn.from_pretrained(" in card.text
    assert ADAPTER_WEIGHTS_NAME in {p.name for p in adapter.iterdir()}
