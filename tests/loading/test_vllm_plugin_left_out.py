"""A patched checkpoint's config read in a vLLM process whose plugins were loaded without the library's (its entry
point left out of ``VLLM_PLUGINS``): the read fails naming hf_neural_attn and the fix, instead of vLLM building its own
implementation of the base model and failing on the scorers' weights. vLLM's side is faked here (its two module
attributes the check reads); tests/integrations/test_vllm.py runs it in vLLM itself."""

from __future__ import annotations

import importlib.metadata
import sys
import types

import pytest
from helpers.models import tiny_llama
from transformers import AutoConfig

import hf_neural_attn
from hf_neural_attn.patched_config import VLLM_PLUGIN_NAME, is_patched_config


@pytest.fixture
def checkpoint(tmp_path):
    model = tiny_llama()
    hf_neural_attn.patch_model(model, "qana")
    model.save_pretrained(tmp_path)
    return tmp_path


def in_vllm(monkeypatch, allowed: list[str] | None) -> None:
    """As in a vLLM process that has loaded its general plugins, with ``VLLM_PLUGINS`` parsed as ``allowed``."""
    monkeypatch.setitem(sys.modules, "vllm.plugins", types.SimpleNamespace(plugins_loaded=True))
    monkeypatch.setitem(sys.modules, "vllm.envs", types.SimpleNamespace(VLLM_PLUGINS=allowed))


def test_the_plugin_name_is_the_entry_point_name():
    (entry,) = [
        entry for entry in importlib.metadata.entry_points(group="vllm.general_plugins")
        if entry.value.startswith("hf_neural_attn.")
    ]  # fmt: skip
    assert entry.name == VLLM_PLUGIN_NAME


def test_left_out_of_vllm_plugins_the_config_read_names_the_library(checkpoint, monkeypatch):
    in_vllm(monkeypatch, ["none"])
    with pytest.raises(ValueError, match="hf_neural_attn.*VLLM_PLUGINS.*name, hf_neural_attn,"):
        AutoConfig.from_pretrained(checkpoint)


@pytest.mark.parametrize("allowed", [None, ["other", VLLM_PLUGIN_NAME]], ids=["unset", "listed"])
def test_allowed_or_outside_vllm_the_config_reads_patched(checkpoint, monkeypatch, allowed):
    assert is_patched_config(AutoConfig.from_pretrained(checkpoint))  # no vLLM in the process
    in_vllm(monkeypatch, allowed)
    assert is_patched_config(AutoConfig.from_pretrained(checkpoint))
