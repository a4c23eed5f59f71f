"""PEFT adapters over a patched checkpoint: the adapter folder (adapter_config.json, no config.json) names that
checkpoint as its base, and every way transformers loads such a folder gives the patched model back, with the trained
scorer copies (``modules_to_save``).

The folder is written two ways: by PEFT's own ``get_peft_model(...).save_pretrained`` and by transformers' integration
(``model.add_adapter``, as sentence-transformers does). transformers 5.24 refuses every peft older than 0.22 in
``add_adapter`` (and PyPI had none newer when it came out), so the second fixture skips there, saying why; loading a
folder (``hf_neural_attn.from_pretrained``, an Auto class, ``model.load_adapter``) works with that pair, and runs
everywhere.
"""

from __future__ import annotations

import pytest
import torch
from helpers.installed import transformers_refuses_installed_peft
from helpers.models import logits, model_inputs, perturb_scorers, tiny_llama
from transformers import AutoModelForCausalLM

import hf_neural_attn

peft = pytest.importorskip("peft", reason="peft is a dev extra")
ADD_ADAPTER_REFUSAL = transformers_refuses_installed_peft()
WRITERS = ["get_peft_model", pytest.param("add_adapter", marks=pytest.mark.skipif(
    ADD_ADAPTER_REFUSAL is not None, reason=str(ADD_ADAPTER_REFUSAL)))]  # fmt: skip


def train_one_step(model, parameters) -> None:
    inputs = model_inputs("llama")
    optimizer = torch.optim.Adam([p for p in parameters if p.requires_grad], lr=1e-2)
    model.train()
    logits(model, inputs).square().mean().backward()
    optimizer.step()
    model.eval()


@pytest.fixture(params=WRITERS)
def lora_folder(request, tmp_path):
    """(the trained model, the adapter folder): a patched checkpoint, loaded back, LoRA and the scorers added (by PEFT's
    get_peft_model or by transformers' add_adapter), one Adam step, saved as a PEFT adapter."""
    model = tiny_llama()
    hf_neural_attn.patch_model(model, "qana", h=2)
    perturb_scorers(model)
    model.save_pretrained(tmp_path / "patched")
    model = hf_neural_attn.from_pretrained(tmp_path / "patched")
    config = peft.LoraConfig(
        target_modules=["q_proj", "v_proj"], modules_to_save=hf_neural_attn.peft_modules_to_save(model)
    )
    if request.param == "add_adapter":
        model.add_adapter(config)
    else:
        model = peft.get_peft_model(model, config)
    train_one_step(model, model.parameters())
    model.save_pretrained(tmp_path / "lora")
    assert not (tmp_path / "lora" / "config.json").exists()  # an adapter only
    return model, tmp_path / "lora"


@pytest.mark.parametrize("loader", ["hf_neural_attn", "auto", "load_adapter"])
def test_a_peft_adapter_over_a_patched_checkpoint_loads_patched(lora_folder, loader):
    model, folder = lora_folder
    if loader == "auto":
        loaded = AutoModelForCausalLM.from_pretrained(folder)
    elif loader == "load_adapter":  # onto the patched base, loaded by the user
        loaded = hf_neural_attn.from_pretrained(folder.parent / "patched")
        loaded.load_adapter(folder)
    else:
        loaded = hf_neural_attn.from_pretrained(folder)
    assert hf_neural_attn.is_patched(loaded)
    inputs = model_inputs("llama")
    with torch.no_grad():
        torch.testing.assert_close(logits(loaded.eval(), inputs), logits(model, inputs), rtol=0, atol=1e-6)


def test_a_peft_adapter_over_an_unpatched_base_is_refused(tmp_path):
    base = tiny_llama()
    base.save_pretrained(tmp_path / "base")
    model = type(base).from_pretrained(tmp_path / "base")
    peft.get_peft_model(model, peft.LoraConfig(target_modules=["q_proj"])).save_pretrained(tmp_path / "lora")
    with pytest.raises(ValueError, match="PEFT adapter whose base model .* is not a patched checkpoint"):
        hf_neural_attn.from_pretrained(tmp_path / "lora")
