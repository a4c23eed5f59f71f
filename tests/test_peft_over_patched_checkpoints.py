"""PEFT adapters added through transformers' own integration (``model.add_adapter``) on a model loaded from a patched
checkpoint: the adapter saved by ``save_pretrained`` names that checkpoint as its base, and every way transformers
loads such an adapter folder gives the patched model back, with the trained scorer copies (``modules_to_save``).
"""

from __future__ import annotations

import pytest
import torch
from helpers import logits, model_inputs, perturb_scorers, tiny_llama, transformers_refuses_installed_peft
from transformers import AutoModelForCausalLM

import hf_neural_attn

peft = pytest.importorskip("peft", reason="peft is a dev extra")
_REFUSAL = transformers_refuses_installed_peft()
pytestmark = pytest.mark.skipif(_REFUSAL is not None, reason=str(_REFUSAL))


@pytest.fixture
def lora_folder(tmp_path):
    """(the trained model, the adapter folder): a patched checkpoint, loaded back, LoRA and the scorers added with
    transformers' add_adapter, one Adam step, saved as a PEFT adapter."""
    model = tiny_llama()
    hf_neural_attn.patch_model(model, "qana", h=2)
    perturb_scorers(model)
    model.save_pretrained(tmp_path / "patched")
    model = hf_neural_attn.from_pretrained(tmp_path / "patched")
    config = peft.LoraConfig(
        target_modules=["q_proj", "v_proj"], modules_to_save=hf_neural_attn.peft_modules_to_save(model)
    )
    model.add_adapter(config)
    inputs = model_inputs("llama")
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    logits(model, inputs).square().mean().backward()
    optimizer.step()
    model.eval()
    model.save_pretrained(tmp_path / "lora")
    assert not (tmp_path / "lora" / "config.json").exists()  # an adapter only
    return model, tmp_path / "lora"


@pytest.mark.parametrize("loader", ["hf_neural_attn", "auto"])
def test_a_peft_adapter_over_a_patched_checkpoint_loads_patched(lora_folder, loader):
    model, folder = lora_folder
    if loader == "auto":
        loaded = AutoModelForCausalLM.from_pretrained(folder)
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
    model.add_adapter(peft.LoraConfig(target_modules=["q_proj"]))
    model.save_pretrained(tmp_path / "lora")
    with pytest.raises(ValueError, match="PEFT adapter whose base model .* is not a patched checkpoint"):
        hf_neural_attn.from_pretrained(tmp_path / "lora")
