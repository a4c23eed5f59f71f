"""recipes/finetune.py on a quantized base: QLoRA with the scorers (bitsandbytes 4-bit, LoRA, the scorers as
``modules_to_save``), the scorers alone on a torchao base, the model card's account of both, and the flags' checks.
In-process runs on the tiny models and text files of recipes_helpers."""

from __future__ import annotations

import json
import re

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
from recipes import report
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
]


@pytest.mark.parametrize("extra, message", REFUSED, ids=[" ".join(flags) for flags, _ in REFUSED])
def test_quantization_and_lora_flags_that_do_not_fit_are_refused_before_anything_loads(assets, extra, message):
    with pytest.raises(RecipeError, match=message):
        parse_args(clm_flags(assets, *extra))


def test_quantizing_a_model_built_from_scratch_is_refused(assets):
    with pytest.raises(RecipeError, match="quantizes a pretrained base: pass --model_name_or_path"):
        parse_args(["--model_type", "gpt2", "--load_in_4bit", "--lora_r", "4", "--output_dir", "unused"])


def test_torchao_on_a_model_without_linear_projections_is_refused_not_trained_in_float(assets, tmp_path):
    """torchao quantizes nn.Linear layers; GPT-2's projections are Conv1D, so nothing would be quantized."""
    flags = clm_flags(assets, "--scorer", "qana", "--torchao", "int8_weight_only", "--train_only_new_params")
    with pytest.raises(RecipeError, match="quantized no layer of GPT2ForCausalLM|quantized no layer of GPT2LMHeadModel"):
        setup(parse_args([*flags, "--output_dir", str(tmp_path)]))
