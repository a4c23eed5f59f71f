"""The contracts every scorer case keeps, run on each row of helpers.scorers.SCORER_CASES (docs/testing.md): preserved at
init (function-preserving cases) and live when perturbed, on every family the row can patch; on one family per
row (GPT-2, ViT for NSEA): a gradient on the first backward for every new parameter but those documented to wait
one step, the chunked path equal to the reference path, and the checkpoint round trip. A new scorer, or a new
mode of one, is one row of that table.

Tolerances (fp32, tiny models): the patched init equals the unpatched model to rounding (~1e-7, bounded at
1e-5); a live scorer moves logits by more than 100x that bound; the chunked path sums the same terms in another
order (logits and loss within 1e-5 absolute, every gradient within 1e-5 relative + 1e-6 absolute); a reloaded
checkpoint gives the same logits (bounded at 1e-6).
"""

import copy
import functools

import pytest
import torch
from helpers.models import logits, model_inputs, perturb_scorers, tiny_model, training_labels, training_loss
from helpers.paths import PATH_IMPLS
from helpers.references import EXACT, negligible
from helpers.scorers import SCORER_CASES, scorer_cases

import hf_neural_attn
from hf_neural_attn.ops import blockwise, chunked
from hf_neural_attn.scorers import SCORERS

SEQ = 8  # tokens (ViT inputs keep their image size)


@functools.cache
def unpatched(family):
    """One tiny model per family and its logits; tests patch deep copies (building a model costs more)."""
    model = tiny_model(family)
    with torch.no_grad():
        return model, logits(model, inputs_for(family))


def patched(case, family, **extra):
    model = copy.deepcopy(unpatched(family)[0])
    hf_neural_attn.patch_model(model, case.name, **case.options, **extra)
    return model


def inputs_for(family):
    return model_inputs(family, seq=SEQ)


def kind(parameter_name):
    """'model.layers.0.self_attn.attn_scorer.query_down.weight' -> 'query_down'."""
    return parameter_name.split("attn_scorer.", 1)[1].split(".")[0]


def test_every_registered_scorer_has_a_row():
    assert {case.name for case in SCORER_CASES} == set(SCORERS)


@pytest.mark.parametrize("case, family", scorer_cases(with_family=True))
def test_preserved_at_init_and_live_when_perturbed(case, family):
    """Function-preserving cases equal the unpatched model at init; moving the new parameters moves the logits;
    a case without parameters moves them by itself."""
    base, original = unpatched(family)
    model = copy.deepcopy(base)
    inputs = inputs_for(family)
    with torch.no_grad():
        hf_neural_attn.patch_model(model, case.name, **case.options)
        at_init = logits(model, inputs)
        if case.preserving:
            torch.testing.assert_close(at_init, original, rtol=0, atol=EXACT)
        assert bool(hf_neural_attn.scorer_parameters(model)) == case.parameters
        if case.parameters:
            perturb_scorers(model, std=1.0)
            assert (logits(model, inputs) - at_init).abs().max() > 100 * EXACT
        else:
            assert (at_init - original).abs().max() > 100 * EXACT


@pytest.mark.parametrize("case", scorer_cases(parameters=True))
def test_first_backward_reaches_every_new_parameter_but_the_documented_waits(case):
    """docs/scorers.md: no exactly function-preserving init gives the gate (and, for Neural Attention, what feeds
    the mirrored pairs) a gradient on the first step; everything else gets one, and after one step all do."""
    family = case.family
    model = patched(case, family)
    inputs = inputs_for(family)
    new = hf_neural_attn.scorer_parameters(model)
    optimizer = torch.optim.SGD(new.values(), lr=0.5)
    training_loss(model, inputs).backward()
    moving = [p.grad for name, p in new.items() if kind(name) not in case.waits]
    assert moving, "a case whose every parameter waits could not start training"
    largest = torch.stack([grad.abs().max() for grad in moving]).max()
    for name, parameter in new.items():
        if kind(name) in case.waits:
            assert negligible(parameter.grad, largest), name
        else:
            assert parameter.grad is not None and parameter.grad.abs().max() > 0, name
    optimizer.step()
    optimizer.zero_grad()
    training_loss(model, inputs).backward()
    for name, parameter in new.items():
        assert parameter.grad is not None and parameter.grad.abs().max() > 0, name


@pytest.mark.parametrize("case", scorer_cases(chunked=True))
def test_chunked_equals_reference(case, monkeypatch):
    """Loss, logits and the gradient of every parameter (the model's and the scorer's), in fp32."""
    monkeypatch.setattr(chunked, "QUERY_BLOCK", 3)  # 8 tokens: three query blocks, causal blocks skipped
    monkeypatch.setattr(blockwise, "QUERY_BLOCK", 3)
    family = case.family
    inputs = inputs_for(family)
    results = {}
    for impl in PATH_IMPLS:
        model = patched(case, family, impl=impl)
        perturb_scorers(model)
        out = model(**inputs, labels=training_labels(model, inputs))
        out.loss.backward()
        results[impl] = out.loss.detach(), out.logits.detach(), {n: p.grad for n, p in model.named_parameters()}
    ref_loss, ref_logits, ref_grads = results.pop("reference")
    for loss, out_logits, grads in results.values():
        torch.testing.assert_close(loss, ref_loss, rtol=0, atol=EXACT)
        torch.testing.assert_close(out_logits, ref_logits, rtol=0, atol=EXACT)
        assert grads.keys() == ref_grads.keys()
        for name, ref_grad in ref_grads.items():
            torch.testing.assert_close(grads[name], ref_grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("case", scorer_cases())
def test_checkpoint_round_trip(case, tmp_path):
    """save_pretrained -> hf_neural_attn.from_pretrained gives the same logits and the same patch record.
    tests/loading/test_checkpoint.py covers the families."""
    family = case.family
    model = patched(case, family)
    perturb_scorers(model)
    inputs = inputs_for(family)
    model.save_pretrained(tmp_path)
    reloaded = hf_neural_attn.from_pretrained(tmp_path)
    assert type(reloaded) is type(model)
    assert reloaded.config.hf_neural_attn == model.config.hf_neural_attn
    assert {key: reloaded.config.hf_neural_attn["options"][key] for key in case.options} == case.options
    with torch.no_grad():
        torch.testing.assert_close(logits(reloaded, inputs), logits(model, inputs), rtol=0, atol=1e-6)
