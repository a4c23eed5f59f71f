"""Checkpoints written by an earlier version of the library still load, with the outputs they were saved with.

``tests/data/checkpoints_0.1.0`` was written by hf_neural_attn 0.1.0 at commit c10b4f2, before the loaders moved
into ``hf_neural_attn/loading/`` (``make.py`` there is the script that wrote it, run against that commit): a
full GPT-2 checkpoint patched with QANA, whose ``hf_neural_attn_loader.py`` imports
``hf_neural_attn.auto.PatchedCheckpointConfig``, and an adapter-only Neural Attention checkpoint on a tiny Llama.
Each ``*_expected.pt`` holds the input ids and the logits the saved model gave. Both records carry the compute path
(``impl``), which 0.1.0 saved and later versions leave out: it is read and ignored, and the model loads on the
default path.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.checkpoints import saved_record
from helpers.paths import scorer_impls
from transformers import AutoModelForCausalLM

import hf_neural_attn

SAVED = Path(__file__).resolve().parents[1] / "data" / "checkpoints_0.1.0"
TOLERANCE = {"rtol": 0, "atol": 1e-6}


def expected(name: str) -> dict[str, torch.Tensor]:
    return torch.load(SAVED / f"{name}_expected.pt", weights_only=True)


def assert_saved_impl_ignored(model, saved_record: dict) -> None:
    """The record on disk carries ``impl``; the loaded model's does not, and its scorers run the default path."""
    assert saved_record["options"]["impl"] == "auto"
    assert "impl" not in hf_neural_attn.patch_record(model).options
    assert scorer_impls(model) == {"auto"}


def logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids).logits


def test_a_full_checkpoint_of_0_1_0_loads_with_its_outputs():
    saved = expected("gpt2_qana_full")
    model = hf_neural_attn.from_pretrained(SAVED / "gpt2_qana_full")
    assert hf_neural_attn.patch_record(model).scorer == "qana"
    assert_saved_impl_ignored(model, saved_record(SAVED / "gpt2_qana_full", "full"))
    torch.testing.assert_close(logits(model, saved["input_ids"]), saved["logits"], **TOLERANCE)


@pytest.mark.spawns
def test_a_full_checkpoint_of_0_1_0_loads_through_the_auto_classes_and_its_loader_file(tmp_path):
    saved = expected("gpt2_qana_full")
    model = AutoModelForCausalLM.from_pretrained(SAVED / "gpt2_qana_full")
    torch.testing.assert_close(logits(model, saved["input_ids"]), saved["logits"], **TOLERANCE)
    # trust_remote_code with the library installed but not imported: transformers runs the saved loader file,
    # whose import of hf_neural_attn.auto.PatchedCheckpointConfig must still work.
    folder = shutil.copytree(SAVED / "gpt2_qana_full", tmp_path / "checkpoint")
    script = (
        "import sys, torch\n"
        "from transformers import AutoModelForCausalLM\n"
        f"model = AutoModelForCausalLM.from_pretrained({str(folder)!r}, trust_remote_code=True)\n"
        "assert 'hf_neural_attn' in sys.modules\n"
        "import hf_neural_attn\n"
        "assert hf_neural_attn.is_patched(model)\n"
        f"saved = torch.load({str(SAVED / 'gpt2_qana_full_expected.pt')!r}, weights_only=True)\n"
        "model.eval()\n"
        "with torch.no_grad():\n"
        "    torch.testing.assert_close(model(saved['input_ids']).logits, saved['logits'], rtol=0, atol=1e-6)\n"
    )
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules")}
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=environment, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]


def test_an_adapter_of_0_1_0_loads_with_its_outputs():
    saved = expected("llama_neural_adapter")
    model = hf_neural_attn.from_pretrained(
        SAVED / "llama_neural_adapter", base_model_name_or_path=str(SAVED / "llama_base")
    )
    record = hf_neural_attn.patch_record(model)
    assert (record.scorer, record.layers) == ("neural", (1,))
    assert_saved_impl_ignored(model, saved_record(SAVED / "llama_neural_adapter", "adapter"))
    torch.testing.assert_close(logits(model, saved["input_ids"]), saved["logits"], **TOLERANCE)
