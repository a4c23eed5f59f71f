"""Edges a day of ordinary use met, each tested the way it was met: records say what was computed, a bad argument or
an edited file is a ValueError or TypeError naming it (with nothing changed), an option the loaders cannot serve
is refused at load, and what the docs claim about the static cache holds.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from helpers.checkpoints import edit_json, edit_record
from helpers.models import logits, model_inputs, perturb_scorers, tiny_gpt2, tiny_llama
from transformers import GPT2LMHeadModel

import hf_neural_attn
from hf_neural_attn.ops.triton import triton_unavailable_reason


def save_full(folder: Path, model=None, scorer: str = "qana", **options):
    model = model if model is not None else tiny_llama()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # from-scratch options warn; not what these tests look at
        hf_neural_attn.patch_model(model, scorer, h=2, **options)
    perturb_scorers(model)
    model.save_pretrained(folder)
    return model


# --- records say what was computed ------------------------------------------------------------------------------


@pytest.mark.parametrize("factory,expected", [(tiny_llama, "relative"), (tiny_gpt2, "concat")], ids=["llama", "gpt2"])
def test_neural_attention_records_the_pair_input_it_computes(factory, expected):
    model = hf_neural_attn.patch_model(factory(), "neural", h=2)
    record = hf_neural_attn.patch_record(model)
    assert record.options["pair_input"] == expected
    assert all(module.pair_input == expected for module in model.modules() if hasattr(module, "pair_input"))


def test_a_record_saved_with_pair_input_auto_loads_as_it_was(tmp_path):
    """Checkpoints written before the resolved value was recorded say "auto"; they load by the rule they were
    saved under (relative on a RoPE model without proj_dim) and give the saved outputs."""
    model = save_full(tmp_path, scorer="neural")
    edit_record(tmp_path, "full", lambda record: record["options"].update(pair_input="auto"))
    loaded = hf_neural_attn.from_pretrained(tmp_path)
    assert hf_neural_attn.patch_record(loaded).options["pair_input"] == "relative"
    inputs = model_inputs("llama")
    torch.testing.assert_close(logits(loaded, inputs), logits(model, inputs), rtol=0, atol=1e-6)


@pytest.mark.parametrize("scorer", ["neural", "additive"])
def test_replace_mode_warns_that_it_changes_the_outputs(scorer):
    with pytest.warns(UserWarning, match="mode='replace'.*differ from the original's") as caught:
        hf_neural_attn.patch_model(tiny_gpt2(), scorer, mode="replace")
    assert caught[0].filename == __file__


# --- bad arguments and edited files: errors that name them, nothing changed -------------------------------------


def test_layers_given_as_a_mapping_is_refused_and_changes_nothing():
    model = tiny_llama()
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    with pytest.raises(ValueError, match="layers must be None .* got \\{0: 1\\}"):
        hf_neural_attn.patch_model(model, "qana", layers={0: 1})
    assert not hf_neural_attn.is_patched(model)
    assert all(torch.equal(tensor, before[name]) for name, tensor in model.state_dict().items())


def test_scorer_parameters_of_something_that_is_not_a_model():
    with pytest.raises(TypeError, match="scorer_parameters expects a model .* got NoneType"):
        hf_neural_attn.scorer_parameters(None)


def test_model_class_given_as_a_string_or_of_another_kind(tmp_path):
    save_full(tmp_path)
    with pytest.raises(TypeError, match="model_class must be a transformers model class.*'LlamaForCausalLM'"):
        hf_neural_attn.from_pretrained(tmp_path, model_class="LlamaForCausalLM")
    with pytest.raises(ValueError, match="model_class=GPT2LMHeadModel builds GPT2Config models.*'llama' model"):
        hf_neural_attn.from_pretrained(tmp_path, model_class=GPT2LMHeadModel)


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("family", "banana", "field 'family'.*names no model family.*'banana'"),
        ("base_attn_implementation", "banana", "field 'base_attn_implementation'.*no attention implementation"),
        ("layers", [0, 5], "field 'layers'.*names attention layer 5, but the model has 2"),
    ],
)
def test_an_edited_record_in_config_json_is_named(tmp_path, field, value, message):
    save_full(tmp_path)
    edit_record(tmp_path, "full", lambda record: record.update({field: value}))
    with pytest.raises(ValueError, match=f"config.json is damaged: {message}"):
        hf_neural_attn.from_pretrained(tmp_path)


def test_an_adapter_json_with_a_base_that_is_not_a_name(tmp_path):
    base = tmp_path / "base"
    tiny_llama().save_pretrained(base)
    model = type(tiny_llama()).from_pretrained(base)
    hf_neural_attn.patch_model(model, "qana", h=2)
    hf_neural_attn.save_adapter(model, tmp_path / "adapter")
    edit_json(tmp_path / "adapter" / "hf_neural_attn_adapter.json", lambda m: m.update(base_model_name_or_path=5))
    with pytest.raises(ValueError, match="hf_neural_attn_adapter.json is damaged: base_model_name_or_path .* got 5"):
        hf_neural_attn.from_pretrained(tmp_path / "adapter")
    loaded = hf_neural_attn.from_pretrained(tmp_path / "adapter", base_model_name_or_path=base)  # the way out
    assert hf_neural_attn.is_patched(loaded)


def test_a_local_folder_that_does_not_exist_is_named(tmp_path):
    missing = tmp_path / "no-such-checkpoint"
    with pytest.raises(ValueError, match=f"path_or_repo_id '{missing}' is not a folder on this machine"):
        hf_neural_attn.from_pretrained(missing)
    with pytest.raises(ValueError, match="not a folder on this machine"):
        hf_neural_attn.from_pretrained("./no-such-checkpoint")


def test_an_implementation_name_transformers_does_not_know_is_refused():
    model = hf_neural_attn.patch_model(tiny_llama(), "qana", h=2)
    with pytest.raises(ValueError, match="'banana' is not an attention implementation transformers knows"):
        model.config._attn_implementation = "banana"
    assert model.config.base_attn_implementation == "sdpa"


# --- key_dim: offloading refused at load; the static cache works -------------------------------------------------


def test_key_dim_with_disk_offload_is_refused_at_load(tmp_path):
    save_full(tmp_path / "ckpt", key_dim=4)
    device_map = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
                  "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}  # fmt: skip
    with pytest.raises(ValueError, match="key_dim=4.*offloading cannot hold.*device_map='cpu'"):
        hf_neural_attn.from_pretrained(tmp_path / "ckpt", device_map=device_map, offload_folder=tmp_path / "off")
    with pytest.raises(ValueError, match="key_dim=4.*offloading cannot hold"):
        hf_neural_attn.from_pretrained(
            tmp_path / "ckpt", device_map="auto", max_memory={"cpu": "20KB"}, offload_folder=tmp_path / "off"
        )
    loaded = hf_neural_attn.from_pretrained(tmp_path / "ckpt", device_map="cpu")  # one device: fine
    assert hf_neural_attn.patch_record(loaded).scorer_config().narrow_key_dim == 4


def test_key_dim_decodes_the_same_with_the_static_cache():
    model = tiny_llama()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf_neural_attn.patch_model(model, "qana", h=2, key_dim=4)
    perturb_scorers(model)
    prompt = model_inputs("llama", seq=6)["input_ids"]
    settings = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
    dynamic = model.generate(prompt, **settings)
    static = model.generate(prompt, cache_implementation="static", **settings)
    assert torch.equal(static, dynamic)


# --- messages say what the code does -----------------------------------------------------------------------------


def test_impl_triton_where_it_cannot_run_is_refused_at_load_as_at_patch_time(tmp_path):
    """The same error from patch_model and from_pretrained, before the checkpoint loads (a recorded impl no longer
    decides, so there is no fallback to announce)."""
    reason = triton_unavailable_reason()
    if reason is None:
        pytest.skip("Triton can run here")
    save_full(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"")  # the choice is checked before any weight is read
    with pytest.raises(ValueError) as at_patch:
        hf_neural_attn.patch_model(tiny_llama(), "qana", impl="triton")
    with pytest.raises(ValueError) as at_load:
        hf_neural_attn.from_pretrained(tmp_path, impl="triton")
    assert str(at_load.value) == str(at_patch.value) == reason
