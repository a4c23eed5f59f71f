"""recipes/finetune.py on a quantized base: QLoRA with the scorers (bitsandbytes 4-bit, LoRA, the scorers as
``modules_to_save``), the scorers alone on a torchao base, the model card's account of both, and the flags' checks.
In-process runs on the tiny models and text files of recipes_helpers."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from quantization_helpers import HAS_PEFT, INSTALL, quantizable_sizes, quantized_tensors
from recipes_helpers import (  # fresh_accelerate_state, one_thread: autouse fixtures
    clm_flags,
    fresh_accelerate_state,  # noqa: F401
    one_thread,  # noqa: F401
    read_results,
    recipe_assets,
    save_tiny_llama,
)

import hf_neural_attn
from recipes import qlora, report
from recipes.args import parse_args
from recipes.errors import RecipeError
from recipes.outputs import write_outputs
from recipes.training import setup, train

pytest.importorskip("bitsandbytes", reason=f"bitsandbytes is not installed: {INSTALL}")
pytest.importorskip("torchao", reason=f"torchao is not installed: {INSTALL}")
pytestmark = [
    pytest.mark.skipif(not HAS_PEFT, reason="peft is not installed: pip install 'hf-neural-attn[peft]'"),
    pytest.mark.filterwarnings("ignore:Adapters saved from this model will name"),
]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """recipe_assets, with a Llama bitsandbytes can run on any CPU (quantization_helpers.quantizable_sizes)."""
    root = tmp_path_factory.mktemp("recipe_assets")
    return {**recipe_assets(root), "llama": save_tiny_llama(root / "tiny-llama-64", **quantizable_sizes("llama"))}


def trained_run(output_dir, flags: list[str]):
    """A finetune run in this process that keeps its trained model: (the model, unwrapped; all_results.json)."""
    state = train(setup(parse_args([*flags, "--output_dir", str(output_dir)])))
    write_outputs(state)
    return state.accelerator.unwrap_model(state.model).eval(), read_results(output_dir)


def token_ids(model) -> torch.Tensor:
    """(2, 16) token ids of the model's vocabulary."""
    vocab = model.config.vocab_size
    return torch.randint(2, vocab, (2, 16), generator=torch.Generator().manual_seed(0))


def card_loading_code(output_dir) -> str:
    """The Python code of the card's "How to load", pointed at ``output_dir``."""
    card = (output_dir / report.CARD_FILE).read_text()
    code = re.search(r"```python\n(.*?)```", card.split("## How to load", 1)[1], re.DOTALL).group(1)
    return code.replace("path/to/this/folder", str(output_dir))


def test_a_qlora_run_trains_lora_and_the_scorers_and_its_card_loads_the_adapter(assets, tmp_path):
    from transformers import BitsAndBytesConfig, LlamaForCausalLM

    out = tmp_path / "qlora"
    flags = clm_flags(assets, "--scorer", "qana", "--load_in_4bit", "--bnb_4bit_use_double_quant", "--lora_r", "4")
    model, results = trained_run(out, [*flags, "--model_name_or_path", str(assets["llama"])])

    # The run evaluated and saved its 4-bit base in the layout bitsandbytes loaded it in: its CPU kernel's repacking,
    # which bitsandbytes undoes wrongly when a state dict is taken (docs/qlora.md, "Known problems"), was off.
    from bitsandbytes.nn import Linear4bit

    layers = [module for module in model.modules() if isinstance(module, Linear4bit)]
    assert layers and not any(layer.support_avx512bf16_for_cpu for layer in layers)
    assert not any(getattr(layer.weight.quant_state, "packing_format_for_cpu", False) for layer in layers)

    # PEFT's adapter, not a full checkpoint: the LoRA matrices and the scorers' trained copies.
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in out.iterdir()}
    assert not (out / "config.json").exists()
    adapter_config = json.loads((out / "adapter_config.json").read_text())
    assert adapter_config["r"] == 4 and adapter_config["lora_alpha"] == 8
    assert any(name.endswith(".attn_scorer") for name in adapter_config["modules_to_save"])
    # The quantized base did not move.
    fresh = LlamaForCausalLM.from_pretrained(
        assets["llama"],
        quantization_config=BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.float32,
        ),
    )
    trained_base = quantized_tensors(model.get_base_model())
    for name, tensor in quantized_tensors(fresh).items():
        trained_name = name.replace(".weight", ".base_layer.weight")
        assert torch.equal(trained_base.get(trained_name, trained_base.get(name)), tensor), name

    assert results["model_class"] == "LlamaForCausalLM"
    assert 0 < results["parameters"]["added_by_patch"] < results["parameters"]["trainable"]
    card = (out / report.CARD_FILE).read_text()
    assert "library_name: peft" in card and "- 4-bit" in card and "- lora" in card and "custom_code" not in card
    assert "| base weights | bitsandbytes 4-bit NF4, double quantization, matmuls in float32 |" in card
    assert "| trained | LoRA adapters and the new parameters |" in card

    # The card's code loads the run's model: the same outputs, computed on the same bitsandbytes kernel (the run kept
    # the loaded 4-bit layout, where the loaded model would run its CPU kernel in bfloat16 on some CPUs).
    assert_card_code_loads(out, model)


def assert_card_code_loads(output_dir, model) -> None:
    """The card's "How to load" code, run as a user runs it, gives ``model``'s logits (evaluated: in eval mode, without
    gradients, where bitsandbytes' CPU kernel, if on, would repack the 4-bit layers and round their input)."""
    namespace: dict = {}
    exec(card_loading_code(output_dir), namespace)
    ids = token_ids(model)
    with torch.no_grad():
        torch.testing.assert_close(namespace["model"].eval()(ids).logits, model(ids).logits, rtol=0, atol=1e-6)


def test_the_card_of_a_4_bit_qlora_baseline_loads_it_on_the_kernel_the_run_ran(assets, tmp_path):
    """An unpatched 4-bit base under LoRA: the run turned bitsandbytes' CPU kernel off
    (hf_neural_attn.keep_4bit_trainable), and no patch does it for the card's code, which says it itself."""
    out = tmp_path / "baseline-4bit"
    flags = clm_flags(assets, "--scorer", "none", "--load_in_4bit", "--lora_r", "4", "--attention_map_layer", "none")
    model, results = trained_run(out, [*flags, "--model_name_or_path", str(assets["llama"])])
    assert results["patch"] is None
    assert_card_code_loads(out, model)
    code = card_loading_code(out)
    assert "hf_neural_attn.keep_4bit_trainable(base)" in code and "hf_neural_attn.patch_model" not in code


def test_a_torchao_run_trains_the_scorers_alone_and_saves_a_quantized_patched_checkpoint(assets, tmp_path):
    out = tmp_path / "torchao"
    flags = clm_flags(assets, "--scorer", "neural", "--torchao", "int8_weight_only", "--train_only_new_params")
    model, results = trained_run(out, [*flags, "--model_name_or_path", str(assets["llama"])])
    assert results["parameters"]["trainable"] == results["parameters"]["added_by_patch"]
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == "torchao"
    assert "| base weights | torchao int8-weight-only |" in (out / report.CARD_FILE).read_text()
    loaded = hf_neural_attn.from_pretrained(out)
    assert "torchao" in type(loaded.model.layers[0].self_attn.q_proj.weight).__module__
    ids = token_ids(model)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=1e-6)


def test_a_qlora_run_resumes_from_its_checkpoint_to_the_uninterrupted_result(assets, tmp_path):
    """A checkpoint of a QLoRA run holds the 4-bit base's quantization states beside its weights, which no parameter
    takes back; the resumed run reloads the frozen base and restores what trained: the same final model."""
    import shutil

    from recipes_helpers import finetune_in_process

    flags = [
        *clm_flags(assets, "--scorer", "neural", "--load_in_4bit", "--lora_r", "4", "--checkpointing_steps", "2"),
        *("--model_name_or_path", str(assets["llama"]), "--attention_map_layer", "none"),
    ]
    whole = finetune_in_process(tmp_path / "whole", *flags)
    shutil.copytree(tmp_path / "whole" / "step_2", tmp_path / "resumed" / "step_2")
    resumed = finetune_in_process(tmp_path / "resumed", *flags, "--resume_from_checkpoint", "latest")
    assert resumed["perplexity"] == whole["perplexity"]


TORCHAO_TRAINING = [("int8_weight_only", ["--train_only_new_params"]), ("int4_weight_only", ["--lora_r", "4"])]


@pytest.mark.parametrize(
    "scheme, training", TORCHAO_TRAINING, ids=[" ".join([scheme, *flags]) for scheme, flags in TORCHAO_TRAINING]
)
def test_a_torchao_run_checkpoints_its_quantized_base_and_resumes_to_the_uninterrupted_result(
    assets, tmp_path, scheme, training
):
    """torchao's weights are tensor subclasses without a storage, which Accelerate's safetensors writer cannot take:
    the checkpoint holds them in torchao's own safetensors layout beside the rest, and the resumed run reloads the
    frozen base and restores what trained."""
    from quantization_helpers import SCHEME
    from recipes_helpers import finetune_in_process
    from safetensors import safe_open
    from safetensors.torch import load_file
    from torchao.prototype.safetensors.safetensors_support import unflatten_tensor_state_dict
    from transformers import LlamaForCausalLM

    flags = [
        *clm_flags(assets, "--scorer", "neural", "--torchao", scheme, *training, "--checkpointing_steps", "2"),
        *("--model_name_or_path", str(assets["llama"]), "--attention_map_layer", "none"),
    ]
    whole = finetune_in_process(tmp_path / "whole", *flags)
    checkpoint = tmp_path / "whole" / "step_2"
    assert not list((tmp_path / "whole").glob(".*.partial"))
    saved = checkpoint / qlora.TORCHAO_WEIGHTS
    with safe_open(saved, "pt") as handle:
        quantized, left = unflatten_tensor_state_dict(load_file(saved), handle.metadata())
    assert quantized and not left
    fresh = LlamaForCausalLM.from_pretrained(
        assets["llama"], quantization_config=SCHEME["torchao-" + scheme.replace("_", "-")].config()
    )
    for name, tensor in quantized_tensors(fresh).items():
        saved_name = name if "--lora_r" not in training else f"base_model.model.{name[:-7]}.base_layer.weight"
        assert torch.equal(quantized[saved_name].dequantize(), tensor), name
    shutil.copytree(checkpoint, tmp_path / "resumed" / "step_2")
    resumed = finetune_in_process(tmp_path / "resumed", *flags, "--resume_from_checkpoint", "latest")
    assert resumed["perplexity"] == whole["perplexity"]


def test_the_qlora_baseline_is_lora_on_the_quantized_unpatched_base(assets, tmp_path):
    from recipes_helpers import finetune_in_process

    out = tmp_path / "baseline"
    flags = clm_flags(assets, "--scorer", "none", "--load_in_8bit", "--lora_r", "4", "--attention_map_layer", "none")
    results = finetune_in_process(out, *flags, "--model_name_or_path", str(assets["llama"]))
    assert results["patch"] is None and results["parameters"]["added_by_patch"] == 0
    card = (out / report.CARD_FILE).read_text()
    assert "| scorer | none (unpatched baseline) |" in card
    assert "| base weights | bitsandbytes 8-bit (LLM.int8) |" in card and "| LoRA | r=4, alpha=8" in card
    assert "hf_neural_attn.patch_model" not in card_loading_code(out)


REFUSED = [
    (["--load_in_4bit", "--scorer", "qana"], "cannot be fine-tuned in full.*--lora_r 16.*--train_only_new_params"),
    (["--load_in_4bit", "--load_in_8bit", "--lora_r", "4"], "Give --load_in_4bit or --load_in_8bit, not both"),
    (["--load_in_8bit", "--torchao", "int8_dynamic", "--lora_r", "4"], "bitsandbytes .* or --torchao, not both"),
    (["--bnb_4bit_quant_type", "fp4", "--lora_r", "4"], "--bnb_4bit_quant_type sets up 4-bit loading"),
    (["--lora_alpha", "32"], "--lora_alpha sets up LoRA: add --lora_r"),
    (["--lora_r", "4", "--train_only_new_params"], "give one"),
    (["--lora_r", "0"], "--lora_r and --lora_alpha must be at least 1"),
    # Its activation quantization passes no gradient: LoRA would train only behind the last quantized layers (exit 0),
    # the scorers alone would die at the first step.
    (["--torchao", "int8_dynamic", "--lora_r", "4"], "--torchao int8_dynamic cannot train: .* no gradient"),
    (["--torchao", "int8_dynamic", "--train_only_new_params"], "--torchao int8_dynamic cannot train"),
]


@pytest.mark.parametrize("extra, message", REFUSED, ids=[" ".join(flags) for flags, _ in REFUSED])
def test_quantization_and_lora_flags_that_do_not_fit_are_refused_before_anything_loads(assets, extra, message):
    with pytest.raises(RecipeError, match=message):
        parse_args(clm_flags(assets, *extra))


def test_the_refused_int8_dynamic_scheme_passes_no_gradient_back_through_its_layers(assets):
    """Why --torchao int8_dynamic is refused (docs/qlora.md): patched by hand, the scorers trained alone fail at the
    first backward, and under LoRA the backward runs with the scorers' gradient and q_proj's LoRA-B gradient exactly 0
    (the gradient would come back through o_proj's quantized input), o_proj's alone getting one. A torchao that passed
    a gradient would fail this test, and the refusal would be due for a look."""
    from peft import LoraConfig, get_peft_model
    from quantization_helpers import SCHEME
    from transformers import LlamaForCausalLM

    def patched_int8_dynamic():
        config = SCHEME["torchao-int8-dynamic"].config()
        model = LlamaForCausalLM.from_pretrained(assets["llama"], quantization_config=config)
        return hf_neural_attn.patch_model(model, "neural")

    model = patched_int8_dynamic()
    ids = token_ids(model)
    scorers = hf_neural_attn.scorer_parameters(model)
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(name in scorers)
    with pytest.raises(RuntimeError, match="does not require grad"):
        model(ids, labels=ids).loss.backward()

    base = patched_int8_dynamic()
    to_save = hf_neural_attn.peft_modules_to_save(base)
    model = get_peft_model(base, LoraConfig(r=4, target_modules="all-linear", modules_to_save=to_save))
    model(ids, labels=ids).loss.backward()
    grads = {name: parameter.grad for name, parameter in model.named_parameters() if parameter.requires_grad}
    scorer_grads = [grad for name, grad in grads.items() if ".modules_to_save." in name]
    assert scorer_grads and all(grad is None or not grad.any() for grad in scorer_grads)
    lora_b = {name: grad for name, grad in grads.items() if "lora_B" in name}
    assert all(not lora_b[name].any() for name in lora_b if ".q_proj." in name)
    assert all(lora_b[name].any() for name in lora_b if ".o_proj." in name)


def test_quantizing_a_model_built_from_scratch_is_refused(assets):
    with pytest.raises(RecipeError, match="quantizes a pretrained base: pass --model_name_or_path"):
        parse_args(["--model_type", "gpt2", "--load_in_4bit", "--lora_r", "4", "--output_dir", "unused"])


def test_torchao_on_a_model_without_linear_projections_is_refused_not_trained_in_float(assets, tmp_path):
    """torchao quantizes nn.Linear layers; GPT-2's projections are Conv1D, so nothing would be quantized."""
    flags = clm_flags(assets, "--scorer", "qana", "--torchao", "int8_weight_only", "--train_only_new_params")
    with pytest.raises(
        RecipeError, match="quantized no layer of GPT2ForCausalLM|quantized no layer of GPT2LMHeadModel"
    ):
        setup(parse_args([*flags, "--output_dir", str(tmp_path)]))


# The quantized bases whose checkpoints export: bitsandbytes 4-bit (accelerate's model.safetensors, the quantization
# states beside the weights) and torchao int8 weight-only (its weights in torchao_weights.safetensors, the rest in
# pytorch_model.bin).
EXPORTED_BASES = {"bnb 4-bit": ["--load_in_4bit"], "torchao int8 weight-only": ["--torchao", "int8_weight_only"]}


def checkpointed_run(assets, output_dir, quantization: list[str], *flags: str):
    """A 4-step run of the 64-wide Llama on the base ``quantization`` (flags) loads, with a checkpoint every 2 steps:
    (the trained model, unwrapped, in eval mode; its last checkpoint, step_4, taken after the last step)."""
    run_flags = [*clm_flags(assets, *quantization, "--checkpointing_steps", "2", "--attention_map_layer", "none")]
    model, _ = trained_run(output_dir, [*run_flags, *flags, "--model_name_or_path", str(assets["llama"])])
    return model, output_dir / "step_4"


def assert_same_tensors(file, other) -> None:
    """Two safetensors files hold the same tensors under the same names, and the same metadata (torchao's: what
    rebuilds each quantized weight)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    tensors, others = load_file(file), load_file(other)
    assert tensors.keys() == others.keys() and all(torch.equal(tensors[name], others[name]) for name in tensors)
    with safe_open(file, "pt") as handle, safe_open(other, "pt") as other_handle:
        assert handle.metadata() == other_handle.metadata()


def loaded_by_the_card(folder):
    """The model the "How to load" code of ``folder``'s README.md loads (which keeps bitsandbytes' loaded 4-bit
    layout itself: the patch, or its own ``keep_4bit_trainable`` call)."""
    namespace: dict = {}
    exec(card_loading_code(folder), namespace)
    return namespace["model"].eval()


@pytest.mark.parametrize("quantization", EXPORTED_BASES.values(), ids=EXPORTED_BASES)
def test_a_quantized_lora_checkpoint_exports_to_the_adapter_the_run_saves(assets, tmp_path, quantization):
    """The step_N of a LoRA run on a quantized base says what it is (a training state, not a model) and how to export
    it; ``python -m recipes.export`` of the last one writes what the run's final output is, PEFT's adapter, tensor for
    tensor, and the export's card loads it onto the quantized, patched base: the trained model's logits (within
    1e-6, as the run's own card). A checkpoint written before the recipe recorded the model's class (its config.json
    named PeftModel) exports the same."""
    from recipes.export import main as export

    out = tmp_path / "qlora"
    model, step = checkpointed_run(assets, out, quantization, "--scorer", "qana", "--lora_r", "4")
    card = (step / report.CARD_FILE).read_text()
    assert "**training-state checkpoint**, not a model checkpoint" in card
    assert "python -m recipes.export path/to/step_4 path/to/the/export" in card and "PEFT's adapter" in card
    assert 'PeftModel.from_pretrained(base, "path/to/the/export")' in card
    files = step / "model_files"
    assert json.loads((files / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert not (files / report.CARD_FILE).exists()  # no full checkpoint's card: the folder is none

    assert export([str(step), str(tmp_path / "exported")]) == 0
    exported = tmp_path / "exported"
    names = {path.name for path in exported.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json", report.CARD_FILE} <= names
    assert "config.json" not in names  # an adapter folder, as the run's output is
    assert_same_tensors(exported / "adapter_model.safetensors", out / "adapter_model.safetensors")
    adapter, final = (json.loads((folder / "adapter_config.json").read_text()) for folder in (exported, out))
    assert {**adapter, "target_modules": sorted(adapter["target_modules"])} == {
        **final,
        "target_modules": sorted(final["target_modules"]),
    }
    ids = token_ids(model)
    with torch.no_grad():
        torch.testing.assert_close(loaded_by_the_card(exported)(ids).logits, model(ids).logits, rtol=0, atol=1e-6)

    config = json.loads((files / "config.json").read_text())
    (files / "config.json").write_text(json.dumps({**config, "architectures": ["PeftModel"]}))
    assert export([str(step), str(tmp_path / "older")]) == 0
    assert_same_tensors(tmp_path / "older" / "adapter_model.safetensors", out / "adapter_model.safetensors")


@pytest.mark.parametrize("quantization", EXPORTED_BASES.values(), ids=EXPORTED_BASES)
def test_a_quantized_scorer_checkpoint_exports_to_the_quantized_checkpoint_the_run_saves(
    assets, tmp_path, capsys, quantization
):
    """``python -m recipes.export`` of the last step_N of a run on a quantized base that trained the scorers alone
    writes what the run's final output is: a full patched checkpoint whose base stays quantized, tensor for tensor
    (torchao's weights, kept apart in the checkpoint, in torchao's safetensors layout again, with the same metadata);
    the export's card loads it with the trained model's logits (within 1e-6). Weights that do not fit the model files
    (scorers the config does not have, projections of another size, an embedding of another size) are refused by
    name, with no folder left behind."""
    from recipes.export import main as export

    out = tmp_path / "scorers"
    model, step = checkpointed_run(assets, out, quantization, "--scorer", "neural", "--train_only_new_params")
    card = (step / report.CARD_FILE).read_text()
    assert "a full patched checkpoint whose base weights stay quantized" in card
    assert (f"torchao weights apart, in torchao's safetensors layout: `{qlora.TORCHAO_WEIGHTS}`" in card) == (
        "--torchao" in quantization
    )

    assert export([str(step), str(tmp_path / "exported")]) == 0
    exported = tmp_path / "exported"
    assert {path.name for path in exported.iterdir()} <= {path.name for path in out.iterdir()}
    assert_same_tensors(exported / "model.safetensors", out / "model.safetensors")
    config = json.loads((exported / "config.json").read_text())
    assert config == json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == (
        "torchao" if "--torchao" in quantization else "bitsandbytes"
    )
    ids = token_ids(model)
    with torch.no_grad():
        torch.testing.assert_close(loaded_by_the_card(exported)(ids).logits, model(ids).logits, rtol=0, atol=1e-6)

    unpatched = {
        **json.loads((assets["llama"] / "config.json").read_text()),
        "quantization_config": config["quantization_config"],
    }
    misfits = {
        "unpatched": (unpatched, "unexpected ['model.layers.0.self_attn.attn_scorer."),
        "narrower": ({**config, "intermediate_size": 64}, "of other shapes ['model.layers.0.mlp."),
        # A float tensor of another shape: transformers' own refusal named none.
        "larger vocabulary": ({**config, "vocab_size": config["vocab_size"] + 64}, "'model.embed_tokens.weight'"),
    }
    for name, (other_config, _) in misfits.items():
        shutil.copytree(step / "model_files", tmp_path / name)
        (tmp_path / name / "config.json").write_text(json.dumps(other_config))
    before = sorted(path.name for path in tmp_path.iterdir())
    for name, (_, found) in misfits.items():
        capsys.readouterr()
        assert export([str(step), str(tmp_path / "misfit"), "--model_files", str(tmp_path / name)]) == 2
        assert found in capsys.readouterr().err
        assert sorted(path.name for path in tmp_path.iterdir()) == before


@pytest.mark.parametrize(
    "flags, expected",
    [
        ([], None),
        (["--load_in_8bit"], ("bitsandbytes", "8bit", "load_in_8bit", ["bitsandbytes", "8-bit"])),
        (
            ["--load_in_4bit", "--bnb_4bit_quant_type", "fp4", "--bnb_4bit_use_double_quant"],
            ("bitsandbytes", "4bit", "load_in_4bit", ["bitsandbytes", "4-bit"]),
        ),
        (["--torchao", "int4_weight_only"], ("torchao", "int4_weight_only", "torchao int4_weight_only", ["torchao"])),
    ],
)
def test_one_quantization_value_answers_for_the_flags_and_the_recorded_settings(flags, expected):
    """``qlora.Quantization.of`` reads the flags once, and reads a run's recorded settings (a dict) the same way: the
    library, scheme, flag, tags and loading code come from it."""
    base = ["--task", "clm", "--output_dir", "unused", "--model_name_or_path", "a/model", "--lora_r", "4"]
    args = parse_args([*base, *flags])
    from_flags, from_settings = qlora.Quantization.of(args), qlora.Quantization.of(vars(args))
    assert from_flags == from_settings
    if expected is None:
        assert from_flags is None and qlora.quantization_snippet(vars(args)) == ([], [], None)
        return
    library, scheme, flag, tags = expected
    assert (from_flags.library, from_flags.scheme, from_flags.flag, from_flags.hub_tags) == (
        library,
        scheme,
        flag,
        tags,
    )
    assert qlora.hub_tags(vars(args)) == ["lora", *tags]
    assert qlora.describe_quantization(vars(args)) == from_flags.describe()
    if scheme == "4bit":  # the 4-bit options travel with it
        assert (from_flags.quant_type, from_flags.double_quant) == ("fp4", True)
        assert 'bnb_4bit_quant_type="fp4"' in from_flags.loading_snippet()[2]


def test_the_quantization_and_lora_defaults_are_declared_once():
    args = parse_args(["--task", "clm", "--output_dir", "unused"])
    for name, default in {**qlora.BNB_4BIT_DEFAULTS, **qlora.LORA_DEFAULTS}.items():
        assert getattr(args, name) == default, name
    with pytest.raises(RecipeError, match="not both"):
        qlora.Quantization.of({"load_in_4bit": True, "torchao": "int8_weight_only"})
