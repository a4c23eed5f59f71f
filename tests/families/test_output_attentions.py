"""``output_attentions`` on a patched model, the way a user asks for it: one map per attention layer, in layer
order, for every family, every ``impl`` and every ``layers=`` choice, over an eager or an SDPA base model.

The layers the patch leaves alone return the maps the unpatched model returns (transformers' eager attention,
the only one that has maps, with the same weights); the scored layers return their scorer's probabilities,
whichever path computes their output. Over an SDPA base, a query row that sees no key (a leading pad) has an all-zero
map, as SDPA weighs it (its output is zero); over an eager base its map is uniform, as eager weighs it. And the fine-tuning recipe, which draws these maps, runs with
``--layers`` and ``--impl`` choices that used to crash it.
"""

from __future__ import annotations

import itertools
import json
import warnings

import pytest
import torch
from helpers.models import LEFT_PADDED, family_case, family_cases, padded_inputs, perturb_scorers, tiny_gpt2
from helpers.paths import PORTABLE_IMPLS

import hf_neural_attn

BASES = ["eager", "sdpa"]
LAYER_CHOICES = [None, [0], [1]]
HEADS = 4
# Maps of the same layer computed by the same eager ops on the same inputs: equal. Probabilities of the
# patched layers through different paths for the output (reference vs chunked blocks): fp32 rounding.
ROUNDING = 1e-5
# One tiny model per adapter of the library and per kind of attention plumbing it handles (FAMILY_CASES, sample).
FAMILIES = family_cases(sample=True)


def patched(case, base: str, layers, impl: str, perturb: bool = True):
    model = case.build(attn_implementation=base)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the generic path says it is generic
        hf_neural_attn.patch_model(model, "qana", layers=layers, impl=impl)
    if perturb:
        perturb_scorers(model)
    return model


def maps(model, inputs) -> tuple[torch.Tensor, ...]:
    with torch.no_grad():
        return model(**inputs, output_attentions=True).attentions


def sees_a_key(case, inputs, base: str) -> torch.Tensor:
    """(batch, 1, q, 1): False where a query row sees no key and the base weighs it zero (SDPA), else True."""
    if "attention_mask" not in inputs or base == "eager":
        return torch.tensor(True)
    seen = inputs["attention_mask"].cumsum(-1) if case.causal else inputs["attention_mask"].sum(-1, keepdim=True)
    return (seen > 0)[:, None, :, None].expand(-1, 1, inputs["attention_mask"].shape[-1], 1)


def base_maps(case, inputs, base: str) -> list[torch.Tensor]:
    """The unpatched model's maps (eager: the only implementation with maps), its rows as ``base`` weighs them."""
    keep = sees_a_key(case, inputs, base)
    return [probs * keep for probs in maps(case.build(attn_implementation="eager"), inputs)]


@pytest.mark.parametrize("base", BASES)
@pytest.mark.parametrize("case", FAMILIES)
def test_one_map_per_layer_in_layer_order(case, base):
    inputs = padded_inputs(case.inputs)
    unpatched = base_maps(case, inputs, base)  # the unpatched model's maps (same weights)
    assert len(unpatched) == 2  # every tiny model has 2 attention layers
    keep = sees_a_key(case, inputs, base)
    for layers in LAYER_CHOICES:
        reference = None
        # Every impl but "triton", which needs CUDA (or the CPU interpreter, see test_triton.py); calls that want
        # maps never reach it anyway. The first impl's maps are every other's.
        for impl in PORTABLE_IMPLS:
            model = patched(case, base, layers, impl)
            scored = set(model.config.hf_neural_attn["layers"])
            attentions = maps(model, inputs)
            where = f"layers={layers} impl={impl}"
            assert len(attentions) == 2, f"{where}: {len(attentions)} maps"
            for index, probs in enumerate(attentions):
                assert probs.shape == unpatched[index].shape and probs.shape[:2] == (2, HEADS), (where, index)
                # Every row sums to 1, but the rows that see no key over an SDPA base: 0.
                row_sums = (torch.ones(probs.shape[:-1]).unsqueeze(-1) * keep).squeeze(-1)
                torch.testing.assert_close(probs.sum(-1), row_sums, rtol=0, atol=ROUNDING)
                if index < min(scored):
                    # Before the first scored layer the hidden states are the unpatched model's: the same maps.
                    torch.testing.assert_close(probs, unpatched[index], rtol=0, atol=0, msg=f"{where} layer {index}")
            for index in scored:  # the perturbed scorer is live there: its maps are not the dot product's
                assert (attentions[index] - unpatched[index]).abs().max() > 1e-3, (where, index)
            # A call that asks for maps runs the reference path, whatever impl says.
            reference = reference or attentions
            for index, (probs, expected) in enumerate(zip(attentions, reference)):
                torch.testing.assert_close(probs, expected, rtol=0, atol=ROUNDING, msg=f"{where} layer {index}")


@pytest.mark.parametrize("base", BASES)
@pytest.mark.parametrize("case", FAMILIES)
def test_function_preserving_patch_returns_the_unpatched_maps_on_every_layer(case, base):
    """At init every layer, scored or not, before or after a scored one, returns the unpatched model's map."""
    inputs = padded_inputs(case.inputs)
    unpatched = base_maps(case, inputs, base)
    for layers, impl in zip(itertools.cycle(LAYER_CHOICES), PORTABLE_IMPLS):
        attentions = maps(patched(case, base, layers, impl, perturb=False), inputs)
        assert len(attentions) == len(unpatched)
        for index, (probs, expected) in enumerate(zip(attentions, unpatched)):
            torch.testing.assert_close(probs, expected, rtol=0, atol=ROUNDING, msg=f"layers={layers} {index}")


def test_gpt2_cross_attention_maps_come_back_with_the_self_attention_maps():
    model = tiny_gpt2(add_cross_attention=True)  # SDPA base
    ids = padded_inputs(LEFT_PADDED)["input_ids"]
    encoder = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0))
    encoder_mask = torch.ones(2, 5, dtype=torch.long)
    encoder_mask[1, 3:] = 0
    eager = tiny_gpt2(add_cross_attention=True, attn_implementation="eager")
    with torch.no_grad():
        expected = eager(
            ids, encoder_hidden_states=encoder, encoder_attention_mask=encoder_mask, output_attentions=True
        )
    hf_neural_attn.patch_model(model, "neural", layers=[1], impl="chunked")
    with torch.no_grad():
        out = model(ids, encoder_hidden_states=encoder, encoder_attention_mask=encoder_mask, output_attentions=True)
    assert len(out.attentions) == len(out.cross_attentions) == 2
    torch.testing.assert_close(out.attentions[0], expected.attentions[0], rtol=0, atol=0)
    for probs, reference in zip(out.cross_attentions, expected.cross_attentions):
        torch.testing.assert_close(probs, reference, rtol=0, atol=ROUNDING)
        assert torch.all(probs[1, ..., 3:] == 0)  # the encoder's padding gets no weight


def test_maps_come_back_in_train_mode():
    model = patched(family_case("gpt2"), "sdpa", [1], "chunked")
    model.train()
    out = model(**padded_inputs(LEFT_PADDED), output_attentions=True)
    assert len(out.attentions) == 2
    assert out.attentions[1].requires_grad  # the scored layer's map is part of the graph


# ----------------------------------------------------------------------------------------- the recipe


@pytest.fixture
def fresh_accelerate_state():
    """Each in-process run builds its own Accelerator; reset Accelerate's process-wide singletons after it."""
    yield
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@pytest.fixture(scope="module")
def recipe_assets(tmp_path_factory):
    from recipes_helpers import save_tiny_gpt2, write_text_files

    root = tmp_path_factory.mktemp("output_attentions_recipe")
    train, validation = write_text_files(root / "text", train_lines=40, validation_lines=10)
    return {"gpt2": save_tiny_gpt2(root / "tiny-gpt2"), "train": train, "validation": validation}


@pytest.mark.parametrize(
    "flags, scored, drawn_layer",
    [
        (["--layers", "0"], [0], 0),  # the Neural Attention paper's first-layer setup
        (["--layers", "1"], [1], 1),
        (["--impl", "chunked"], [0, 1], 0),
        (["--impl", "auto", "--layers", "1", "--attention_map_layer", "0"], [1], 0),  # an unscored layer's map
    ],
    ids=["layers-0", "layers-1", "impl-chunked", "impl-auto-unscored-map"],
)
def test_recipe_draws_the_maps_for_every_layers_and_impl_choice(
    recipe_assets, tmp_path, flags, scored, drawn_layer, fresh_accelerate_state
):
    """The recipe's own code path (recipes/finetune.py in-process, SDPA GPT-2 from a pretrained folder): the
    scorer history at step 0 and every logging step, and attention_maps.png after training."""
    from recipes import scorer_plots
    from recipes.args import parse_args
    from recipes.training import run

    out = tmp_path / "run"
    argv = [
        *("--model_name_or_path", str(recipe_assets["gpt2"]), "--task", "clm", "--block_size", "16"),
        *("--train_file", str(recipe_assets["train"]), "--validation_file", str(recipe_assets["validation"])),
        *("--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "4", "--max_train_steps", "2"),
        *("--scorer", "neural", "--logging_steps", "1", "--output_dir", str(out)),
        *flags,
    ]
    outcome = run(parse_args(argv))
    results = json.loads((out / "all_results.json").read_text())
    history = json.loads((out / scorer_plots.SCORER_HISTORY_FILE).read_text())["history"]
    assert [entry["step"] for entry in history] == [0, 1, 2]
    for entry in history:
        assert [record["layer"] for record in entry["layers"]] == scored
        assert all(0 <= record["attention_change"] <= 1 for record in entry["layers"])
    assert history == outcome["scorer_history"]
    assert (out / scorer_plots.ATTENTION_PLOT_FILE).is_file()
    assert results["plots"]["attention_layer"] == drawn_layer and "attention_change" in results["plots"]
    if drawn_layer not in scored:  # an unscored layer before any scored one draws the unpatched map
        assert results["plots"]["attention_change"] == 0


@pytest.mark.parametrize("layers", LAYER_CHOICES)
@pytest.mark.parametrize("base", BASES)
def test_asking_for_maps_changes_no_output(base, layers):
    """A left-padded batch: the logits are the same with and without output_attentions, pad rows included (the
    unscored layers run eager for their maps, and keep SDPA's zero rows over an SDPA base)."""
    case = family_case("llama")
    model = patched(case, base, layers, "auto")
    inputs = padded_inputs(case.inputs)
    with torch.no_grad():
        plain = model(**inputs).logits
        with_maps = model(**inputs, output_attentions=True).logits
    torch.testing.assert_close(with_maps, plain, rtol=0, atol=ROUNDING)
