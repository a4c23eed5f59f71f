"""The papers' ablation options (docs/experiments.md): QANA's ``skip``, ``rope``, ``u_rank`` and ``key_dim``, and
Neural Attention's relative input on RoPE models.

Each option is checked against a literal float64 reference written from its definition (loops over queries, keys
and units, RoPE one vector at a time), then the way a user meets it: on a model, through every compute path, in
generation with a KV cache, saved and loaded, and refused with a clear error where it cannot apply.
"""

import math
import warnings

import pytest
import torch
from helpers.models import perturb_scorers, tiny_gpt2, tiny_llama, tokens
from helpers.paths import PATH_IMPLS
from helpers.references import (
    ACTIVATIONS,
    F64,
    HEADS,
    HIDDEN,
    KV_HEADS,
    D,
    geometry,
    qana_case,
    randomise,
    rope_rows,
    rope_vector,
)

import hf_neural_attn
from hf_neural_attn.narrow_keys import narrow_rotary
from hf_neural_attn.ops.dispatch import scored_attention
from hf_neural_attn.scorers import NeuralAttentionConfig, NeuralAttentionScorer, QanaConfig, QanaScorer

# Two fp32 computations of the same logits (shifted RoPE angles, cache vs. no cache): observed ~1e-7.
TOL = 1e-4


def patched(model, scorer, **options):
    """``model`` patched with the scorers moved off their init (their nonlinear term live)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the from-scratch options warn, tested below
        hf_neural_attn.patch_model(model, scorer, **options)
    perturb_scorers(model)
    return model


def shift_gap(model, shift: int = 17) -> float:
    """How far the logits move when every position id is shifted by ``shift`` (0 for relative-position scores)."""
    ids = tokens(2, 12)
    positions = torch.arange(12).expand(2, -1)
    base = model(ids, position_ids=positions).logits
    return (model(ids, position_ids=positions + shift).logits - base).abs().max().item()


# --- QANA: skip, rope, u_rank, against the literal widened query -------------------------------------------------


def qana_literal(scorer, hidden, w_s, b_s, keys, q_positions, k_positions, use_rope):
    """score(i, j) from the widened query of each token, one query, key and unit at a time (float64)."""
    config, width = scorer.config, scorer.u_width
    h, rows = config.h, scorer.rows_per_head
    sigma = ACTIVATIONS[config.activation]
    w_ext = scorer.query_extension.weight.view(HEADS, rows, HIDDEN)
    b_ext = scorer.query_extension.bias.view(HEADS, rows)
    batch, q_len, k_len = hidden.shape[0], hidden.shape[1], keys.shape[2]
    expected = torch.empty(batch, HEADS, q_len, k_len, dtype=F64)
    for n in range(HEADS):
        for bi in range(batch):
            for i in range(q_len):
                s = w_s.view(HEADS, D, HIDDEN)[n] @ hidden[bi, i] + b_s.view(HEADS, D)[n]
                extra = w_ext[n] @ hidden[bi, i] + b_ext[n]
                U = extra[: h * width].reshape(h, width)
                if config.u_rank is not None:
                    U = U @ scorer.basis[n]  # U_i = A_i B, (h, D)
                V, b, c = extra[h * width : h * width + h], extra[h * width + h : -1], extra[-1]
                position = q_positions[i].item()
                if use_rope:
                    s = rope_vector(s, position)
                    if config.rope == "rowwise":
                        U = torch.stack([rope_vector(U[row], position) for row in range(h)])
                for j in range(k_len):
                    k = rope_vector(keys[bi, n, j], k_positions[j].item()) if use_rope else keys[bi, n, j]
                    mlp = V @ sigma(U @ k + b) + c
                    score = scorer.gate[n] * mlp
                    if config.skip:
                        score = score + s @ k / math.sqrt(D)
                    expected[bi, n, i, j] = score
    return expected


@pytest.mark.parametrize(
    "options",
    [
        {"skip": False},
        {"skip": False, "h": 3, "activation": "tanh"},
        {"rope": "none"},
        {"u_rank": 1},
        {"u_rank": 3, "h": 2, "activation": "tanh"},
        {"u_rank": 2, "rope": "none"},
        {"u_rank": 2, "skip": False},
    ],
)
@pytest.mark.parametrize("use_rope", [False, True])
def test_qana_options_match_the_literal_widened_query(options, use_rope):
    torch.manual_seed(0)
    scorer = QanaScorer(QanaConfig(**{"h": 2, **options}), geometry())
    randomise(scorer)
    hidden, w_s, b_s, keys, q_positions, k_positions = qana_case()
    batch, q_len = hidden.shape[:2]
    expected = qana_literal(scorer, hidden, w_s, b_s, keys, q_positions, k_positions, use_rope)

    query = (hidden @ w_s.T + b_s).view(batch, q_len, HEADS, D).transpose(1, 2)
    rotate = (lambda x: rope_rows(x, q_positions)) if use_rope else None
    if use_rope:
        query, keys = rope_rows(query, q_positions), rope_rows(keys, k_positions)
    actual = scorer.scores(query, keys, scorer.query_extras(hidden, rotate), D**-0.5)
    torch.testing.assert_close(actual, expected, rtol=1e-10, atol=1e-10)


def test_u_rank_shrinks_the_widened_query():
    full = QanaScorer(QanaConfig(h=4), geometry())
    low = QanaScorer(QanaConfig(h=4, u_rank=2), geometry())
    assert full.rows_per_head - low.rows_per_head == 4 * (D - 2)  # h*D_K rows of U become h*r mixing entries
    assert low.basis.shape == (HEADS, 2, D)


@pytest.mark.parametrize("options", [{"u_rank": 2}, {"rope": "none"}, {"u_rank": 3, "rope": "none"}])
def test_function_preserving_options_keep_the_model_and_train(options):
    model = tiny_llama()
    ids = tokens(2, 10)
    before = model(ids).logits
    hf_neural_attn.patch_model(model, "qana", **options)
    torch.testing.assert_close(model(ids).logits, before, rtol=0, atol=1e-5)
    model(ids, labels=ids).loss.backward()
    grads = {name: p.grad for name, p in hf_neural_attn.scorer_parameters(model).items()}
    assert all(g is not None for g in grads.values())
    # The mirrored pairs give the query network a gradient at once (the shared basis and alpha wait a step).
    assert all(g.abs().sum() > 0 for name, g in grads.items() if "query_extension" in name)


def test_skip_false_warns_and_is_not_function_preserving():
    model = tiny_llama()
    ids = tokens(2, 10)
    before = model(ids).logits
    with pytest.warns(UserWarning, match="skip=False drops the dot-product path"):
        hf_neural_attn.patch_model(model, "qana", skip=False)
    assert (model(ids).logits - before).abs().max() > 1e-4


@pytest.mark.parametrize("options", [{"u_rank": 2}, {"skip": False}])
def test_rowwise_rope_keeps_the_options_relative(options):
    assert shift_gap(patched(tiny_llama(), "qana", **options)) < TOL


def test_rope_none_makes_the_score_depend_on_absolute_position():
    assert shift_gap(patched(tiny_llama(), "qana", rope="none")) > 100 * TOL


@pytest.mark.parametrize("options", [{"u_rank": 2}, {"skip": False}, {"u_rank": 2, "skip": False}])
def test_options_without_a_fused_form_take_the_generic_chunked_path_exactly(options):
    """The chunked path recomputes the scorer's own scores per block: same outputs and gradients as reference."""
    torch.manual_seed(0)
    results = {}
    for impl in PATH_IMPLS:
        scorer = QanaScorer(QanaConfig(h=2, impl=impl, **options), geometry())
        randomise(scorer)
        assert scorer.fused_unsupported_reason() is not None
        generator = torch.Generator().manual_seed(1)
        hidden = torch.randn(2, 9, HIDDEN, dtype=F64, generator=generator)
        query = torch.randn(2, HEADS, 9, D, dtype=F64, generator=generator, requires_grad=True)
        key = torch.randn(2, KV_HEADS, 9, D, dtype=F64, generator=generator, requires_grad=True)
        value = torch.randn(2, KV_HEADS, 9, D, dtype=F64, generator=generator, requires_grad=True)
        output, _ = scored_attention(
            scorer, query, key, value, None, scaling=D**-0.5, extras=scorer.query_extras(hidden, None), is_causal=True
        )
        output.square().sum().backward()
        results[impl] = [output, query.grad, key.grad, *(p.grad for p in scorer.parameters())]
    reference = results.pop("reference")
    for tensors in results.values():
        for tensor, expected in zip(tensors, reference, strict=True):
            torch.testing.assert_close(tensor, expected, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"u_rank": 8}, "u_rank=8 is not below the key width 8"),
        ({"key_dim": 3}, "key_dim=3 must be even"),
        ({"key_dim": 8}, "key_dim=8 is not below the head dimension 8"),
        ({"key_dim": 4, "u_rank": 4}, "u_rank=4 is not below the key width 4"),
        ({"skip": "no"}, "skip must be True or False"),
        ({"skip": False, "init": "zero"}, "skip=False with init='zero'"),
        ({"rope": "partial"}, "rope='partial' is not supported"),
    ],
)
def test_bad_qana_options_are_refused_before_the_model_changes(options, message):
    model = tiny_llama()
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    with pytest.raises(ValueError, match=message):
        hf_neural_attn.patch_model(model, "qana", **options)
    assert not hf_neural_attn.is_patched(model)
    assert type(model.model.layers[0].self_attn).__name__ == "LlamaAttention"
    assert all(torch.equal(state[name], tensor) for name, tensor in model.state_dict().items())


# --- QANA: key_dim ----------------------------------------------------------------------------------------------


def test_key_dim_layer_matches_a_literal_narrow_key_attention():
    """One patched Llama layer against its definition: r-wide q and k from the new projections, RoPE at width r
    (every (D/r)-th of the model's frequencies), the QANA score with r-wide U rows, softmax, full-width values."""
    model = patched(tiny_llama(), "qana", key_dim=4, h=2, layers=[0]).double()
    attention = model.model.layers[0].self_attn
    scorer, r, heads, groups = attention.attn_scorer, 4, 4, 2
    hidden = torch.randn(1, 5, 32, dtype=F64)
    positions = torch.arange(3, 8)
    cos, sin = model.model.rotary_emb(hidden, positions[None])
    output, _ = attention(hidden, position_embeddings=(cos, sin), attention_mask=None)

    base, head_dim = model.config.rope_parameters["rope_theta"], attention.head_dim
    kept = [math.floor(m * (head_dim // 2) / (r // 2)) for m in range(r // 2)]

    def rope(vector, position):  # RoPE at width r on the model's frequencies ``kept``
        out = vector.clone()
        for m, f in enumerate(kept):
            angle = position * base ** (-2 * f / head_dim)
            x1, x2 = vector[m], vector[m + r // 2]
            out[m], out[m + r // 2] = (
                x1 * math.cos(angle) - x2 * math.sin(angle),
                x2 * math.cos(angle) + x1 * math.sin(angle),
            )
        return out

    q = (attention.q_proj.weight @ hidden[0].T).T.view(5, heads, r)
    k = (attention.k_proj.weight @ hidden[0].T).T.view(5, 2, r)
    v = (attention.v_proj.weight @ hidden[0].T).T.view(5, 2, head_dim)
    extension = (scorer.query_extension.weight @ hidden[0].T).T.view(5, heads, scorer.rows_per_head)
    heads_out = torch.zeros(5, heads, head_dim, dtype=F64)
    for n in range(heads):
        for i in range(5):
            pos_i = positions[i].item()
            U = torch.stack([rope(row, pos_i) for row in extension[i, n, : 2 * r].view(2, r)])
            V, b, c = extension[i, n, 2 * r : 2 * r + 2], extension[i, n, 2 * r + 2 : 2 * r + 4], extension[i, n, -1]
            scores = torch.full((5,), -math.inf, dtype=F64)
            for j in range(i + 1):
                key = rope(k[j, n // groups], positions[j].item())
                mlp = V @ torch.nn.functional.gelu(U @ key + b) + c
                scores[j] = rope(q[i, n], pos_i) @ key / math.sqrt(r) + scorer.gate[n] * mlp
            heads_out[i, n] = torch.softmax(scores, 0) @ v[:, n // groups]
    expected = heads_out.reshape(5, -1) @ attention.o_proj.weight.T
    # The model's rotary embedding computes its angles in fp32 (then casts): ~1e-7 relative error in cos and sin.
    torch.testing.assert_close(output[0], expected, rtol=1e-6, atol=1e-8)


def test_narrow_rotary_is_rope_at_the_narrow_width_when_it_divides():
    """r | D: RoPE at width r with the model's base, exactly (what a model with head_dim r would do)."""
    model = tiny_llama(head_dim=16, hidden_size=64)
    positions = torch.arange(6)[None]
    cos, sin = model.model.rotary_emb(torch.zeros(1, 6, 64), positions)
    narrow_model = tiny_llama(head_dim=4, hidden_size=64)
    expected = narrow_model.model.rotary_emb(torch.zeros(1, 6, 64), positions)
    for got, want in zip(narrow_rotary(cos, sin, 4), expected, strict=True):
        torch.testing.assert_close(got, want)


def test_key_dim_shrinks_the_kv_cache_and_keeps_generation_exact():
    model = patched(tiny_llama(), "qana", key_dim=4)
    ids = tokens(2, 10)
    full = model(ids).logits
    prefix = model(ids[:, :6], use_cache=True)
    step = model(ids[:, 6:], past_key_values=prefix.past_key_values)
    torch.testing.assert_close(torch.cat([prefix.logits, step.logits], 1), full, rtol=0, atol=TOL)
    layer = prefix.past_key_values.layers[0]
    assert layer.keys.shape[-1] == 4 and layer.values.shape[-1] == 8

    baseline = tiny_llama()
    generated = model.generate(ids[:1, :4], max_new_tokens=6, do_sample=False, return_dict_in_generate=True)
    plain = baseline.generate(ids[:1, :4], max_new_tokens=6, do_sample=False, return_dict_in_generate=True)

    def cache_bytes(cache):
        return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))

    # Keys r/D as wide, values unchanged: (4 + 8) / (8 + 8) of the unpatched cache.
    assert cache_bytes(generated.past_key_values) * 16 == cache_bytes(plain.past_key_values) * 12
    no_cache = model.generate(ids[:1, :4], max_new_tokens=6, do_sample=False, use_cache=False)
    assert torch.equal(generated.sequences, no_cache)


def test_key_dim_is_relative_and_left_padding_exact():
    from helpers.models import assert_left_padding_and_cache_exact

    model = patched(tiny_llama(), "qana", key_dim=4)
    assert shift_gap(model) < TOL
    assert_left_padding_and_cache_exact(model)


def test_key_dim_warns_and_its_checkpoint_round_trips(tmp_path):
    model = tiny_llama()
    with pytest.warns(UserWarning, match="key_dim=4 replaces the query and key projections"):
        hf_neural_attn.patch_model(model, "qana", key_dim=4)
    perturb_scorers(model)
    names = hf_neural_attn.scorer_parameters(model)
    assert "model.layers.0.self_attn.k_proj.weight" in names  # the narrow projections are new parameters
    ids = tokens(2, 10)
    expected = model(ids).logits
    model.save_pretrained(tmp_path)
    for loaded in (hf_neural_attn.from_pretrained(tmp_path), transformers_auto(tmp_path)):
        assert loaded.model.layers[1].self_attn.k_proj.weight.shape == (2 * 4, 32)
        torch.testing.assert_close(loaded(ids).logits, expected, rtol=0, atol=0)


def transformers_auto(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path)


def test_key_dim_models_have_no_original_and_no_adapter(tmp_path):
    model = patched(tiny_llama(), "qana", key_dim=4)
    with pytest.raises(ValueError, match="no original model to go back to"):
        hf_neural_attn.unpatch_model(model)
    assert hf_neural_attn.is_patched(model)
    with pytest.raises(ValueError, match="Save the full model"):
        hf_neural_attn.save_adapter(model, tmp_path / "adapter", base_model_name_or_path="base")
    assert not (tmp_path / "adapter").exists()
    with pytest.raises(ValueError, match="train all its parameters"):
        hf_neural_attn.peft_modules_to_save(model)


def test_key_dim_on_other_attention_is_refused_and_leaves_the_model():
    model = tiny_gpt2()
    with pytest.raises(ValueError, match="key_dim is not supported on GPT2Attention"):
        hf_neural_attn.patch_model(model, "qana", key_dim=4)
    assert not hf_neural_attn.is_patched(model)


# --- Neural Attention: relative input -----------------------------------------------------------------------------


def relative_pair_scores_literal(scorer, query, key, sigma):
    """A_ij with the relative input, from its definition: per pair (p, p') of dimensions RoPE turns together, the
    complex numbers z = x_p + i x_p' of q~_i and k~_j, Z_l = sum Re(c_l z(q) conj z(k)) + (the dimensions RoPE
    leaves alone, weighted) + b_l; then the rest of the MLP."""
    partner = scorer.geometry.rope_partner
    pairs = [(dim, partner[dim]) for dim in range(D) if partner[dim] > dim]
    alone = [dim for dim in range(D) if partner[dim] == dim]
    weight, n = scorer.pair_weight, len(pairs)
    batch, heads, q_len, _ = query.shape
    k_len = key.shape[2]
    A = torch.empty(batch, heads, q_len, k_len, dtype=F64)
    for index in torch.cartesian_prod(*(torch.arange(size) for size in (batch, heads, q_len, k_len))):
        bi, hd, i, j = index.tolist()
        q, k = query[bi, hd, i], key[bi, hd, j]
        z = torch.empty(weight.shape[0], dtype=F64)
        for unit in range(weight.shape[0]):
            total = scorer.pair_bias[unit]
            for p, (a, b) in enumerate(pairs):
                c = complex(weight[unit, p].item(), weight[unit, n + p].item())
                total = total + (c * complex(q[a].item(), q[b].item()) * complex(k[a].item(), -k[b].item())).real
            for t, dim in enumerate(alone):
                total = total + weight[unit, 2 * n + t] * q[dim] * k[dim]
            z[unit] = total
        z = sigma(z)
        for layer in scorer.deeper:
            z = sigma(layer.weight @ z + layer.bias)
        A[bi, hd, i, j] = scorer.output.weight[0] @ z
    return A


ROTATE_HALF, PARTIAL, INTERLEAVED = (2, 3, 0, 1), (1, 0, 2, 3), (1, 0, 3, 2)


@pytest.mark.parametrize(
    "options",
    [{"h": 4}, {"h": 3, "activation": "tanh"}, {"h": 4, "depth": 2}, {"h": 2, "mode": "replace"}],
)
@pytest.mark.parametrize("partner", [ROTATE_HALF, PARTIAL, INTERLEAVED], ids=["rotate_half", "partial", "interleaved"])
def test_neural_relative_input_matches_its_literal_definition(options, partner):
    torch.manual_seed(0)
    config = NeuralAttentionConfig(pair_input="relative", **options)
    scorer = NeuralAttentionScorer(config, geometry(rope_partner=partner))
    randomise(scorer, std=0.6)
    query, key = torch.randn(2, HEADS, 3, D, dtype=F64), torch.randn(2, HEADS, 4, D, dtype=F64)
    A = relative_pair_scores_literal(scorer, query, key, ACTIVATIONS[config.activation])
    scaling = D**-0.5
    if config.mode == "replace":
        expected = A * scaling
    else:
        expected = torch.einsum("bnqd,bnkd->bnqk", query, key) * scaling + scorer.gate.view(1, -1, 1, 1) * A
    torch.testing.assert_close(scorer.scores(query, key, None, scaling), expected, rtol=1e-10, atol=1e-10)


def test_neural_relative_input_is_the_default_on_rope_models_and_keeps_the_shift_test():
    model = patched(tiny_llama(), "neural")
    assert model.model.layers[0].self_attn.attn_scorer.pair_input == "relative"
    relative_gap = shift_gap(model)
    assert relative_gap < TOL
    # The paper's concatenated input reads rotated q and k: the same test sees absolute position.
    concat_gap = shift_gap(patched(tiny_llama(), "neural", pair_input="concat"))
    assert concat_gap > 3 * TOL and concat_gap > 1000 * relative_gap
    assert patched(tiny_gpt2(), "neural").transformer.h[0].attn.attn_scorer.pair_input == "concat"


def test_neural_relative_input_is_function_preserving_and_exact_in_generation():
    from helpers.models import assert_left_padding_and_cache_exact

    model = tiny_llama()
    ids = tokens(2, 10)
    before = model(ids).logits
    hf_neural_attn.patch_model(model, "neural")
    torch.testing.assert_close(model(ids).logits, before, rtol=0, atol=1e-5)
    perturb_scorers(model)
    assert_left_padding_and_cache_exact(model)


def test_neural_relative_input_on_the_blockwise_path_matches_reference():
    torch.manual_seed(0)
    results = {}
    for impl in PATH_IMPLS:
        scorer = NeuralAttentionScorer(
            NeuralAttentionConfig(pair_input="relative", impl=impl), geometry(rope_partner=INTERLEAVED)
        )
        randomise(scorer, std=0.6)
        assert scorer.fused_unsupported_reason() is None
        generator = torch.Generator().manual_seed(1)
        query = torch.randn(2, HEADS, 9, D, dtype=F64, generator=generator, requires_grad=True)
        key = torch.randn(2, KV_HEADS, 9, D, dtype=F64, generator=generator, requires_grad=True)
        value = torch.randn(2, KV_HEADS, 9, D, dtype=F64, generator=generator, requires_grad=True)
        output, _ = scored_attention(scorer, query, key, value, None, scaling=D**-0.5, is_causal=True)
        output.square().sum().backward()
        results[impl] = [output, query.grad, key.grad, value.grad, *(p.grad for p in scorer.parameters())]
    reference = results.pop("reference")
    for tensors in results.values():
        for tensor, expected in zip(tensors, reference, strict=True):
            torch.testing.assert_close(tensor, expected, rtol=1e-9, atol=1e-10)


def test_neural_relative_input_is_refused_without_rope_and_with_a_down_projection():
    model = tiny_gpt2()
    with pytest.raises(ValueError, match="has no RoPE"):
        hf_neural_attn.patch_model(model, "neural", pair_input="relative")
    assert not hf_neural_attn.is_patched(model)
    with pytest.raises(ValueError, match="proj_dim=2 applies to pair_input='concat'"):
        hf_neural_attn.patch_model(tiny_llama(), "neural", pair_input="relative", proj_dim=2)
    # auto with a down-projection keeps the paper's input
    model = patched(tiny_llama(), "neural", proj_dim=2)
    assert model.model.layers[0].self_attn.attn_scorer.pair_input == "concat"


def test_checkpoints_from_before_pair_input_load_as_they_were_saved(tmp_path):
    """A record written before the option existed meant the concatenated input (its tensors say so)."""
    import json

    model = patched(tiny_llama(), "neural", pair_input="concat")
    ids = tokens(2, 8)
    expected = model(ids).logits
    model.save_pretrained(tmp_path)
    config_file = tmp_path / "config.json"
    saved = json.loads(config_file.read_text())
    del saved["hf_neural_attn"]["options"]["pair_input"]
    config_file.write_text(json.dumps(saved))
    for loaded in (hf_neural_attn.from_pretrained(tmp_path), transformers_auto(tmp_path)):
        torch.testing.assert_close(loaded(ids).logits, expected, rtol=0, atol=0)


def test_pictures_of_a_key_dim_model_compare_with_its_own_dot_product(tmp_path):
    """There is no original model behind key_dim: "unpatched" is the same narrow queries and keys scored by the plain
    dot product, so the maps differ exactly by what the query networks add."""
    from hf_neural_attn import plotting

    model = patched(tiny_llama(), "qana", key_dim=4)
    probe = {"input_ids": tokens(1, 8)}
    before = {name: p.clone() for name, p in model.named_parameters()}
    stats = plotting.scorer_statistics(model, probe)
    assert len(stats) == 2 and all(record["attention_change"] > 1e-4 for record in stats)
    maps = plotting.attention_maps(model, probe, layer=0)
    assert maps.patched.shape == maps.unpatched.shape == (4, 8, 8)
    assert all(torch.equal(before[name], p) for name, p in model.named_parameters())  # the model is untouched
    # with the query networks' gates at zero the patched maps are the dot product's
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "attn_scorer"):
                module.attn_scorer.gate.zero_()
    assert all(record["attention_change"] < 1e-6 for record in plotting.scorer_statistics(model, probe))
