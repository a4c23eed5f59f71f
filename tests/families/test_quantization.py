"""Quantized bases (bitsandbytes 4-bit and 8-bit, torchao): patched, trained, saved and loaded.

A model quantized by bitsandbytes keeps its projections' weights in packed integer storage, and torchao's weights are
tensor subclasses that refuse most ops: the patch reads their dequantized copies (placement/quantized.py) and builds the
scorers in the dtype the base's activations run in. Each test loads a tiny float model saved by the test with the
scheme's ``quantization_config``, as a user loads a real one; both libraries run on the CPU.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers.models import model_inputs, perturb_scorers, tiny_model
from quantization_helpers import (
    BITSANDBYTES_SCHEMES,
    KERNEL_WARNING,
    SCHEME,
    SCHEME_NAMES,
    cpu_kernel_layers,
    gradients_after_an_evaluation,
    load_quantized,
    quantizable_sizes,
    quantized_tensors,
    repacked_layers,
    save_quantizable_base,
)
from transformers import AutoModelForCausalLM

import hf_neural_attn
from hf_neural_attn.placement.quantized import dense_weight, is_quantized

# float32 activations: the patched model computes the base's dot product on another path (explicit matmul and softmax
# instead of SDPA), so the outputs agree to rounding, well inside this bound.
PRESERVED = 1e-4


@torch.no_grad()
def outputs(model, inputs) -> torch.Tensor:
    return model(**inputs)[0]


@pytest.fixture(scope="module")
def base_folders(tmp_path_factory):
    """family -> a folder holding that tiny float model, saved once for the module."""
    folders = {}

    def folder(family: str):
        if family not in folders:
            folders[family] = save_quantizable_base(tmp_path_factory.mktemp(f"base-{family}"), family)
        return folders[family]

    return folder


def quantized_model(base_folders, family: str, scheme: str):
    return load_quantized(type(tiny_model(family)), base_folders(family), scheme)


def tolerance(model, inputs) -> float:
    """How far the patched model may be from the base: rounding, or, where the base rounds its activations, the spread
    the unpatched model has between its own eager and SDPA attention (measured here, on the same inputs). Two bases
    round them: torchao's int8 dynamic scheme (it quantizes them per call), and bitsandbytes' 4-bit layers on a CPU
    with AVX512-BF16 (their repacked kernel takes its input in bfloat16). A float rounding difference anywhere
    before such a projection can move an activation across a rounding step; elsewhere the spread is 0."""
    implementation = model.config._attn_implementation
    sdpa = outputs(model, inputs)
    model.set_attn_implementation("eager")
    spread = float((outputs(model, inputs) - sdpa).abs().max())
    model.set_attn_implementation(implementation)
    return max(PRESERVED, 4 * spread)


CASES = [
    *[(scheme, "llama") for scheme in SCHEME_NAMES],
    # torchao quantizes nn.Linear layers only: GPT-2's Conv1D projections stay float under it.
    *[(scheme, "gpt2") for scheme in BITSANDBYTES_SCHEMES],
    # The probe of the standard plumbing (a q_proj with a bias; Phi-3's fused qkv_proj) and an encoder.
    *[
        (scheme, family)
        for scheme in ("bnb-nf4", "bnb-int8", "torchao-int8-weight-only")
        for family in ("qwen2", "phi3")
    ],
    ("bnb-nf4", "bert"),
]


@pytest.mark.parametrize("scheme, family", CASES, ids=[f"{s}-{f}" for s, f in CASES])
def test_a_quantized_base_patches_function_preserving_on_every_path(base_folders, scheme, family, scorer_name):
    model = quantized_model(base_folders, family, scheme)
    inputs = model_inputs(family)
    original = outputs(model, inputs)
    atol = tolerance(model, inputs)
    frozen = quantized_tensors(model)
    assert frozen, "the scheme must quantize the base's projections"
    layer_types = {name: type(module) for name, module in model.named_modules()}

    hf_neural_attn.patch_model(model, scorer_name)

    # The scorers are float modules in the dtype of the base's activations, trainable; the base stays as it was.
    scorers = hf_neural_attn.scorer_parameters(model)
    assert scorers and {parameter.dtype for parameter in scorers.values()} == {torch.float32}
    assert not any(is_quantized(parameter) for parameter in scorers.values())
    assert all(layer_types[name] is type(module) for name, module in model.named_modules() if name in layer_types)
    for name, tensor in quantized_tensors(model).items():
        assert torch.equal(tensor, frozen[name]), name
    for impl in ("reference", "chunked", "auto"):
        hf_neural_attn.set_impl(model, impl)
        torch.testing.assert_close(outputs(model, inputs), original, rtol=0, atol=atol, msg=impl)


GENERATION_CASES = [
    *[(scheme, "llama") for scheme in ("bnb-nf4", "bnb-int8", "torchao-int8-weight-only", "torchao-int4-weight-only")],
    *[(scheme, "gpt2") for scheme in ("bnb-nf4", "bnb-int8")],
]


@pytest.mark.parametrize("scheme, family", GENERATION_CASES, ids=[f"{s}-{f}" for s, f in GENERATION_CASES])
def test_a_patched_quantized_model_generates_the_base_tokens_with_the_kv_cache(base_folders, scheme, family):
    model = quantized_model(base_folders, family, scheme)
    prompt = model_inputs(family, batch=1, seq=6)["input_ids"]
    expected = model.generate(prompt, max_new_tokens=8, do_sample=False)
    hf_neural_attn.patch_model(model, "qana")
    for use_cache in (True, False):
        tokens = model.generate(prompt, max_new_tokens=8, do_sample=False, use_cache=use_cache)
        assert torch.equal(tokens, expected), use_cache


def test_the_scorers_take_the_dtype_of_the_base_activations_not_of_its_storage(base_folders):
    """A 4-bit base loaded in bfloat16 runs its activations in bfloat16 (its matmuls in bnb_4bit_compute_dtype,
    whatever that is): the scorers are bfloat16. After prepare_model_for_kbit_training, which casts the float
    parameters to float32, they are float32, whether it ran before or after the patch."""
    peft = pytest.importorskip("peft", reason="pip install 'hf-neural-attn[peft]'")
    from transformers import BitsAndBytesConfig, LlamaForCausalLM

    pytest.importorskip("bitsandbytes", reason="pip install 'hf-neural-attn[quantization]'")
    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    inputs = model_inputs("llama")

    def load():
        return LlamaForCausalLM.from_pretrained(base_folders("llama"), quantization_config=config, dtype=torch.bfloat16)

    model = load()
    hf_neural_attn.patch_model(model, "qana")
    assert {p.dtype for p in hf_neural_attn.scorer_parameters(model).values()} == {torch.bfloat16}
    assert model(**inputs).logits.dtype == torch.bfloat16

    prepared_first = peft.prepare_model_for_kbit_training(load(), use_gradient_checkpointing=False)
    hf_neural_attn.patch_model(prepared_first, "qana")
    patched_first = hf_neural_attn.patch_model(load(), "qana")
    patched_first = peft.prepare_model_for_kbit_training(patched_first, use_gradient_checkpointing=False)
    for model in (prepared_first, patched_first):
        assert {p.dtype for p in hf_neural_attn.scorer_parameters(model).values()} == {torch.float32}
        assert torch.isfinite(model(**inputs).logits).all()


@pytest.mark.parametrize("scheme", ["bnb-nf4", "bnb-int8", "torchao-int8-weight-only"])
def test_training_the_scorers_leaves_the_quantized_base_bit_identical(base_folders, scheme):
    model = quantized_model(base_folders, "llama", scheme)
    hf_neural_attn.patch_model(model, "neural")
    frozen = quantized_tensors(model)
    scorers = hf_neural_attn.scorer_parameters(model)
    before = {name: parameter.detach().clone() for name, parameter in scorers.items()}
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    for parameter in scorers.values():
        parameter.requires_grad_(True)
    optimizer = torch.optim.AdamW(scorers.values(), lr=1e-2)
    inputs = model_inputs("llama")
    model.train()
    for _ in range(3):
        model(**inputs, labels=inputs["input_ids"]).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert all(not torch.equal(before[name], parameter) for name, parameter in scorers.items() if name.endswith("gate"))
    for name, tensor in quantized_tensors(model).items():
        assert torch.equal(tensor, frozen[name]), name


@pytest.mark.parametrize("scheme", ["torchao-int8-dynamic", "torchao-int8-weight-only"])
def test_a_base_whose_activations_torchao_quantizes_is_said_to_train_no_scorer(base_folders, scheme):
    """torchao's int8 dynamic quantization rounds each layer's input at every call, which passes no gradient: the
    patch says so once (the scorers' gradients come back through o_proj), and a training step indeed gives them none.
    Weight-only quantization passes gradients, and nothing is said."""
    model = quantized_model(base_folders, "llama", scheme)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hf_neural_attn.patch_model(model, "qana")
    said = [str(warning.message) for warning in caught if "quantizes the activations" in str(warning.message)]
    perturb_scorers(model, std=0.05)
    inputs = model_inputs("llama")
    model.train()(**inputs, labels=inputs["input_ids"]).loss.backward()
    grads = [p.grad for p in hf_neural_attn.scorer_parameters(model).values()]
    if scheme == "torchao-int8-dynamic":
        assert len(said) == 1 and "will not train" in said[0]
        assert all(grad is None or grad.abs().max() == 0 for grad in grads)
    else:
        assert said == [] and any(grad is not None and grad.abs().max() > 0 for grad in grads)


def patched_4_bit_llama(base_folders, tmp_path, entry: str):
    """A tiny 4-bit NF4 Llama patched with QANA by ``entry`` (``patch_model`` on the quantized base, or
    ``from_pretrained`` of a float patched checkpoint with a ``quantization_config``), its scorers perturbed off their
    init; and the warnings the entry point gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if entry == "patch_model":
            model = hf_neural_attn.patch_model(quantized_model(base_folders, "llama", "bnb-nf4"), "qana")
        else:
            float_model = hf_neural_attn.patch_model(tiny_model("llama", **quantizable_sizes("llama")), "qana")
            float_model.save_pretrained(tmp_path)
            model = hf_neural_attn.from_pretrained(tmp_path, quantization_config=SCHEME["bnb-nf4"].config())
    perturb_scorers(model, std=0.05)
    return model, [str(warning.message) for warning in caught if KERNEL_WARNING in str(warning.message)]


@pytest.mark.parametrize("entry", ["patch_model", "from_pretrained"])
def test_a_patched_4_bit_model_still_trains_its_scorers_after_an_evaluation(base_folders, tmp_path, entry):
    """On a CPU with AVX512-BF16, bitsandbytes (0.50 on) repacks a 4-bit layer for its CPU kernel at the layer's first
    eval-mode forward without gradients, and runs that kernel from then on, in training mode too: it passes no
    gradient, and every scorer gradient comes back through o_proj. The library's entry points turn the kernel off and
    say so, once. (Elsewhere the kernel never runs, nothing is said, and the gradients come as they always do.)"""
    probe = quantized_model(base_folders, "llama", "bnb-nf4")
    on_such_a_cpu = bool(cpu_kernel_layers(probe))
    model, said = patched_4_bit_llama(base_folders, tmp_path, entry)
    scorers = hf_neural_attn.scorer_parameters(model)
    gradients = gradients_after_an_evaluation(model, model_inputs("llama"), scorers)
    missing = [name for name, gradient in gradients.items() if gradient is None or not gradient.abs().sum() > 0]
    assert scorers
    assert missing == []
    assert repacked_layers(model) == [] and cpu_kernel_layers(model) == []
    assert len(said) == (1 if on_such_a_cpu else 0), said


def test_unpatching_a_4_bit_model_turns_bitsandbytes_cpu_kernel_on_again(base_folders):
    """What the patch turned off, unpatch_model turns on: the unpatched model runs as the base did (on a CPU with
    AVX512-BF16, its eval-mode outputs are those of the kernel, its input rounded to bfloat16)."""
    model = quantized_model(base_folders, "llama", "bnb-nf4")
    kernel_layers = cpu_kernel_layers(model)
    if not kernel_layers:
        pytest.skip("bitsandbytes runs no CPU kernel for 4-bit layers here (it needs AVX512-BF16)")
    inputs = model_inputs("llama")
    with pytest.warns(UserWarning, match=KERNEL_WARNING):
        hf_neural_attn.patch_model(model, "qana")
    assert cpu_kernel_layers(model) == []
    hf_neural_attn.unpatch_model(model)
    assert cpu_kernel_layers(model) == kernel_layers
    torch.testing.assert_close(
        outputs(model, inputs), outputs(quantized_model(base_folders, "llama", "bnb-nf4"), inputs), rtol=0, atol=0
    )


def test_a_4_bit_model_evaluated_before_the_patch_is_said_to_train_no_more(base_folders):
    """Layers the kernel repacked already stay so (the patch changes no quantized weight, and the outputs stay the
    base's): the one warning says they pass no gradient and what to do, and ``keep_4bit_trainable`` refuses such a
    model with the model unchanged."""
    model = quantized_model(base_folders, "llama", "bnb-nf4")
    if not cpu_kernel_layers(model):
        pytest.skip("bitsandbytes runs no CPU kernel for 4-bit layers here (it needs AVX512-BF16)")
    outputs(model, model_inputs("llama"))
    with pytest.raises(ValueError, match="already repacked 14 4-bit layers.*Load the base again.*not changed"):
        hf_neural_attn.keep_4bit_trainable(model)
    assert len(cpu_kernel_layers(model)) == 14
    with pytest.warns(UserWarning, match="14 of them had been repacked already.*patch it before its first evaluation"):
        hf_neural_attn.patch_model(model, "qana")


def test_a_quantizer_the_library_cannot_read_is_refused_by_name_and_the_model_is_unchanged():
    """A projection whose weight is integer storage of an unknown quantizer (GPTQ, AWQ, HQQ keep theirs so): the
    patch cannot tell the init scale or dtype, and says so before anything changes."""
    model = tiny_model("llama")
    projection = model.model.layers[0].self_attn.q_proj
    packed = torch.randint(-8, 8, projection.weight.shape, dtype=torch.int8)
    projection.weight = torch.nn.Parameter(packed, requires_grad=False)
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    with pytest.raises(ValueError, match="hf_neural_attn cannot read .*quantizer it does not know.*bitsandbytes"):
        hf_neural_attn.patch_model(model, "qana")
    assert not hf_neural_attn.is_patched(model)
    assert model.state_dict().keys() == state.keys()
    assert all(torch.equal(model.state_dict()[name], tensor) for name, tensor in state.items())


def test_key_dim_on_a_quantized_base_is_refused_and_the_model_is_unchanged(base_folders):
    model = quantized_model(base_folders, "llama", "bnb-nf4")
    frozen = quantized_tensors(model)
    with pytest.raises(ValueError, match="hf_neural_attn cannot patch a quantized model with key_dim=4"):
        hf_neural_attn.patch_model(model, "qana", key_dim=4)
    assert not hf_neural_attn.is_patched(model)
    assert quantized_tensors(model).keys() == frozen.keys()


# --- saving and loading -------------------------------------------------------------------------------------------


def trained_quantized_llama(base_folders, scheme: str):
    """A quantized tiny Llama patched with QANA, its scorers moved off their init as training would; its inputs."""
    model = quantized_model(base_folders, "llama", scheme)
    hf_neural_attn.patch_model(model, "qana")
    perturb_scorers(model, std=0.05)
    return model, model_inputs("llama")


@pytest.mark.parametrize("scheme", SCHEME_NAMES)
def test_a_saved_patched_quantized_model_loads_back_quantized_with_its_scorers(base_folders, tmp_path, scheme):
    model, inputs = trained_quantized_llama(base_folders, scheme)
    # Saved before it runs in eval mode: on a CPU with AVX512-BF16, bitsandbytes 0.50 repacks the 4-bit weights then,
    # and saving unpacks them wrongly, in the live model too, patched or not (docs/qlora.md, "Known problems").
    model.save_pretrained(tmp_path)
    expected = outputs(model, inputs)

    for loaded in (hf_neural_attn.from_pretrained(tmp_path), AutoModelForCausalLM.from_pretrained(tmp_path)):
        assert hf_neural_attn.is_patched(loaded)
        projection = loaded.model.layers[0].self_attn.q_proj
        assert type(projection) is type(model.model.layers[0].self_attn.q_proj) and is_quantized(projection.weight)
        for name, parameter in hf_neural_attn.scorer_parameters(loaded).items():
            assert parameter.dtype == torch.float32 and not is_quantized(parameter), name
        torch.testing.assert_close(outputs(loaded, inputs), expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("scheme", SCHEME_NAMES)
def test_a_float_patched_checkpoint_loads_on_a_quantized_base_with_float_scorers(base_folders, tmp_path, scheme):
    """``from_pretrained(patched_float_checkpoint, quantization_config=...)``: the quantizer sees only the base (the
    scorers are built after it ran), so they load in float with their saved values; the result is the quantized base
    patched with those scorers."""
    float_model = tiny_model("llama", **quantizable_sizes("llama"))
    hf_neural_attn.patch_model(float_model, "neural")
    perturb_scorers(float_model, std=0.05)
    float_model.save_pretrained(tmp_path)
    saved = {
        name: parameter.detach().clone() for name, parameter in hf_neural_attn.scorer_parameters(float_model).items()
    }

    expected_model = quantized_model(base_folders, "llama", scheme)
    hf_neural_attn.patch_model(expected_model, "neural")
    with torch.no_grad():
        for name, parameter in hf_neural_attn.scorer_parameters(expected_model).items():
            parameter.copy_(saved[name])
    inputs = model_inputs("llama")
    expected = outputs(expected_model, inputs)

    config = SCHEME[scheme].config()
    by_library = hf_neural_attn.from_pretrained(tmp_path, quantization_config=config)
    by_auto_class = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=SCHEME[scheme].config())
    for loaded in (by_library, by_auto_class):
        assert is_quantized(loaded.model.layers[0].self_attn.q_proj.weight)
        scorers = hf_neural_attn.scorer_parameters(loaded)
        assert scorers.keys() == saved.keys()
        for name, parameter in scorers.items():
            assert not is_quantized(parameter) and torch.equal(parameter, saved[name]), name
        torch.testing.assert_close(outputs(loaded, inputs), expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("scheme", ["bnb-nf4", "torchao-int8-weight-only"])
def test_a_scorer_only_adapter_loads_onto_a_quantized_base(base_folders, tmp_path, scheme):
    model, inputs = trained_quantized_llama(base_folders, scheme)
    expected = outputs(model, inputs)
    hf_neural_attn.save_adapter(model, tmp_path / "adapter", base_model_name_or_path=base_folders("llama"))

    loaded = hf_neural_attn.from_pretrained(tmp_path / "adapter", quantization_config=SCHEME[scheme].config())
    assert is_quantized(loaded.model.layers[0].self_attn.q_proj.weight)
    torch.testing.assert_close(outputs(loaded, inputs), expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("scheme", BITSANDBYTES_SCHEMES)
def test_unpatching_a_quantized_model_gives_back_the_quantized_base(base_folders, scheme):
    model = quantized_model(base_folders, "gpt2", scheme)
    inputs = model_inputs("gpt2")
    original = outputs(model, inputs)
    hf_neural_attn.patch_model(model, "qana")
    perturb_scorers(model)
    hf_neural_attn.unpatch_model(model)
    assert torch.equal(outputs(model, inputs), original)


def test_a_4_bit_weight_reports_its_whole_shape_not_its_packed_storage(base_folders):
    """``hf_neural_attn.full_shape``, what every size question of the recipes asks (parameter counts, weight decay):
    bitsandbytes keeps a 4-bit (out, in) weight as (out * in / 2, 1) bytes."""
    model = quantized_model(base_folders, "llama", "bnb-nf4")
    projection = model.model.layers[0].self_attn.q_proj
    assert projection.weight.shape != (projection.out_features, projection.in_features)
    assert hf_neural_attn.full_shape(projection.weight) == (projection.out_features, projection.in_features)


@pytest.mark.parametrize("scheme", ["bnb-nf4", "bnb-fp4-double"])
def test_a_4_bit_weight_repacked_for_the_cpu_kernel_is_read_as_the_weight_it_was(base_folders, scheme):
    """On a CPU with AVX512-BF16, bitsandbytes rewrites a 4-bit weight in its CPU kernel's layout the first time the
    layer runs in eval mode without gradients (its block scales rounded to bfloat16, double quantization undone), and
    ``dequantize_4bit`` no longer reads it. A user who evaluates the base before patching it gets that layout: the
    patch must read the same weights from it, within the scales' rounding (2**-8 relative). Elsewhere the forward
    leaves the layout alone, and the test packs the weight with bitsandbytes' own function, as the forward would."""
    from bitsandbytes.functional import _convert_weight_packed_for_cpu

    model = quantized_model(base_folders, "llama", scheme)
    projections = [model.model.layers[0].self_attn.q_proj, model.model.layers[1].mlp.down_proj]
    before = [dense_weight(projection).clone() for projection in projections]
    outputs(model, model_inputs("llama"))
    for projection, weight in zip(projections, before, strict=True):
        if not getattr(projection.weight.quant_state, "packing_format_for_cpu", False):  # a CPU without AVX512-BF16
            projection.weight.data, projection.weight.quant_state = _convert_weight_packed_for_cpu(
                projection.weight.data, projection.weight.quant_state
            )
        assert projection.weight.shape == (projection.out_features, projection.in_features // 2)
        assert hf_neural_attn.full_shape(projection.weight) == (projection.out_features, projection.in_features)
        torch.testing.assert_close(dense_weight(projection), weight, rtol=2**-8, atol=1e-8)
