"""A patched checkpoint never loads as the base model: a transformers model class's own ``from_pretrained``, whatever
keywords it gets, returns the patched model once the library is imported; the Auto classes honour
``attn_implementation=`` as ``hf_neural_attn.from_pretrained`` does; and a patched model PEFT still wraps is not saved
under names nothing can load.

What cannot hold: in a process that never imports the library, nothing of it runs, and transformers builds what it
is asked for. Without a keyword the plain class refuses (tests/loading/test_auto_loading.py); with an explicit
``attn_implementation=`` it loads the base weights and lists the scorer tensors as unexpected in its load report,
which the last test checks so the docs (docs/api.md) stay true.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import transformers
from helpers.models import model_inputs, perturb_scorers, tiny_gpt2, tiny_llama, tiny_vit
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaModel,
    ViTForImageClassification,
)

import hf_neural_attn

TOL = 1e-5  # a reload of the same fp32 weights


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    """A saved QANA-patched tiny Llama (sdpa base, layer 1 patched, scorers moved off their init), its inputs and
    logits, and the logits and greedy tokens of the same model with its scorers removed."""
    folder = tmp_path_factory.mktemp("patched-llama")
    model = hf_neural_attn.patch_model(tiny_llama(attn_implementation="sdpa"), "qana", h=4, layers=[1])
    perturb_scorers(model, std=1.0)
    inputs = model_inputs("llama")
    with torch.no_grad():
        logits = model(**inputs).logits
        tokens = model.generate(**inputs, max_new_tokens=6, do_sample=False)
        model.save_pretrained(folder)
        base_tokens = hf_neural_attn.unpatch_model(model).generate(**inputs, max_new_tokens=6, do_sample=False)
    assert not torch.equal(tokens, base_tokens)  # the scorers are live: the base model answers otherwise
    return folder, inputs, logits, tokens


# Keywords HF loading code passes; the served model gets transformers serve's own (its model manager's) set.
KEYWORDS = {
    "none": {},
    "eager": {"attn_implementation": "eager"},
    "sdpa": {"attn_implementation": "sdpa"},
    "dtype-device_map": {"dtype": torch.float64, "device_map": "cpu"},
    "serve": {"attn_implementation": "sdpa", "dtype": "auto", "device_map": "cpu", "trust_remote_code": True,
              "revision": None, "tqdm_class": None},
}  # fmt: skip


@pytest.mark.parametrize("keywords", list(KEYWORDS))
def test_the_plain_class_loads_a_patched_folder_patched(llama_folder, keywords):
    folder, inputs, logits, tokens = llama_folder
    kwargs = KEYWORDS[keywords]
    model = LlamaForCausalLM.from_pretrained(folder, **kwargs)
    assert type(model) is LlamaForCausalLM and hf_neural_attn.is_patched(model)
    record = hf_neural_attn.patch_record(model)
    assert record.layers == (1,) and record.scorer == "qana"
    expected_base = kwargs.get("attn_implementation", "sdpa")  # the keyword, else the saved model's
    assert model.config.base_attn_implementation == expected_base
    with torch.no_grad():
        torch.testing.assert_close(model(**inputs).logits.float(), logits, rtol=0, atol=TOL)
        assert torch.equal(model.generate(**inputs, max_new_tokens=6, do_sample=False), tokens)
    if "dtype" in kwargs and kwargs["dtype"] != "auto":
        assert model.dtype == kwargs["dtype"]


def test_the_class_named_in_the_folder_is_what_transformers_serve_loads(llama_folder):
    """transformers serve reads AutoConfig, then loads ``getattr(transformers, config.architectures[0])``."""
    folder, inputs, _, tokens = llama_folder
    config = AutoConfig.from_pretrained(folder)
    model = getattr(transformers, config.architectures[0]).from_pretrained(folder, **KEYWORDS["serve"])
    assert hf_neural_attn.is_patched(model)
    assert torch.equal(model.generate(**inputs, max_new_tokens=6, do_sample=False), tokens)


def test_config_keyword(llama_folder):
    folder, inputs, logits, _ = llama_folder
    for config in (LlamaConfig.from_pretrained(folder), AutoConfig.from_pretrained(folder)):  # both carry the record
        model = LlamaForCausalLM.from_pretrained(folder, config=config)
        assert hf_neural_attn.is_patched(model), type(config).__name__
        torch.testing.assert_close(model(**inputs).logits, logits, rtol=0, atol=TOL)
    # A config built by hand has no record: the model would come back without its scorers, so that is refused.
    plain = LlamaConfig(**{key: getattr(config, key) for key in ("vocab_size", "hidden_size", "num_hidden_layers")})
    with pytest.raises(ValueError, match=r"is a hf_neural_attn checkpoint.*config=.*no patch record"):
        LlamaForCausalLM.from_pretrained(folder, config=plain)


def test_another_class_of_the_same_model_and_a_class_of_another(llama_folder):
    folder, *_ = llama_folder
    bare = LlamaModel.from_pretrained(folder)  # the bare model of a causal-LM checkpoint, as transformers allows
    assert type(bare) is LlamaModel and hf_neural_attn.is_patched(bare)
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel.*'llama'"):
        GPT2LMHeadModel.from_pretrained(folder)


@pytest.mark.parametrize(
    "build,model_class,family", [(tiny_gpt2, GPT2LMHeadModel, "gpt2"), (tiny_vit, ViTForImageClassification, "vit")]
)
def test_other_families(tmp_path, build, model_class, family):
    model = hf_neural_attn.patch_model(build(), "neural", proj_dim=2)
    perturb_scorers(model)
    model.save_pretrained(tmp_path)
    inputs = model_inputs(family)
    reloaded = model_class.from_pretrained(tmp_path, attn_implementation="eager")
    assert hf_neural_attn.is_patched(reloaded) and reloaded.config.base_attn_implementation == "eager"
    torch.testing.assert_close(reloaded(**inputs).logits, model(**inputs).logits, rtol=0, atol=TOL)


def test_unpatched_folders_load_as_transformers_loads_them(tmp_path):
    model = tiny_llama()
    model.save_pretrained(tmp_path)
    for kwargs in ({}, {"attn_implementation": "eager"}, {"config": LlamaConfig.from_pretrained(tmp_path)}):
        reloaded = LlamaForCausalLM.from_pretrained(tmp_path, **kwargs)
        assert type(reloaded) is LlamaForCausalLM and not hf_neural_attn.is_patched(reloaded)
        inputs = model_inputs("llama")
        torch.testing.assert_close(reloaded(**inputs).logits, model(**inputs).logits, rtol=0, atol=TOL)


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_auto_classes_honour_attn_implementation(llama_folder, implementation):
    folder, inputs, logits, _ = llama_folder
    for load in (
        AutoModelForCausalLM.from_pretrained,
        hf_neural_attn.from_pretrained,
        LlamaForCausalLM.from_pretrained,
    ):
        model = load(folder, attn_implementation=implementation)
        assert model.config.base_attn_implementation == implementation, load
        assert hf_neural_attn.patch_record(model).base_attn_implementation == implementation, load
        torch.testing.assert_close(model(**inputs).logits, logits, rtol=0, atol=TOL)


def test_every_entry_point_refuses_an_invalid_attn_implementation_alike(llama_folder, tmp_path):
    folder, *_ = llama_folder
    tiny_llama().save_pretrained(tmp_path)  # the unpatched model, for what transformers itself says
    with pytest.raises(ValueError, match="banana"):
        LlamaForCausalLM.from_pretrained(tmp_path, attn_implementation="banana")
    for load in (
        AutoModelForCausalLM.from_pretrained,
        hf_neural_attn.from_pretrained,
        LlamaForCausalLM.from_pretrained,
    ):
        with pytest.raises(ValueError, match="banana"):  # transformers' own error, as for the unpatched model
            load(folder, attn_implementation="banana")
        # Not a name at all: transformers fails on it with an AttributeError about str methods; this says what is wrong.
        with pytest.raises(TypeError, match=r"attn_implementation must name an attention implementation.*123"):
            load(folder, attn_implementation=123)


def test_a_patched_model_that_peft_still_wraps_is_not_saved_under_peft_names(tmp_path):
    peft = pytest.importorskip("peft")
    model = hf_neural_attn.patch_model(tiny_llama(), "qana", h=2)
    wrapped = peft.get_peft_model(
        model,
        peft.LoraConfig(r=2, target_modules=["q_proj"], modules_to_save=hf_neural_attn.peft_modules_to_save(model)),
    )
    with pytest.raises(ValueError, match=r"still wrapped by PEFT.*merge_and_unload"):
        wrapped.get_base_model().save_pretrained(tmp_path / "full")
    assert not (tmp_path / "full" / "model.safetensors").exists()
    wrapped.save_pretrained(tmp_path / "adapter")  # PEFT's own save: the adapter, scorer copies included
    merged = wrapped.merge_and_unload()
    merged.save_pretrained(tmp_path / "merged")
    assert hf_neural_attn.is_patched(LlamaForCausalLM.from_pretrained(tmp_path / "merged"))


def _run_without_the_library(code: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter that never imports hf_neural_attn, with transformers' default logging."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("TRANSFORMERS_VERBOSITY", None)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env, timeout=300,
        stdin=subprocess.DEVNULL, check=False,
    )  # fmt: skip


@pytest.mark.spawns
@pytest.mark.parametrize("order", ["library first", "transformers' models first"])
def test_the_plain_class_loads_patched_whichever_is_imported_first(llama_folder, order):
    """The library sets up transformers' from_pretrained when its modeling stack is imported, before or after."""
    folder, *_ = llama_folder
    imports = ["import hf_neural_attn", "from transformers import LlamaForCausalLM"]
    if order != "library first":
        imports.reverse()
    result = _run_without_the_library(
        "\n".join(
            [
                *imports,
                "import sys",
                "print('modeling imported at library import:', 'transformers.modeling_utils' in sys.modules)",
                f"model = LlamaForCausalLM.from_pretrained({str(folder)!r}, attn_implementation='eager')",
                "print('PATCHED', hf_neural_attn.is_patched(model))",
            ]
        )
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "PATCHED True" in result.stdout


@pytest.mark.spawns
def test_without_the_library_an_explicit_attn_implementation_loads_the_base_and_reports_the_scorers(llama_folder):
    folder, *_ = llama_folder
    result = _run_without_the_library(
        f"""
        from transformers import LlamaForCausalLM
        model = LlamaForCausalLM.from_pretrained({str(folder)!r}, attn_implementation="sdpa")
        print("LOADED", type(model).__name__)
        """
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "LOADED LlamaForCausalLM" in result.stdout
    report = result.stdout + result.stderr
    assert "UNEXPECTED" in report and "attn_scorer" in report
    saved = json.loads((folder / "config.json").read_text())
    assert saved["model_type"] == "hf_neural_attn"  # what transformers warns about: another model type
