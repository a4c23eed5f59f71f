"""Contract 6 (checkpoints save, reload and push like any HF model) and the checkpoint half of 7: the round trip runs on
every kind of checkpoint (helpers.checkpoints.CHECKPOINT_KINDS: full, adapter), the rest on full checkpoints. What only
adapters do: tests/loading/test_adapter_checkpoint.py. Damaged checkpoints: tests/loading/test_damaged_checkpoints.py;
push_to_hub and loading by repo id: tests/integrations/test_hub_http.py."""

import copy
import json
from pathlib import Path

import pytest
import torch
from helpers.checkpoints import CHECKPOINT_KINDS, save_checkpoint, saved_record
from helpers.models import logits, model_inputs, perturb_scorers, tiny_gpt2, tiny_llama
from safetensors.torch import load_file

import hf_neural_attn
from hf_neural_attn.record import RECORD_FORMAT

PICKLE_SUFFIXES = {".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt"}


def test_save_pretrained_writes_safetensors_and_the_patch_record(tmp_path):
    model, folder = save_checkpoint(tmp_path, "full", "llama", "neural", h=3, proj_dim=2, layers=[1])
    files = {path.name for path in folder.iterdir()}
    assert "model.safetensors" in files
    assert not {name for name in files if Path(name).suffix in PICKLE_SUFFIXES}
    record = json.loads((folder / "config.json").read_text())["hf_neural_attn"]
    assert record["scorer"] == "neural"
    assert record["layers"] == [1]
    assert record["options"] == model.config.hf_neural_attn["options"]
    assert record["options"]["proj_dim"] == 2 and record["options"]["h"] == 3
    assert record["version"] == hf_neural_attn.__version__
    # The layout's own number, apart from the package version (records of 0.1.0 with and without impl share that): the
    # loaders read it (a newer one is refused, tests/loading/test_damaged_checkpoints.py; none is format 1, whose
    # records still load, tests/loading/test_saved_checkpoints.py).
    assert record["format"] == RECORD_FORMAT == 2 and "impl" not in record["options"]
    saved = load_file(folder / "model.safetensors")
    assert set(hf_neural_attn.scorer_parameters(model)) <= set(saved)


@pytest.mark.parametrize("kind", CHECKPOINT_KINDS)
def test_a_checkpoint_round_trip_reproduces_outputs(tmp_path, kind, family, scorer_name):
    model, folder = save_checkpoint(tmp_path, kind, family, scorer_name)
    assert saved_record(folder, kind) == model.config.hf_neural_attn
    inputs = model_inputs(family)
    expected = logits(model, inputs)
    base_model = hf_neural_attn.unpatch_model(copy.deepcopy(model))
    state = torch.random.get_rng_state()
    loaded = CHECKPOINT_KINDS[kind].load(folder)
    assert torch.equal(torch.random.get_rng_state(), state), "loading must not consume the caller's RNG"
    assert type(loaded) is type(model) and hf_neural_attn.is_patched(loaded)
    assert loaded.config.hf_neural_attn == model.config.hf_neural_attn
    torch.testing.assert_close(logits(loaded.eval(), inputs), expected, rtol=0, atol=1e-6)
    # The scorer tensors are the saved ones, not a fresh init: the perturbed scorers move the logits by 1e-4 (Neural
    # Attention's residual path) to 7e-2 (QANA) from the base model's, far beyond the 1e-6 tolerance above.
    assert (logits(loaded, inputs) - logits(base_model, inputs)).abs().max() > 1e-5
    # A reloaded model is an ordinary patched model: it unpatches to the base weights.
    hf_neural_attn.unpatch_model(loaded)
    assert not hf_neural_attn.scorer_parameters(loaded)
    torch.testing.assert_close(logits(loaded, inputs), logits(base_model, inputs), rtol=0, atol=1e-6)


def test_sharded_checkpoint_round_trip(tmp_path):
    model = tiny_llama()
    hf_neural_attn.patch_model(model, "qana")
    perturb_scorers(model)
    folder = tmp_path / "sharded"
    model.save_pretrained(folder, max_shard_size="20KB")
    assert (folder / "model.safetensors.index.json").exists()
    inputs = model_inputs("llama")
    loaded = hf_neural_attn.from_pretrained(folder)
    torch.testing.assert_close(logits(loaded, inputs), logits(model, inputs), rtol=0, atol=1e-6)


def test_from_pretrained_passes_hf_kwargs(tmp_path):
    model, folder = save_checkpoint(tmp_path, "full", "llama", "qana")
    loaded = hf_neural_attn.from_pretrained(folder, dtype=torch.bfloat16)
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}
    inputs = model_inputs("llama")
    expected = logits(model.to(torch.bfloat16), inputs)
    # bf16 keeps ~3 significant digits; loading in bf16 and casting a loaded model round at different
    # points (observed up to 2e-3 on logits of magnitude 0.35).
    torch.testing.assert_close(logits(loaded, inputs), expected, rtol=0, atol=1e-2)


def test_from_pretrained_keeps_the_saved_base_implementation(tmp_path):
    model = tiny_llama(attn_implementation="eager")
    hf_neural_attn.patch_model(model, "qana", layers=[1])
    perturb_scorers(model)
    model.save_pretrained(tmp_path / "eager")
    inputs = model_inputs("llama")
    loaded = hf_neural_attn.from_pretrained(tmp_path / "eager")
    assert loaded.config.hf_neural_attn == model.config.hf_neural_attn
    assert torch.equal(logits(loaded, inputs), logits(model, inputs))
    hf_neural_attn.unpatch_model(loaded)
    assert loaded.config._attn_implementation == "eager"
    # An explicit choice wins over the record.
    assert (
        hf_neural_attn.from_pretrained(tmp_path / "eager", attn_implementation="sdpa").config.hf_neural_attn[
            "base_attn_implementation"
        ]
        == "sdpa"
    )


def test_from_pretrained_leaves_a_passed_config_untouched(tmp_path):
    from transformers import AutoConfig

    model, folder = save_checkpoint(tmp_path, "full", "gpt2")
    config = AutoConfig.from_pretrained(folder)
    inputs = model_inputs("gpt2")
    for _ in range(2):
        loaded = hf_neural_attn.from_pretrained(folder, config=config)
        torch.testing.assert_close(logits(loaded, inputs), logits(model, inputs), rtol=0, atol=1e-6)
    assert config.hf_neural_attn == model.config.hf_neural_attn


def test_unpatched_checkpoint_is_refused_with_a_hint(tmp_path):
    folder = tmp_path / "plain"
    tiny_gpt2().save_pretrained(folder)
    with pytest.raises(ValueError, match="not a hf_neural_attn checkpoint.*patch_model"):
        hf_neural_attn.from_pretrained(folder)
