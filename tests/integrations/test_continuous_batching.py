"""Continuous batching serves patched models: every request gets the tokens greedy ``generate`` gives it alone.

transformers' continuous batching (``generate_batch``, the manager behind ``transformers serve
--continuous-batching``, ``generate(cache_implementation="paged")``) runs all requests of a step as one packed row
with no mask. The scorers must see each request's own keys only (hf_neural_attn.ops.packed), and the manager must
keep them (hf_neural_attn.integrations.continuous_batching). Compared here: tokens exactly, and the log-probabilities of the chosen
tokens against ``generate``'s scores to 1e-4 (float32; the packed path and ``generate`` run the same math on other
shapes).
"""

from __future__ import annotations

import pytest
import torch
from helpers.models import packed_attention_call, perturb_scorers, tiny_gpt2, tiny_llama, tiny_mistral
from helpers.scorers import FUSED_SCORERS
from transformers import ContinuousBatchingConfig, GenerationConfig

import hf_neural_attn
from hf_neural_attn.integrations.continuous_batching import continuous_batching_unsupported_reason

UNSUPPORTED = continuous_batching_unsupported_reason()
needs_packed_keys = pytest.mark.skipif(UNSUPPORTED is not None, reason=UNSUPPORTED or "")

# Prompts of different lengths (longer than the Mistral case's window of 6), so requests finish at different steps
# when their budgets differ and every step packs sequences of unequal lengths.
PROMPTS = [[5, 9, 12, 3, 7], [8, 2, 30, 31, 40, 41, 42, 11, 12, 60, 61, 13, 14], [17, 18], [20, 21, 22, 23, 24, 25, 26]]
NEW_TOKENS = 7
LOGPROB_ATOL = 1e-4


def greedy(max_new_tokens: int = NEW_TOKENS, **overrides) -> GenerationConfig:
    # eos -1: no request stops early, so each runs its whole budget (transformers warns that eos is not positive).
    settings = {"max_new_tokens": max_new_tokens, "do_sample": False, "eos_token_id": -1, "pad_token_id": 0}
    return GenerationConfig(**{**settings, **overrides})


def lively_gpt2(**config):
    """A tiny GPT-2 whose greedy tokens depend on its attention: at GPT-2's init scale (0.02) the tiny model repeats
    one token whatever it attends to."""
    return tiny_gpt2(initializer_range=0.4, **config)


def patched(build, scorer: str = "qana", perturb: bool = True, **options):
    model = build()
    defaults = {"qana": {"h": 4}, "neural": {}, "hea": {"mode": "replace"}}[scorer]
    hf_neural_attn.patch_model(model, scorer, **{**defaults, **options})
    if perturb:
        perturb_scorers(model)
    return model


def alone(model, prompt: list[int], max_new_tokens: int = NEW_TOKENS) -> tuple[list[int], list[float]]:
    """Greedy ``generate`` of one request: its new tokens and their log-probabilities."""
    out = model.generate(
        torch.tensor([prompt]),
        generation_config=greedy(max_new_tokens),
        output_scores=True,
        return_dict_in_generate=True,
    )
    tokens = out.sequences[0, len(prompt) :].tolist()
    logprobs = [torch.log_softmax(score[0].float(), -1)[token].item() for score, token in zip(out.scores, tokens)]
    return tokens, logprobs


def batched(model, prompts: list[list[int]], **settings) -> list:
    """``generate_batch`` of ``prompts`` with log-probabilities: their outputs in request order."""
    config = ContinuousBatchingConfig(return_logprobs=True, **settings)
    outputs = model.generate_batch(prompts, generation_config=greedy(), continuous_batching_config=config)
    return [outputs[f"req_{index}"] for index in range(len(prompts))]


def assert_served_alone(model, outputs, prompts, budgets=None) -> None:
    for index, (output, prompt) in enumerate(zip(outputs, prompts, strict=True)):
        assert output.error is None, output.error
        tokens, logprobs = alone(model, prompt, budgets[index] if budgets else NEW_TOKENS)
        assert output.generated_tokens == tokens, f"request {index}"
        torch.testing.assert_close(
            torch.tensor(output.logprobs), torch.tensor(logprobs), rtol=0, atol=LOGPROB_ATOL, msg=f"request {index}"
        )


CASES = {
    # Grouped-query attention (4 query heads over 2 kv heads), both core scorers.
    "llama-qana": lambda: patched(tiny_llama, "qana"),
    "llama-neural": lambda: patched(tiny_llama, "neural"),
    "gpt2-qana": lambda: patched(lively_gpt2, "qana"),
    "gpt2-neural": lambda: patched(lively_gpt2, "neural"),
    # Narrow keys: the paged cache holds keys at the model's head_dim.
    "llama-key_dim": lambda: patched(tiny_llama, "qana", h=2, key_dim=4),
    # A sliding window (6) shorter than the longest prompt.
    "mistral-qana": lambda: patched(tiny_mistral, "qana"),
    # A scorer that is not a softmax of logits computes its output itself, one request at a time as well.
    "llama-hea": lambda: patched(tiny_llama, "hea"),
    # Only layer 0 scored: layer 1 runs the model's own attention on each request, over either base.
    "llama-layer0-sdpa": lambda: patched(lambda: tiny_llama(attn_implementation="sdpa"), "qana", layers=[0]),
    "llama-layer0-eager": lambda: patched(lambda: tiny_llama(attn_implementation="eager"), "qana", layers=[0]),
}


@needs_packed_keys
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("case", CASES)
def test_each_request_gets_the_tokens_generate_gives_it_alone(case):
    model = CASES[case]()
    assert_served_alone(model, batched(model, PROMPTS), PROMPTS)


@needs_packed_keys
def test_a_request_does_not_change_when_others_join_the_batch():
    model = patched(tiny_llama, "neural")
    (by_itself,) = batched(model, PROMPTS[1:2])
    with_others = batched(model, PROMPTS)[1]
    assert with_others.generated_tokens == by_itself.generated_tokens
    torch.testing.assert_close(torch.tensor(with_others.logprobs), torch.tensor(by_itself.logprobs), rtol=0, atol=1e-5)


@needs_packed_keys
def test_prompts_prefilled_in_chunks():
    """A token budget per step below the prompt lengths splits prefills over steps: the later chunks' queries see
    the keys the cache read back."""
    model = patched(tiny_llama, "qana")
    assert_served_alone(model, batched(model, PROMPTS, max_batch_tokens=4), PROMPTS)


@needs_packed_keys
def test_prompts_sharing_a_prefix_share_its_cache_blocks():
    """Block sharing on (the manager's default) with blocks of 4 tokens, so the full blocks of a common 10-token
    prefix may be shared between requests (not checked here: transformers decides): each request still gets its own
    tokens."""
    model = patched(tiny_llama, "qana")
    common = [5, 9, 12, 3, 7, 8, 2, 30, 31, 40]
    prompts = [[*common, 41, 42], [*common, 11], [*common, 50, 51, 52]]
    assert_served_alone(model, batched(model, prompts, block_size=4, allow_block_sharing=True), prompts)


@needs_packed_keys
def test_requests_join_and_leave_a_running_manager():
    """Requests of different budgets added while the manager generates (whatever the batches they fall into)."""
    model = patched(tiny_llama, "qana")
    budgets = [9, 3, 6, 12]
    config = ContinuousBatchingConfig(return_logprobs=True)
    with model.continuous_batching_context_manager(
        generation_config=greedy(), continuous_batching_config=config, warmup=False
    ) as manager:
        first = manager.add_request(PROMPTS[0], request_id="r0", max_new_tokens=budgets[0])
        results = {}
        # The first result back (whichever it is) means the manager is running: the others join mid-generation.
        result = manager.get_result(timeout=60)
        results[result.request_id] = result
        for index in range(1, len(PROMPTS)):
            manager.add_request(PROMPTS[index], request_id=f"r{index}", max_new_tokens=budgets[index])
        while len(results) < len(PROMPTS):
            result = manager.get_result(timeout=60)
            assert result is not None, f"timed out with {sorted(results)}"
            if result.is_finished():
                results[result.request_id] = result
    assert first == "r0"
    outputs = [results[f"r{index}"] for index in range(len(PROMPTS))]
    assert_served_alone(model, outputs, PROMPTS, budgets)


@needs_packed_keys
def test_generate_with_the_paged_cache():
    model = patched(tiny_llama, "qana")
    prompts = torch.tensor([PROMPTS[0], PROMPTS[3][:5]])
    sequences = model.generate(prompts, generation_config=greedy(), cache_implementation="paged")[0]
    for row, prompt in zip(sequences.tolist(), prompts.tolist(), strict=True):
        assert row[len(prompt) :] == alone(model, prompt)[0]


@needs_packed_keys
def test_sampling_from_a_model_patched_at_init_draws_what_the_unpatched_model_draws():
    """Sampled continuous batching with a fixed seed: a function-preserving patch draws the unpatched model's tokens
    (transformers samples every request of a step in one draw, so only the same batch on both sides compares)."""
    sampled = greedy(do_sample=True, temperature=1.0, top_k=0, top_p=1.0)

    def draw(model) -> list:
        torch.manual_seed(11)
        outputs = model.generate_batch(
            PROMPTS,
            generation_config=sampled,
            continuous_batching_config=ContinuousBatchingConfig(return_logprobs=True),
        )
        return [outputs[f"req_{index}"] for index in range(len(PROMPTS))]

    base = draw(lively_gpt2())
    for scorer in FUSED_SCORERS:
        served = draw(patched(lively_gpt2, scorer, perturb=False))
        for index, (ours, theirs) in enumerate(zip(served, base, strict=True)):
            assert ours.generated_tokens == theirs.generated_tokens, (scorer, index)
            torch.testing.assert_close(torch.tensor(ours.logprobs), torch.tensor(theirs.logprobs), rtol=0, atol=1e-5)


@needs_packed_keys
def test_a_flash_switch_never_bypasses_the_scorers(monkeypatch):
    """Where flash-attn is installed the manager switches SDPA and eager models to flash: made available here. A
    patched model keeps its scorers and its base (an unpatched one would be switched)."""
    from transformers.generation.continuous_batching import continuous_api

    monkeypatch.setattr(continuous_api, "is_flash_attn_2_available", lambda **_: True)
    model = patched(tiny_llama, "qana")
    base = model.config.base_attn_implementation
    assert_served_alone(model, batched(model, PROMPTS), PROMPTS)
    assert model.config._attn_implementation == "hf_neural_attn"
    assert model.config.base_attn_implementation == base

    switched = []
    unpatched = tiny_llama(attn_implementation="sdpa")
    monkeypatch.setattr(unpatched, "set_attn_implementation", switched.append)
    continuous_api.ContinuousBatchingManager.switch_to_cb_friendly_attn(
        object.__new__(continuous_api.ContinuousBatchingManager), unpatched
    )
    assert switched == ["flash_attention_2"]  # transformers' own switch still runs for the unpatched model


@needs_packed_keys
def test_an_unpatched_model_is_served_by_transformers_own_code():
    model = tiny_llama(attn_implementation="eager")
    expected = [model.generate(torch.tensor([p]), generation_config=greedy())[0, len(p) :].tolist() for p in PROMPTS]
    outputs = model.generate_batch(PROMPTS, generation_config=greedy())
    assert [outputs[f"req_{index}"].generated_tokens for index in range(len(PROMPTS))] == expected
    assert model.config._attn_implementation == "eager"  # switched to paged|eager for the batch, then back


@pytest.mark.skipif(UNSUPPORTED is None, reason="this transformers serves patched models by continuous batching")
def test_an_older_transformers_is_refused_before_anything_is_generated():
    model = patched(tiny_llama, "qana")
    with pytest.raises(ValueError, match=r"hf_neural_attn.*transformers >= 5\.19"):
        model.generate_batch(PROMPTS, generation_config=greedy())
    assert model.config._attn_implementation == "hf_neural_attn"


@pytest.mark.parametrize("base", ["sdpa", "eager"])
@pytest.mark.parametrize("scorer", FUSED_SCORERS)
def test_a_packed_training_batch_trains_each_sequence_alone(scorer, base):
    """DataCollatorWithFlattening's batches (one row, cu_seq_lens_q/k): each sequence attends to itself only, with
    or without the causal mask an eager base builds over the row; logits and gradients as when run one by one.
    (The unpatched model over eager or SDPA ignores the lengths and lets later sequences see earlier ones.)"""
    from transformers import DataCollatorWithFlattening

    model = patched(lambda: tiny_llama(attn_implementation=base), scorer)
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=True)([{"input_ids": p} for p in PROMPTS])
    batch.pop("labels")

    def logits_and_gradients(run):
        model.zero_grad()
        logits = run()
        logits.pow(2).mean().backward()
        return logits.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    packed, packed_grads = logits_and_gradients(lambda: model(**batch).logits[0])
    alone, alone_grads = logits_and_gradients(
        lambda: torch.cat([model(torch.tensor([prompt])).logits[0] for prompt in PROMPTS])
    )
    torch.testing.assert_close(packed, alone, rtol=0, atol=1e-5)
    assert packed_grads.keys() == alone_grads.keys()
    for name, grad in alone_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, rtol=0, atol=1e-5, msg=name)


def test_packed_calls_the_paths_cannot_split_are_refused():
    """Keys left in the paged cache for flash's kv-cache kernel (a block table) are not something to score."""
    from hf_neural_attn.ops.packed import packed_sequences

    query, key = torch.zeros(1, 4, 3, 8), torch.zeros(1, 2, 9, 8)
    bounds = {"cu_seq_lens_q": torch.tensor([0, 1, 3]), "cu_seq_lens_k": torch.tensor([0, 4, 9])}
    assert [(s.queries, s.keys) for s in packed_sequences(query, key, bounds)] == [
        (slice(0, 1), slice(0, 4)),
        (slice(1, 3), slice(4, 9)),
    ]
    with pytest.raises(ValueError, match="block table"):
        packed_sequences(query, key, {**bounds, "block_table": torch.zeros(1, 2, 4)})
    with pytest.raises(ValueError, match="last of its keys"):
        packed_sequences(query, key, {**bounds, "cu_seq_lens_k": torch.tensor([0, 4, 5])})
    assert packed_sequences(query, key, {}) is None


@pytest.mark.parametrize("scorer", ["qana", "neural"])
def test_decoding_requests_scored_as_one_batch_equal_scored_apart(scorer):
    """A packed call of decoding requests (one query each, keys of different lengths) scored as a padded batch (one
    request per row) gives each request what the ordinary call of its query and keys alone gives, within 1e-5
    (fp32); a prefill request (several queries) among them keeps its own call, causal from the end of its keys."""
    from hf_neural_attn import attention
    from hf_neural_attn.ops.packed import decoding_batches, sequence_mask
    from hf_neural_attn.ops.sequences import SequenceSlice
    from hf_neural_attn.record import EXTRAS_KWARG

    model = tiny_llama().eval()
    hf_neural_attn.patch_model(model, scorer)
    perturb_scorers(model)
    key_lengths, query_lengths = [7, 12, 5, 3, 9], [1, 1, 3, 1, 1]  # the third request is still prefilling
    module, (query, key, value, kwargs) = packed_attention_call(model, query_lengths, key_lengths)
    cu_q, cu_k = kwargs["cu_seq_lens_q"], kwargs["cu_seq_lens_k"]
    sequences = [SequenceSlice(slice(q0, q1), slice(k0, k1)) for q0, q1, k0, k1 in zip(cu_q, cu_q[1:], cu_k, cu_k[1:])]
    assert decoding_batches(query_lengths, key_lengths) == [[3, 0, 4, 1]]  # by length: 3, 7, 9, 12
    extras = kwargs.get(EXTRAS_KWARG)
    with torch.no_grad():
        batched, _ = attention.attention_with_keys(module, query, key, value, None, **dict(kwargs))
        for sequence in sequences:
            causal = sequence_mask(sequence, is_causal=True, sliding_window=None, device=query.device)
            alone, _ = attention._attention(
                module, sequence.query_of(query), sequence.keys_of(key), sequence.keys_of(value), causal, None, 0.0,
                sequence.extras_of(extras, 1), True, {}, context_shards=None,
            )  # fmt: skip
            torch.testing.assert_close(batched[:, sequence.queries], alone, atol=1e-5, rtol=0)


def test_decoding_batches_keep_padding_bounded():
    """Requests go into a batch shortest first while its padded keys stay within twice its requests' keys: a request
    far longer than the others gets a batch of its own; requests with several queries are not decoding."""
    from hf_neural_attn.ops.packed import decoding_batches

    assert decoding_batches([1, 1, 1, 1], [40, 2, 2, 6]) == [[1, 2, 3], [0]]
    assert decoding_batches([3, 1], [5, 4]) == [[1]]
