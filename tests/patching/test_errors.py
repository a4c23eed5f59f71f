"""Contract 7: bad input gets a clear error, and a failed call leaves the model exactly as it was."""

import pytest
import torch
from helpers.models import CORE_FAMILIES, logits, model_inputs, tiny_gpt2, tiny_llama, tiny_model
from transformers import ResNetConfig, ResNetForImageClassification

import hf_neural_attn
from hf_neural_attn.families import FAMILIES


def snapshot(model, family="llama"):
    """Everything a patch could change: parameters, buffers, config, module tree, hooks, outputs."""
    return {
        "state": {name: tensor.clone() for name, tensor in model.state_dict().items()},
        "config": model.config.to_dict(),
        "attn": model.config._attn_implementation,
        "modules": [name for name, _ in model.named_modules()],
        "hooks": sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()),
        "attributes": sorted(k for m in model.modules() for k in vars(m) if "neural_attn" in k),
        "logits": logits(model, model_inputs(family)),
    }


def assert_unchanged(model, before, family="llama"):
    after = snapshot(model, family)
    assert after["state"].keys() == before["state"].keys()
    for name in before["state"]:
        assert torch.equal(after["state"][name], before["state"][name]), name
    for key in ("config", "attn", "modules", "hooks", "attributes"):
        assert after[key] == before[key], key
    assert torch.equal(after["logits"], before["logits"])


BAD_CALLS = [
    (("cosine",), {}, r"Unknown scorer 'cosine'.*\['additive', 'general', 'hea', 'neural', 'nsea', 'qana'\]"),
    (("qana",), {"h": 0}, r"\bh must be a positive integer.*h=0"),
    (("neural",), {"h": -2}, r"\bh must be a positive integer"),
    (("qana",), {"h": 2.5}, r"\bh must be a positive integer"),
    (("neural",), {"proj_dim": 0}, r"proj_dim must be a positive integer"),
    (("qana",), {"proj_dim": 2}, r"Unknown option.*'proj_dim'.*qana"),
    (("neural",), {"hidden": 4}, r"Unknown option.*'hidden'"),
    (("neural",), {"mode": "sum"}, r"mode='sum'.*'replace', 'residual'"),
    (("qana",), {"activation": "swish2"}, r"activation='swish2'"),
    (("qana",), {"init": "xavier"}, r"init='xavier'"),
    (("neural",), {"mode": "replace", "init": "zero"}, r"init='zero' only applies"),
    (("qana",), {"layers": [2]}, r"Layer index 2 is out of range.*2 attention layers"),
    (("qana",), {"layers": [-3]}, r"Layer index -3 is out of range"),
    (("qana",), {"layers": []}, r"layers is empty"),
    (("qana",), {"layers": ["0"]}, r"layers must be None \(every layer\), a layer index or a list"),
    ((hf_neural_attn.QanaConfig(),), {"h": 3}, r"either a scorer config object or a scorer name"),
    (("neural",), {"proj_bias": True}, r"proj_bias=True gives the down-projections a bias, and proj_dim=None"),
    (("neural",), {"proj_dim": 2, "scale_mlp": False}, r"scale_mlp=False applies to mode='replace'"),
    (("neural",), {"proj_dim": 2, "proj_bias": 1}, r"proj_bias must be True or False"),
]


@pytest.mark.parametrize("args,kwargs,message", BAD_CALLS)
def test_bad_arguments_raise_value_error_and_change_nothing(args, kwargs, message):
    model = tiny_llama()
    before = snapshot(model)
    with pytest.raises(ValueError, match=message):
        hf_neural_attn.patch_model(model, *args, **kwargs)
    assert_unchanged(model, before)


@pytest.mark.parametrize("family", [name for name in CORE_FAMILIES if name != "llama"])  # Llama: the test above
@pytest.mark.parametrize("args,kwargs,message", [BAD_CALLS[1], BAD_CALLS[5], BAD_CALLS[11]])
def test_bad_arguments_change_nothing_in_other_families(family, args, kwargs, message):
    model = tiny_model(family)
    before = snapshot(model, family)
    with pytest.raises(ValueError, match=message):
        hf_neural_attn.patch_model(model, *args, **kwargs)
    assert_unchanged(model, before, family)


def test_wrong_scorer_type_is_a_type_error():
    with pytest.raises(TypeError, match="scorer name or config object"):
        hf_neural_attn.patch_model(tiny_llama(), 4)


def test_init_zero_warning_points_at_the_caller():
    with pytest.warns(UserWarning, match="no gradient") as caught:
        hf_neural_attn.patch_model(tiny_llama(), "qana", init="zero")
    assert caught[0].filename == __file__


def test_config_object_is_copied_not_shared():
    config = hf_neural_attn.QanaConfig(h=2)
    model = tiny_llama()
    hf_neural_attn.patch_model(model, config)
    config.h = 3  # the caller's object changes; the patched model must not
    assert model.config.hf_neural_attn["options"]["h"] == 2
    logits(model, model_inputs("llama"))


def test_model_without_supported_attention_is_a_type_error_naming_the_families():
    config = ResNetConfig(embedding_size=8, hidden_sizes=[8, 8], depths=[1, 1], num_labels=2)
    model = ResNetForImageClassification(config)
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    with pytest.raises(TypeError, match="no attention module hf_neural_attn can patch") as raised:
        hf_neural_attn.patch_model(model, "qana")
    for family_name in FAMILIES:
        assert f"'{family_name}'" in str(raised.value)
    assert not hasattr(model.config, "hf_neural_attn")
    assert all(torch.equal(model.state_dict()[name], tensor) for name, tensor in state.items())


def test_non_transformers_module_is_a_type_error():
    with pytest.raises(TypeError, match="PreTrainedModel.*Supported families"):
        hf_neural_attn.patch_model(torch.nn.Linear(4, 4), "qana")


def test_patching_twice_is_refused_and_keeps_the_first_patch():
    model = tiny_llama()
    hf_neural_attn.patch_model(model, "neural", proj_dim=2, layers=[0])
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"already patched with scorer 'neural' on layers \[0\].*unpatch_model"):
        hf_neural_attn.patch_model(model, "qana")
    assert_unchanged(model, before)


def test_unpatching_an_unpatched_model_is_refused():
    model = tiny_gpt2()
    with pytest.raises(ValueError, match="not patched"):
        hf_neural_attn.unpatch_model(model)


def test_options_are_validated_on_config_objects_too():
    with pytest.raises(ValueError, match="proj_dim"):
        hf_neural_attn.NeuralAttentionConfig(proj_dim=-1)
    config = hf_neural_attn.QanaConfig()
    config.h = 0  # mutated after construction: patch_model validates again
    model = tiny_llama()
    before = snapshot(model)
    with pytest.raises(ValueError, match="h must be a positive integer"):
        hf_neural_attn.patch_model(model, config)
    assert_unchanged(model, before)


def test_setting_the_attention_name_by_hand_without_patching_is_a_clear_error():
    model = tiny_llama()
    model.config._attn_implementation = "hf_neural_attn"
    with pytest.raises(RuntimeError, match="was not patched.*patch_model"):
        logits(model, model_inputs("llama"))


def test_a_record_changed_in_memory_is_not_blamed_on_a_file():
    """The record on a config object (written by patch_model, changed since) is no file's: its message names the
    config and what to do, not a file to restore."""
    model = hf_neural_attn.patch_model(tiny_llama(), "qana")
    model.config.hf_neural_attn["layers"] = "all"
    with pytest.raises(ValueError) as error:
        hf_neural_attn.patch_record(model)
    message = str(error.value)
    assert "this model's config (LlamaConfigWithNeuralAttn) carries (config.hf_neural_attn) is not valid" in message
    assert "field 'layers'" in message and "Patch the model again" in message
    assert "restore the file" not in message and "/hf_neural_attn" not in message
