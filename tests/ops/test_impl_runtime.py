"""The compute path (``impl``) is a run-time setting, not part of the model: ``patch_model(impl=)``,
``from_pretrained(impl=)`` and ``hf_neural_attn.set_impl`` set it, each checks it where it is set, the dispatcher
reads it on every call (a torch.compile'd model included), and no checkpoint saves it.

Checkpoints whose record carries one (older versions saved it): tests/loading/test_loading_trust.py, and the saved
formats of tests/loading/test_saved_checkpoints.py. Which path each choice takes per call:
tests/ops/test_paths_masks_gqa.py.
"""

from __future__ import annotations

import re

import pytest
import torch
from helpers.checkpoints import CHECKPOINT_KINDS, save_checkpoint, saved_record
from helpers.models import logits, model_inputs, perturb_scorers, tiny_gpt2, tiny_llama, tokens
from helpers.paths import scorer_impls

import hf_neural_attn
from hf_neural_attn.ops import dispatch
from hf_neural_attn.ops.triton import triton_unavailable_reason


@pytest.fixture
def paths_taken(monkeypatch) -> list[str]:
    """The paths (keys of dispatch.PATHS) the scored calls take, in order."""
    taken = []
    for name in list(dispatch.PATHS):

        def spy(*args, _original=dispatch.PATHS[name], _name=name, **kwargs):
            taken.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setitem(dispatch.PATHS, name, spy)
    return taken


@pytest.mark.parametrize("kind", CHECKPOINT_KINDS)
def test_no_checkpoint_saves_impl(tmp_path, kind):
    model, folder = save_checkpoint(tmp_path, kind, impl="chunked")
    assert scorer_impls(model) == {"chunked"}
    assert "impl" not in hf_neural_attn.patch_record(model).options
    assert "impl" not in saved_record(folder, kind)["options"]
    # Loaded, the model runs the default path (or the one asked for), not the one the saved model ran.
    assert scorer_impls(CHECKPOINT_KINDS[kind].load(folder)) == {"auto"}


def test_set_impl_switches_every_scorer_and_keeps_the_outputs(paths_taken):
    model = hf_neural_attn.patch_model(tiny_llama(), "qana")
    perturb_scorers(model)
    record = hf_neural_attn.patch_record(model)
    inputs = model_inputs("llama")
    expected = logits(model, inputs)
    assert set(paths_taken) == {"reference"}  # "auto" on calls this small
    for impl, path in (("chunked", "blockwise"), ("reference", "reference")):
        paths_taken.clear()
        assert hf_neural_attn.set_impl(model, impl) is model
        assert scorer_impls(model) == {impl}
        torch.testing.assert_close(logits(model, inputs), expected, rtol=0, atol=1e-5)
        assert paths_taken and set(paths_taken) == {path}, impl
    assert hf_neural_attn.patch_record(model) == record  # nothing the model saves changed


def test_set_impl_checks_the_choice_where_it_is_set_and_changes_nothing_when_it_refuses():
    model = hf_neural_attn.patch_model(tiny_gpt2(), "qana", impl="chunked")
    choices = re.escape("['auto', 'chunked', 'reference', 'triton']")
    with pytest.raises(ValueError, match=rf"impl='fast' is not supported; choose one of {choices}"):
        hf_neural_attn.set_impl(model, "fast")
    reason = triton_unavailable_reason()
    if reason is not None:  # the same error as patch_model(impl="triton") gives here
        with pytest.raises(ValueError, match=re.escape(reason)):
            hf_neural_attn.set_impl(model, "triton")
    assert scorer_impls(model) == {"chunked"}
    # A choice the scorer does not take: HEA computes its output itself.
    hea = hf_neural_attn.patch_model(tiny_gpt2(), "hea", mode="replace")
    with pytest.raises(ValueError, match="impl='chunked' does not apply to 'hea'"):
        hf_neural_attn.set_impl(hea, "chunked")
    assert scorer_impls(hea) == {"auto"}
    with pytest.raises(ValueError, match="not patched.*patch_model"):
        hf_neural_attn.set_impl(tiny_gpt2(), "chunked")


def test_set_impl_reaches_the_scorer_copies_peft_trains():
    from peft import LoraConfig, get_peft_model

    model = hf_neural_attn.patch_model(tiny_llama(), "qana")
    config = LoraConfig(r=2, target_modules=["q_proj"], modules_to_save=hf_neural_attn.peft_modules_to_save(model))
    peft_model = get_peft_model(model, config)
    assert hf_neural_attn.set_impl(peft_model, "chunked") is peft_model
    # The wrapped originals and the trained copies (modules_to_save) alike.
    assert len([m for m in peft_model.modules() if isinstance(m, hf_neural_attn.scorers.Scorer)]) > 2
    assert scorer_impls(peft_model) == {"chunked"}


@pytest.mark.compiles
def test_a_compiled_model_follows_set_impl_and_compiles_once_per_choice():
    """The choice is read on every call: the compiled model's guards see a new one (it compiles once for it) and
    nothing else (the calls after that compile nothing)."""
    torch._dynamo.reset()
    compiled_graphs = []

    def backend(graph, example_inputs):
        compiled_graphs.append(graph)
        return graph.forward

    model = hf_neural_attn.patch_model(tiny_gpt2(), "qana")
    perturb_scorers(model)
    ids = tokens(2, 12)
    expected = model(ids).logits
    compiled = torch.compile(model, backend=backend, dynamic=False)
    try:
        for impl in ("auto", "chunked", "reference"):
            before = len(compiled_graphs)
            hf_neural_attn.set_impl(compiled, impl)
            torch.testing.assert_close(compiled(ids).logits, expected, rtol=0, atol=1e-5)
            after_first_call = len(compiled_graphs)
            assert after_first_call > before, f"impl={impl!r}: the compiled model did not see the new choice"
            for _ in range(2):
                torch.testing.assert_close(compiled(ids).logits, expected, rtol=0, atol=1e-5)
            assert len(compiled_graphs) == after_first_call, f"impl={impl!r}: compiled again on a later call"
    finally:
        torch._dynamo.reset()
