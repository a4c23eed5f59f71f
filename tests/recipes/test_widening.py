"""recipes/widening.py (``--widen_mlp N``, the equal-parameter control): a widened GPT-2, Llama, Mistral or Qwen2
computes what the pretrained one did, adds the parameters it says, learns through the new units, saves and reloads as
an ordinary model of the new width; a recipe run reports the parameters it added; what it cannot widen is refused
before anything changes."""

from __future__ import annotations

import pytest
import torch
from helpers.models import tiny_model
from recipes_helpers import (  # fresh_accelerate_state, one_thread: autouse fixtures
    fresh_accelerate_state,  # noqa: F401
    one_thread,  # noqa: F401
    read_results,
    tiny_recipe_assets,
)
from transformers import AutoModelForCausalLM, GPT2Config

from recipes import widening
from recipes.args import parse_args
from recipes.errors import RecipeError
from recipes.training import run

# Per family: parameters each new hidden unit adds per layer (the tiny models of tests/helpers/models.py are 32
# wide), the config's width attribute, and the width before. GPT-2: a c_fc column and its bias, a c_proj row; the
# gated MLPs: a gate and an up row, a down column, no biases. Every layout widening.LAYOUTS knows.
CASES = {
    "gpt2": (32 + 1 + 32, "n_inner", 4 * 32),
    "llama": (3 * 32, "intermediate_size", 64),
    "mistral": (3 * 32, "intermediate_size", 64),
    "qwen2": (3 * 32, "intermediate_size", 64),
}


def test_every_known_layout_is_tested():
    assert set(CASES) == set(widening.LAYOUTS)


@pytest.mark.parametrize("family", sorted(CASES))
def test_a_widened_mlp_computes_what_the_pretrained_one_did_and_reloads(family, tmp_path):
    per_unit, width_name, width = CASES[family]
    torch.manual_seed(0)
    model = tiny_model(family).eval()
    tokens = torch.randint(0, model.config.vocab_size, (2, 12))
    with torch.no_grad():
        before = model(tokens).logits
    added = widening.widen_mlp(model, 5)
    assert added == 5 * per_unit * model.config.num_hidden_layers
    assert getattr(model.config, width_name) == width + 5 == widening.mlp_width(model.config)
    with torch.no_grad():
        after = model(tokens).logits
    torch.testing.assert_close(after, before, rtol=0, atol=1e-6)  # new outputs read with zero weights

    # One step: the new output weights (zero at first) receive a gradient, so the new units learn.
    model.train()
    model(tokens, labels=tokens).loss.backward()
    mlp = model.transformer.h[0].mlp if family == "gpt2" else model.model.layers[0].mlp
    new_output = mlp.c_proj.weight[-5:] if family == "gpt2" else mlp.down_proj.weight[:, -5:]
    assert new_output.abs().max() == 0
    grad = mlp.c_proj.weight.grad[-5:] if family == "gpt2" else mlp.down_proj.weight.grad[:, -5:]
    assert grad.abs().max() > 0

    # Saved, it reloads with transformers' own loader at the new width, and computes the same.
    model.eval().save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert getattr(reloaded.config, width_name) == width + 5
    with torch.no_grad():
        torch.testing.assert_close(reloaded(tokens).logits, model(tokens).logits)


def test_what_cannot_be_widened_is_refused():
    config = GPT2Config()
    with pytest.raises(RecipeError, match="from scratch.*n_inner"):
        widening.check_widening(config, 8, from_scratch=True, quantized=False)
    with pytest.raises(RecipeError, match="quantized"):
        widening.check_widening(config, 8, from_scratch=False, quantized=True)
    with pytest.raises(RecipeError, match="number of hidden units"):
        widening.check_widening(config, -1, from_scratch=False, quantized=False)
    from transformers import BertConfig

    with pytest.raises(RecipeError, match="'bert'"):
        widening.check_widening(BertConfig(), 8, from_scratch=False, quantized=False)
    widening.check_widening(BertConfig(), 0, from_scratch=True, quantized=True)  # 0: nothing to check


def test_weights_that_are_not_whole_float_tensors_are_refused_and_left_as_they_were():
    model = tiny_model("gpt2")
    model.transformer.h[1].mlp.c_proj.weight.ds_id = 7  # as DeepSpeed ZeRO-3 marks its partitioned placeholders
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    with pytest.raises(RecipeError, match="partitioned"):
        widening.widen_mlp(model, 4)
    assert model.config.n_inner is None and all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


def test_a_recipe_run_with_widen_mlp_reports_what_it_added(tmp_path):
    assets = tiny_recipe_assets(tmp_path / "assets")
    out = tmp_path / "run"
    args = parse_args(
        [
            "--model_name_or_path", str(assets["gpt2"]),
            "--train_file", str(assets["train_txt"]),
            "--validation_file", str(assets["validation_txt"]),
            "--block_size", "32",
            "--per_device_train_batch_size", "4",
            "--max_train_steps", "2",
            "--scorer", "none",
            "--widen_mlp", "3",
            "--eval_at_start",
            "--attention_map_layer", "none",
            "--output_dir", str(out),
        ]
    )  # fmt: skip
    run(args)
    results = read_results(out)
    config = GPT2Config.from_pretrained(assets["gpt2"])
    per_layer = 3 * (2 * config.n_embd + 1)
    assert results["parameters"]["added"] == per_layer * config.n_layer
    assert results["parameters"]["added_by_patch"] == 0
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    assert reloaded.config.n_inner == widening.mlp_width(config) + 3
