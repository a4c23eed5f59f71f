"""hf_neural_attn.plotting: attention maps beside the unpatched model's, and the scorers' history over training.

What a user sees is a PNG; the tests read each one back (size, format) and check the numbers drawn in it, which
the functions return: their shapes, that they are attention distributions, that the patched maps are the
model's own ``output_attentions`` and the unpatched ones a plain eager model's with the same weights, and that
drawing leaves the model exactly as it was.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from helpers.models import (
    VOCAB,
    family_names,
    model_inputs,
    perturb_scorers,
    tiny_gpt2,
    tiny_llama,
    tiny_model,
    tiny_vit,
)
from helpers.paths import PORTABLE_IMPLS
from PIL import Image

import hf_neural_attn
from hf_neural_attn import plotting

HEADS = 4  # every tiny model of helpers.models has 4 query heads


def snapshot(model) -> dict:
    """Everything drawing must leave unchanged."""
    return {
        "state": {name: tensor.clone() for name, tensor in model.state_dict().items()},
        "parameters": [id(p) for p in model.parameters()],
        "patched": hf_neural_attn.is_patched(model),
        "record": json.dumps(getattr(model.config, "hf_neural_attn", None), sort_keys=True),
        "implementation": model.config._attn_implementation,
        "training": [module.training for module in model.modules()],
        "hooks": sum(len(module._forward_pre_hooks) for module in model.modules()),
    }


def assert_unchanged(model, before: dict, inputs: dict, logits_before: torch.Tensor) -> None:
    after = snapshot(model)
    assert after["state"].keys() == before["state"].keys()
    for name, tensor in before["state"].items():
        assert torch.equal(after["state"][name], tensor), f"{name} changed"
    for key in ("parameters", "patched", "record", "implementation", "training", "hooks"):
        assert after[key] == before[key], key
    was_training = model.training
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(**inputs).logits, logits_before), "outputs changed"
    model.train(was_training)


def eager_attentions(family: str, inputs: dict) -> tuple[torch.Tensor, ...]:
    """A fresh unpatched model of ``family`` with the same (seeded) weights, transformers' eager attention."""
    model = tiny_model(family)
    model.set_attn_implementation("eager")
    with torch.no_grad():
        return model(**inputs, output_attentions=True).attentions


def png_size(path) -> tuple[int, int]:
    with Image.open(path) as image:
        assert image.format == "PNG"
        image.load()  # a truncated file fails here
        return image.size


def expected_map_size(heads: int, rows: int, panel: float = 2.4, dpi: int = 100) -> tuple[int, int]:
    # The size plot_attention_maps documents.
    return round(dpi * (panel * heads + 1.2)), round(dpi * (panel * rows + 1.0))


@pytest.mark.parametrize("family", family_names(core=True, causal=True))
def test_decoder_maps_are_the_patched_and_the_eager_models_attentions(family, tmp_path):
    from recipes_helpers import word_tokenizer

    tokenizer = word_tokenizer(pad=True)  # 40 word ids, all inside the tiny models' vocabulary of 64
    assert len(tokenizer) <= VOCAB
    encoded = tokenizer(["the cat sat on the mat under a big tree", "a dog ran"], padding=True, return_tensors="pt")
    inputs = {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]}
    length = int(encoded["attention_mask"][1].sum())  # the second example is right-padded: 3 real tokens
    assert length == 3 and encoded["input_ids"].shape[1] == 10

    model = hf_neural_attn.patch_model(tiny_model(family), "qana", h=4)
    perturb_scorers(model, std=0.3)  # the nonlinear path is live: the maps must differ
    model.train()  # drawing switches to eval for its forward passes and must switch back
    before = snapshot(model)
    with torch.no_grad():
        logits_before = model.eval()(**inputs).logits
    model.train()

    path = tmp_path / "maps.png"
    maps = plotting.plot_attention_maps(model, inputs, path, layer=1, tokenizer=tokenizer)
    assert maps.path == path and path.stat().st_size > 10_000
    assert png_size(path) == maps.size_px == expected_map_size(HEADS, rows=3)
    assert maps.layer == 1 and maps.heads == [0, 1, 2, 3]
    assert maps.tokens == ["the", "cat", "sat", "on", "the", "mat", "under", "a", "big", "tree"]
    assert maps.patched.shape == maps.unpatched.shape == (HEADS, 10, 10)

    first = {key: value[:1] for key, value in inputs.items()}  # the maps run example 0 as a batch of one
    with torch.no_grad():
        patched_reference = model.eval()(**first, output_attentions=True).attentions[1][0].numpy()
    model.train()
    unpatched_reference = eager_attentions(family, inputs)[1][0].numpy()
    np.testing.assert_allclose(maps.patched, patched_reference, rtol=0, atol=1e-7)
    np.testing.assert_allclose(maps.unpatched, unpatched_reference, rtol=0, atol=1e-6)
    for values in (maps.patched, maps.unpatched):
        np.testing.assert_allclose(values.sum(-1), 1.0, atol=1e-5)  # each query row is a distribution
        assert np.all(np.triu(values, k=1) == 0)  # causal: no weight on later keys
    assert np.abs(maps.difference).max() > 1e-3, "the perturbed scorer should change the maps"
    assert 0 < maps.total_variation() < 1
    assert_unchanged(model, before, inputs, logits_before)

    # Example 1 is padded: its maps keep only the 3 real positions (queries and keys).
    padded = plotting.attention_maps(model, inputs, layer=0, example=1, tokenizer=tokenizer)
    assert padded.patched.shape == padded.unpatched.shape == (HEADS, length, length)
    assert padded.tokens == ["a", "dog", "ran"]
    np.testing.assert_allclose(padded.unpatched, eager_attentions(family, inputs)[0][1, :, :3, :3], atol=1e-6)


@pytest.mark.parametrize("dpi", [100, 60])
def test_token_labels_are_readable_at_the_saved_dpi_and_no_text_overlaps(dpi, tmp_path, monkeypatch):
    """48 word tokens (up to 5 letters, written along the keys' axis): every label of the saved image is at least
    7 points and 10 pixels high at the dpi it is saved at, labels the token at its position (every k-th one), and no
    text overlaps another or leaves the image."""
    from helpers.figures import capture_saved_figures, drawn_tick_labels, font_pixels, overlapping_texts
    from recipes_helpers import WORDS, word_tokenizer

    tokenizer = word_tokenizer(pad=False)
    words = [WORDS[(7 * index) % len(WORDS)] for index in range(48)]
    inputs = {"input_ids": tokenizer([" ".join(words)], return_tensors="pt")["input_ids"]}
    assert inputs["input_ids"].shape == (1, 48)
    model = hf_neural_attn.patch_model(tiny_gpt2(), "qana", h=4)
    saved = capture_saved_figures(monkeypatch)
    maps = plotting.plot_attention_maps(
        model, inputs, tmp_path / "maps.png", tokenizer=tokenizer, title="a title", dpi=dpi
    )
    assert maps.tokens == words and png_size(maps.path) == maps.size_px == expected_map_size(HEADS, 3, dpi=dpi)
    [(figure, saved_dpi)] = saved
    assert saved_dpi == dpi
    overlaps = overlapping_texts(figure)
    assert overlaps == [], overlaps[:10]
    map_axes = [axis for axis in figure.axes if axis.images and axis.get_label() != "<colorbar>"]
    labelled = {"x": 0, "y": 0}
    for axis in figure.axes:  # the maps' and the colour bars' labels
        for which in ("x", "y"):
            for position, label in drawn_tick_labels(axis, which):
                assert label.get_fontsize() >= 7 and font_pixels(label, dpi) >= 10, (label.get_text(), dpi)
                if axis in map_axes:
                    assert label.get_text() == words[round(position)]
                    labelled[which] += 1
    assert labelled["x"] >= 4 * 8 and labelled["y"] >= 3 * 8  # every map column and row: a label at least every 6


def test_vit_maps_with_chosen_heads_and_no_difference_row(tmp_path):
    inputs = model_inputs("vit", batch=2)
    model = hf_neural_attn.patch_model(tiny_vit(), "neural", h=4)
    perturb_scorers(model, std=1.0)  # the tiny random ViT attends almost uniformly: push the scorer harder
    before = snapshot(model)
    with torch.no_grad():
        logits_before = model(**inputs).logits

    path = tmp_path / "vit.png"
    maps = plotting.plot_attention_maps(model, inputs, path, heads=[0, 2], difference=False, example=1)
    assert maps.layer == 0  # the first patched layer by default
    assert png_size(path) == maps.size_px == expected_map_size(2, rows=2)
    assert maps.tokens is None
    tokens = (16 // 4) ** 2 + 1  # 16 patches and [CLS]; bidirectional
    assert maps.patched.shape == maps.unpatched.shape == (2, tokens, tokens)
    np.testing.assert_allclose(maps.unpatched, eager_attentions("vit", inputs)[0][1, [0, 2]].numpy(), atol=1e-6)
    np.testing.assert_allclose(maps.unpatched.sum(-1), 1.0, atol=1e-5)
    np.testing.assert_allclose(maps.patched.sum(-1), 1.0, atol=1e-5)
    assert np.abs(maps.difference).max() > 1e-3
    assert np.all(maps.unpatched > 0)  # no mask: every key gets some weight
    assert_unchanged(model, before, inputs, logits_before)


def test_function_preserving_patch_draws_identical_maps_and_zero_change(tmp_path):
    inputs = model_inputs("llama", batch=1, seq=9)
    model = hf_neural_attn.patch_model(tiny_llama(), "qana", h=4, layers=[1])
    maps = plotting.plot_attention_maps(model, inputs, tmp_path / "init.png")
    assert maps.layer == 1
    np.testing.assert_allclose(maps.patched, maps.unpatched, rtol=0, atol=1e-6)
    (record,) = plotting.scorer_statistics(model, probe=inputs)
    assert record["layer"] == 1 and record["gate"] == [1.0] * HEADS
    assert record["attention_change"] < 1e-6


@pytest.mark.parametrize("impl", PORTABLE_IMPLS)
def test_maps_and_statistics_for_every_impl_and_layers_choice(family, impl, tmp_path):
    """Every layer's maps and every patched layer's statistics, whichever layers are patched and whichever path
    computes them (the helpers' tiny models run SDPA, whose layers return no maps of their own)."""
    inputs = model_inputs(family, batch=2, seq=9)
    unpatched = eager_attentions(family, inputs)
    for layers in ([0], [1], None):
        model = hf_neural_attn.patch_model(tiny_model(family), "qana", h=4, layers=layers, impl=impl)
        perturb_scorers(model)
        scored = model.config.hf_neural_attn["layers"]
        for layer in (0, 1):
            maps = plotting.attention_maps(model, inputs, layer=layer, example=1)
            np.testing.assert_allclose(maps.unpatched, unpatched[layer][1].numpy(), rtol=0, atol=1e-6)
            if layer < min(scored):  # nothing scored before it: the patched model's map is the unpatched one
                np.testing.assert_array_equal(maps.patched, maps.unpatched)
            else:
                assert maps.total_variation() > 1e-4, (layers, layer)
        records = plotting.scorer_statistics(model, probe=inputs)
        assert [record["layer"] for record in records] == scored
        assert all(0 < record["attention_change"] < 1 for record in records)
    path = tmp_path / "maps.png"  # the last model: every layer scored
    assert png_size(plotting.plot_attention_maps(model, inputs, path, layer=1).path) == expected_map_size(HEADS, 3)


def test_gate_history_over_training_steps(tmp_path):
    inputs = model_inputs("gpt2", batch=4, seq=16)
    probe = {"input_ids": inputs["input_ids"][:1]}
    model = hf_neural_attn.patch_model(tiny_gpt2(), "qana", h=4)
    tracker = plotting.ScorerTracker(probe=probe)
    tracker.record(model, 0)
    optimizer = torch.optim.AdamW(hf_neural_attn.scorer_parameters(model).values(), lr=0.05)
    model.train()
    for step in range(1, 5):
        model(**inputs, labels=inputs["input_ids"]).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        tracker.record(model, step)
    assert model.training, "recording must leave train mode on"

    history = json.loads(json.dumps(tracker.history))  # JSON-ready, and the plot reads it back as such
    assert [entry["step"] for entry in history] == [0, 1, 2, 3, 4]
    first, last = history[0]["layers"], history[-1]["layers"]
    assert [r["layer"] for r in first] == [r["layer"] for r in last] == [0, 1]
    for start, end in zip(first, last):
        assert start["gate"] == [1.0] * HEADS and len(end["gate"]) == HEADS
        # QANA's gate gets its first gradient on the second step; four Adam steps of 0.05 move it visibly.
        assert max(abs(a - b) for a, b in zip(start["gate"], end["gate"])) > 0.02
        assert end["gate_mean"] == pytest.approx(np.mean(end["gate"]), abs=1e-6)
        assert end["gate_abs_mean"] == pytest.approx(np.mean(np.abs(end["gate"])), abs=1e-6)
        assert abs(end["param_norm"] - start["param_norm"]) > 1e-3
        assert start["attention_change"] < 1e-6 < end["attention_change"] < 1
    # param_norm is the norm of everything the patch added but the gate.
    scorer = model.transformer.h[0].attn.attn_scorer
    expected = torch.cat([p.detach().flatten() for n, p in scorer.named_parameters() if n != "gate"]).norm()
    assert last[0]["param_norm"] == pytest.approx(float(expected), rel=1e-5)

    path = plotting.plot_scorer_history(history, tmp_path / "history.png", title="tiny GPT-2, 4 steps")
    assert path.stat().st_size > 10_000
    assert png_size(path) == (round(100 * 4.2 * 3), 360)  # three panels: gate, norm, attention change


def test_history_of_a_gateless_scorer_has_no_gate_panel(tmp_path):
    model = hf_neural_attn.patch_model(tiny_vit(), "neural", h=4, mode="replace", layers=[0])
    tracker = plotting.ScorerTracker()  # no probe: no attention change either
    for step in range(3):
        perturb_scorers(model, std=0.1 * (step + 1), seed=step)
        tracker.record(model, 10 * step)
    (record,) = tracker.history[-1]["layers"]
    assert record["gate"] is None and record["gate_mean"] is None and "attention_change" not in record
    assert png_size(tracker.plot(tmp_path / "norms.png")) == (round(100 * 4.2), 360)


def test_clear_errors():
    model = tiny_llama()
    inputs = model_inputs("llama", batch=1)
    with pytest.raises(ValueError, match="not patched: pass layer="):
        plotting.attention_maps(model, inputs)
    plain = plotting.attention_maps(model, inputs, layer=0)  # an unpatched (SDPA) model draws with its layer given
    assert plain.patched.shape == (HEADS, 12, 12) and np.array_equal(plain.patched, plain.unpatched)
    hf_neural_attn.patch_model(model, "qana")
    with pytest.raises(ValueError, match="layer must be an attention layer index in 0..1"):
        plotting.attention_maps(model, inputs, layer=2)
    with pytest.raises(ValueError, match="heads must be indices in 0..3"):
        plotting.attention_maps(model, inputs, heads=[4])
    with pytest.raises(ValueError, match="example=1 is out of range"):
        plotting.attention_maps(model, inputs, example=1)
    with pytest.raises(ValueError, match="history is empty"):
        plotting.plot_scorer_history([], "unused.png")


@pytest.mark.spawns
def test_importing_the_package_does_not_import_matplotlib():
    code = "import sys, hf_neural_attn, hf_neural_attn.plotting; print('matplotlib' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip() == "False"
