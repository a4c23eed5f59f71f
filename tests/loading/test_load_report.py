"""transformers' own load report comes through when a patched checkpoint loads, as it does for the base model.

Tools and tests read transformers' logger (transformers' ``test_can_load_ignoring_mismatched_shapes`` looks for
"Reinit due to size mismatch" there). Loading through ``hf_neural_attn.from_pretrained`` or an Auto class, the
report lists what it lists for the base model (missing, unexpected and mismatched weights) and never what the
patch fills afterwards: the scorer tensors, and QANA's narrower ``key_dim`` projections. The library's own warnings
do not repeat the list. Captured as transformers' own tests capture it (``testing_utils.CaptureLogger``).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from helpers.models import logits, model_inputs, perturb_scorers, tiny_llama
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification
from transformers.testing_utils import CaptureLogger
from transformers.utils import logging

import hf_neural_attn

LOAD_LOGGER = "transformers.modeling_utils"


def load_logged(*args, **kwargs):
    """(model or (model, info), what transformers logged, the library's warnings) of one from_pretrained."""
    with CaptureLogger(logging.get_logger(LOAD_LOGGER)) as captured, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = hf_neural_attn.from_pretrained(*args, **kwargs)
    ours = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    return loaded, captured.out, ours


def save_patched(folder: Path, model=None, **options) -> torch.nn.Module:
    model = model if model is not None else tiny_llama()
    hf_neural_attn.patch_model(model, "qana", h=2, **options)
    perturb_scorers(model)
    model.save_pretrained(folder)
    return model


def edit_weights(folder: Path, edit) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_a_clean_load_logs_no_report_and_no_scorer_weight(tmp_path):
    model = save_patched(tmp_path / "full")
    (loaded, info), log, ours = load_logged(tmp_path / "full", output_loading_info=True)
    assert "LOAD REPORT" not in log and "attn_scorer" not in log
    assert ours == []
    assert not info["unexpected_keys"] and not info["missing_keys"] and not info["mismatched_keys"]
    torch.testing.assert_close(logits(loaded, model_inputs("llama")), logits(model, model_inputs("llama")))
    with CaptureLogger(logging.get_logger(LOAD_LOGGER)) as captured:
        AutoModelForCausalLM.from_pretrained(tmp_path / "full")
    assert "LOAD REPORT" not in captured.out


def test_mismatched_sizes_are_logged_by_transformers_and_refused_without_the_flag(tmp_path):
    """transformers' test_can_load_ignoring_mismatched_shapes, through hf_neural_attn."""
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(LlamaConfig(**tiny_llama().config.to_diff_dict(), num_labels=3)).eval()
    save_patched(tmp_path / "full", model)
    with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):
        hf_neural_attn.from_pretrained(tmp_path / "full", num_labels=5)
    loaded, log, ours = load_logged(tmp_path / "full", num_labels=5, ignore_mismatched_sizes=True)
    assert "Reinit due to size mismatch" in log and "score.weight" in log
    assert "attn_scorer" not in log
    assert not any("score.weight" in message for message in ours)  # not repeated by the library
    assert loaded.score.weight.shape[0] == 5
    saved = hf_neural_attn.scorer_parameters(model)
    assert all(torch.equal(p, saved[n]) for n, p in hf_neural_attn.scorer_parameters(loaded).items())


def test_missing_and_unexpected_base_weights_are_logged_as_for_the_base_model(tmp_path):
    save_patched(tmp_path / "full")
    dropped = "model.layers.1.mlp.up_proj.weight"

    def edit(tensors):
        del tensors[dropped]
        tensors["model.layers.1.mlp.extra.weight"] = torch.zeros(2, 2)

    edit_weights(tmp_path / "full", edit)
    (_, info), log, ours = load_logged(tmp_path / "full", output_loading_info=True)
    assert "MISSING" in log and "up_proj" in log
    assert "UNEXPECTED" in log and "mlp.extra" in log
    assert "attn_scorer" not in log
    assert ours == []
    assert dropped in info["missing_keys"] and "model.layers.1.mlp.extra.weight" in info["unexpected_keys"]
    assert not any("attn_scorer" in key for key in info["unexpected_keys"])


def test_key_dim_projections_are_not_reported_as_mismatched(tmp_path):
    model = tiny_llama()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # key_dim is a from-scratch option: it warns
        save_patched(tmp_path / "full", model, key_dim=4)
    (loaded, info), log, _ = load_logged(tmp_path / "full", output_loading_info=True)
    assert "LOAD REPORT" not in log and "q_proj" not in log
    assert not info["mismatched_keys"]
    torch.testing.assert_close(logits(loaded, model_inputs("llama")), logits(model, model_inputs("llama")))


def test_an_adapter_on_a_base_without_some_weights_names_them_once(tmp_path):
    LlamaForCausalLM(LlamaConfig(**tiny_llama().config.to_diff_dict())).save_pretrained(tmp_path / "base")
    model = LlamaForSequenceClassification.from_pretrained(tmp_path / "base", num_labels=3)  # head not in the base
    hf_neural_attn.patch_model(model, "qana", h=2)
    hf_neural_attn.save_adapter(model, tmp_path / "adapter")
    config = LlamaConfig.from_pretrained(tmp_path / "base", num_labels=3)
    _, log, ours = load_logged(tmp_path / "adapter", config=config)
    assert "MISSING" in log and "score.weight" in log  # transformers' report
    assert "attn_scorer" not in log
    assert len(ours) == 1 and "lacks 1 weight" in ours[0] and "not in the adapter" in ours[0]
    assert "score.weight" not in ours[0]  # named once, by transformers
