"""transformers' own entry points on a patched checkpoint: patched once hf_neural_attn is imported, refused
without it, never the unpatched base model in silence."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from helpers.models import CORE_FAMILIES, IMAGE, family_case, model_inputs, perturb_scorers, tiny_llama, tiny_model
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForImageClassification,
    ByT5Tokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaModel,
)

import hf_neural_attn

TOL = 1e-5  # fp32 reload of the same weights


@pytest.fixture(scope="module")
def llama_checkpoint(tmp_path_factory):
    """A saved QANA-patched tiny Llama with perturbed scorers, and its logits on fixed inputs."""
    folder = tmp_path_factory.mktemp("patched-llama")
    model = hf_neural_attn.patch_model(tiny_llama(), "qana", h=4, layers=[1])
    perturb_scorers(model)
    inputs = model_inputs("llama")
    with torch.no_grad():
        logits = model(**inputs).logits
        hidden = model.model(**inputs).last_hidden_state
    model.save_pretrained(folder)
    torch.save({"inputs": inputs, "logits": logits}, folder / "expected.pt")
    return folder, inputs, logits, hidden


def test_config_json_names_the_library_and_keeps_the_base_type(llama_checkpoint):
    folder, *_ = llama_checkpoint
    saved = json.loads((folder / "config.json").read_text())
    assert saved["model_type"] == "hf_neural_attn"
    assert saved["attn_implementation"] == "hf_neural_attn"
    assert saved["hf_neural_attn"]["base_model_type"] == "llama"
    assert saved["auto_map"]["AutoConfig"] == "hf_neural_attn_loader.PatchedCheckpointConfig"
    assert (folder / "hf_neural_attn_loader.py").exists()
    config = AutoConfig.from_pretrained(folder)
    assert isinstance(config, LlamaConfig) and config.model_type == "llama"
    assert config.hf_neural_attn["scorer"] == "qana"


def test_auto_classes_load_a_patched_checkpoint_patched(llama_checkpoint):
    folder, inputs, logits, hidden = llama_checkpoint
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert type(model) is LlamaForCausalLM and hf_neural_attn.is_patched(model)
    torch.testing.assert_close(model(**inputs).logits, logits, rtol=0, atol=TOL)

    base = AutoModel.from_pretrained(folder)
    assert type(base) is LlamaModel and hf_neural_attn.is_patched(base)
    torch.testing.assert_close(base(**inputs).last_hidden_state, hidden, rtol=0, atol=TOL)


def test_auto_from_config_of_a_patched_model_builds_a_patched_model(llama_checkpoint):
    folder, *_ = llama_checkpoint
    config = AutoConfig.from_pretrained(folder)
    fresh = AutoModelForCausalLM.from_config(config)
    assert type(fresh) is LlamaForCausalLM and hf_neural_attn.is_patched(fresh)
    assert fresh.config.hf_neural_attn["layers"] == [1]
    assert fresh.config is not config  # the new model owns its config too


@pytest.mark.parametrize("family", [name for name in CORE_FAMILIES if name != "llama"])  # Llama: the tests above
def test_auto_classes_on_other_families(family, tmp_path):
    auto_class = AutoModelForImageClassification if family_case(family).inputs == IMAGE else AutoModelForCausalLM
    model = hf_neural_attn.patch_model(tiny_model(family), "neural", proj_dim=2)
    perturb_scorers(model)
    inputs = model_inputs(family)
    model.save_pretrained(tmp_path)
    reloaded = auto_class.from_pretrained(tmp_path)
    assert type(reloaded) is type(model) and hf_neural_attn.is_patched(reloaded)
    torch.testing.assert_close(reloaded(**inputs).logits, model(**inputs).logits, rtol=0, atol=TOL)


def _run_without_importing_the_library(code: str, *, block_library: bool) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter that never imports hf_neural_attn (and cannot, if ``block_library``)."""
    # An import hook that answers as a machine without the package would (it is installed in the test venv).
    prelude = textwrap.dedent(
        """
        import sys
        class _NotInstalled:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "hf_neural_attn":
                    raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        sys.meta_path.insert(0, _NotInstalled())
        """
    )
    prelude = prelude if block_library else ""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    return subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )


@pytest.mark.spawns
def test_without_the_library_every_transformers_entry_point_refuses(llama_checkpoint):
    folder, *_ = llama_checkpoint
    result = _run_without_importing_the_library(
        f"""
        from transformers import AutoModelForCausalLM, LlamaForCausalLM
        for load in (
            lambda: AutoModelForCausalLM.from_pretrained({str(folder)!r}),
            lambda: AutoModelForCausalLM.from_pretrained({str(folder)!r}, trust_remote_code=True),
            lambda: LlamaForCausalLM.from_pretrained({str(folder)!r}),
        ):
            try:
                load()
                print("LOADED")
            except Exception as error:
                print("REFUSED", type(error).__name__, " ".join(str(error).split()))
        """,
        block_library=True,
    )
    # transformers' trust_remote_code prompt prints without a newline: find each outcome within its line.
    lines = [
        re.search(r"(REFUSED|LOADED).*", line).group(0)
        for line in result.stdout.splitlines()
        if re.search("REFUSED|LOADED", line)
    ]
    assert len(lines) == 3, result.stderr[-3000:]
    assert all(line.startswith("REFUSED") for line in lines), lines
    # Without trust_remote_code, transformers points at the loader file (whose docstring names the package).
    assert "trust_remote_code=True" in lines[0]
    # With it, the loader's import names the package to install.
    assert "hf_neural_attn" in lines[1] and "pip install" in lines[1]
    # The plain class refuses the recorded attention implementation by name.
    assert 'attn_implementation="hf_neural_attn"' in lines[2]


@pytest.mark.spawns
def test_trusting_the_loader_file_with_the_library_installed_loads_patched(llama_checkpoint):
    folder, *_ = llama_checkpoint
    result = _run_without_importing_the_library(
        f"""
        import torch
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained({str(folder)!r}, trust_remote_code=True)
        expected = torch.load({str(folder / "expected.pt")!r})
        print(type(model).__name__, float((model(**expected["inputs"]).logits - expected["logits"]).abs().max()))
        """,
        block_library=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    name, error = result.stdout.split()
    assert name == "LlamaForCausalLM" and float(error) <= TOL


def test_a_plain_config_class_reading_a_patched_config_builds_a_patched_model(llama_checkpoint, tmp_path):
    """``LlamaConfig.from_pretrained`` of a patched folder (not AutoConfig) keeps the record, and the file's
    ``model_type`` and ``attn_implementation`` (ours): the model built from it is patched as the record says, over
    the recorded base, and records the base model type, so it saves and loads as any patched model."""
    folder, inputs, *_ = llama_checkpoint
    model = LlamaForCausalLM(LlamaConfig.from_pretrained(folder)).eval()
    assert hf_neural_attn.is_patched(model)
    record = hf_neural_attn.patch_record(model)
    assert (record.scorer, record.layers, record.base_model_type) == ("qana", (1,), "llama")
    assert (
        record.base_attn_implementation
        == json.loads((folder / "config.json").read_text())["hf_neural_attn"]["base_attn_implementation"]
    )
    model.save_pretrained(tmp_path)
    torch.testing.assert_close(
        hf_neural_attn.from_pretrained(tmp_path)(**inputs).logits, model(**inputs).logits, rtol=0, atol=TOL
    )


def test_a_plain_model_set_to_the_patch_name_by_hand_fails_loudly_and_patches_over_eager():
    """A config without the record, set to the patch's name by hand: the model cannot run as if patched, and a patch
    records the base it then runs (eager), not the patch's own name."""
    hf_neural_attn.patch_model(tiny_llama(), "qana")  # the attention function is registered once a patch exists
    model = tiny_llama(attn_implementation="hf_neural_attn")
    assert not hf_neural_attn.is_patched(model)
    with pytest.raises(RuntimeError, match="set by hand on a config that carries no patch"):
        model(**model_inputs("llama"))
    hf_neural_attn.patch_model(model, "qana")
    assert hf_neural_attn.patch_record(model).base_attn_implementation == "eager"
    model(**model_inputs("llama"))


def test_checkpoints_saved_before_the_patched_model_type_still_load(llama_checkpoint, tmp_path):
    """Checkpoints of earlier releases kept the base model_type and carried only the record."""
    folder, inputs, logits, _ = llama_checkpoint
    for name in ("model.safetensors", "generation_config.json"):
        (tmp_path / name).write_bytes((folder / name).read_bytes())
    saved = json.loads((folder / "config.json").read_text())
    saved["model_type"] = saved["hf_neural_attn"].pop("base_model_type")
    del saved["attn_implementation"], saved["auto_map"]
    (tmp_path / "config.json").write_text(json.dumps(saved))
    model = hf_neural_attn.from_pretrained(tmp_path)
    torch.testing.assert_close(model(**inputs).logits, logits, rtol=0, atol=TOL)


@pytest.mark.spawns
def test_without_the_library_a_tokenizer_loads_when_remote_code_is_declined(llama_checkpoint, tmp_path):
    """transformers 5's AutoTokenizer reads the config first, and a patched config.json names the library's loader
    file in auto_map, so without the library transformers asks whether to run it. Declining up front loads the
    tokenizer, with no question asked (docs/api.md)."""
    folder = shutil.copytree(llama_checkpoint[0], tmp_path / "with-tokenizer")
    ByT5Tokenizer().save_pretrained(folder)
    result = _run_without_importing_the_library(
        f"""
        from transformers import AutoTokenizer
        print(type(AutoTokenizer.from_pretrained({str(folder)!r}, trust_remote_code=False)).__name__)
        """,
        block_library=True,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split()[-1] == "ByT5Tokenizer"
    assert "Do you wish to run the custom code" not in result.stdout + result.stderr
