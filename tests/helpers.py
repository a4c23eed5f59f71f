"""Tiny models built from configs (no downloads) and helpers shared by the tests (import from here, never
from conftest or another test file).

The tables every family-wise or scorer-wise test iterates over (docs/testing.md, "The tables"):

* FAMILY_CASES: every model family the suite builds, as a tiny model, with its input kind and the flags that
  pick each contract's families;
* SCORER_CASES: every scorer case (a scorer and its options), run by tests/test_scorer_contracts.py; FUSED_SCORERS:
  the scorers with a fused form (the rows whose ``fused`` is true), which the path and model tests run by name;
* IMPLS: the public ``impl`` choices, from the library;
* CHECKPOINT_KINDS: the two kinds of checkpoint (full, adapter): how each saves and loads, and where it keeps the
  record and the scorer tensors; saved by ``save_checkpoint``, read by ``saved_record``, edited by ``edit_record``.

Also here: the float64 scorer geometry, gradcheck and literal RoPE used by the math, chunked and Triton tests.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import socket
import urllib.request
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

# Nothing in the tests may reach the Hub; say so, so a stray lookup fails at once instead of waiting.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
import torch.nn.functional as F
import transformers as tf
from torch import nn
from torch.func import functional_call

import hf_neural_attn
from hf_neural_attn.loading.adapters import ADAPTER_CONFIG_NAME, ADAPTER_WEIGHTS_NAME
from hf_neural_attn.ops.choices import IMPL_OPTIONS
from hf_neural_attn.ops.dispatch import scored_attention
from hf_neural_attn.record import RECORD_KEY
from hf_neural_attn.scorers import SCORERS, AttentionGeometry, Scorer, scorer_class

VOCAB = 64
# fp32: a function-preserving patch computes the original's dot product with a different kernel (explicit matmul +
# softmax instead of SDPA), so logits agree to rounding, far below this bound.
EXACT = 1e-5
# Two processes (DeepSpeed, FSDP) sum their gradients in another order than one process: trained weights and saved
# states agree with one process's at rounding level. SGD keeps it there (Adam would turn the rounding noise of
# gradients that are zero in exact arithmetic, QANA's c rows, into lr-sized steps).
DISTRIBUTED_TOL = {"rtol": 1e-5, "atol": 1e-6}


# --- Tiny models -------------------------------------------------------------------------------------------------

# A tiny rotary decoder: 2 layers, 4 query heads sharing 2 key/value heads (grouped-query attention). Llama,
# Mistral, Qwen, Gemma and the standard decoders' configs all take these keys.
TINY_DECODER = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=0,
)

# A tiny encoder of the same sizes (BERT, RoBERTa), dropout off: the tests compare outputs.
BERT_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    max_position_embeddings=64,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
    pad_token_id=1,
)


def tiny(model_class, config_class, **defaults) -> Callable[..., nn.Module]:
    """A builder of tiny ``model_class`` models: ``build(**overrides)`` makes ``config_class(**defaults,
    **overrides)`` (``attn_implementation`` among them), draws the weights from seed 0 and returns the model in
    eval mode. Under ``with torch.device("meta")`` it builds the model on meta."""

    def build(**overrides) -> nn.Module:
        torch.manual_seed(0)
        return model_class(config_class(**{**defaults, **overrides})).eval()

    return build


tiny_llama = tiny(tf.LlamaForCausalLM, tf.LlamaConfig, **TINY_DECODER)
# GPT-2 configs default to 0.1 dropout on residuals, embeddings and attention; tests that compare train-mode runs
# need them off (the dropout test turns attention dropout back on).
tiny_gpt2 = tiny(
    tf.GPT2LMHeadModel,
    tf.GPT2Config,
    vocab_size=VOCAB,
    n_embd=32,
    n_layer=2,
    n_head=4,
    n_positions=128,
    bos_token_id=0,
    eos_token_id=1,
    resid_pdrop=0.0,
    embd_pdrop=0.0,
    attn_pdrop=0.0,
)
tiny_vit = tiny(
    tf.ViTForImageClassification,
    tf.ViTConfig,
    image_size=16,
    patch_size=4,
    num_channels=3,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    num_labels=3,
)
tiny_bert = tiny(tf.BertForMaskedLM, tf.BertConfig, **BERT_COMMON)

HEAD_DIM = {"head_dim": 8}  # for configs whose default head_dim is not hidden_size / heads
PARTIAL_ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}


# --- The table of families ---------------------------------------------------------------------------------------

# The kinds of input padded_inputs makes: token ids padded on the left (decoders) or the right (encoders), pixels.
LEFT_PADDED, RIGHT_PADDED, IMAGE = "left-padded", "right-padded", "image"


@dataclass(frozen=True)
class FamilyCase:
    """One model family the suite builds, as a tiny model (2 attention layers, 4 query heads), and the flags the
    tests pick their families by. A new family is one row of FAMILY_CASES."""

    name: str  # the family the patch records (a generic row's name is the model's; the record says "standard")
    build: Callable[..., nn.Module]  # build(**config overrides, attn_implementation=...): see tiny()
    inputs: str  # what padded_inputs makes for it: LEFT_PADDED, RIGHT_PADDED or IMAGE
    causal: bool
    # Which adapter of hf_neural_attn.families serves it: "llama" (Llama and the Llama-likes), "gpt2", "vit",
    # "bert" (BERT and RoBERTa) or "standard" (the probe-checked StandardAttentionFamily: Phi-3, the standard
    # decoders and the generic path).
    adapter: str
    generic: bool = False  # no entry of its own: the generic StandardAttentionFamily serves it, and warns
    core: bool = False  # every contract runs on these: all scorer cases, training, checkpoints, HF usage, paths
    # The four families transformers' common model tests were run against (docs/testing.md): their mirrors run
    # on these (meta device, eager vs SDPA base).
    mirrored: bool = False
    # One model per adapter and per kind of mask or projection the adapters handle (a sliding window through
    # the Llama adapter and through the generic path, Phi-3's fused projection): the contracts about what each
    # attention layer gets and returns (output_attentions, the layers left unscored) run on these.
    sample: bool = False

    @property
    def recorded(self) -> str:
        """The family name the patch record holds."""
        return "standard" if self.generic else self.name


def decoder(model_class, config_class, **config) -> Callable[..., nn.Module]:
    """A builder of tiny decoders of TINY_DECODER's sizes (see tiny())."""
    return tiny(model_class, config_class, **TINY_DECODER, **config)


# What each builder's config exercises. Sliding windows are shorter than the test sequences.
tiny_bert_model = tiny(tf.BertModel, tf.BertConfig, **BERT_COMMON)
tiny_roberta = tiny(tf.RobertaModel, tf.RobertaConfig, **BERT_COMMON)
# Llama's attention layout.
tiny_mistral = decoder(tf.MistralForCausalLM, tf.MistralConfig, sliding_window=6)
tiny_qwen2 = decoder(tf.Qwen2ForCausalLM, tf.Qwen2Config)
tiny_qwen3 = decoder(tf.Qwen3ForCausalLM, tf.Qwen3Config, **HEAD_DIM)  # per-head q_norm / k_norm
tiny_gemma = decoder(tf.GemmaForCausalLM, tf.GemmaConfig, **HEAD_DIM)
# The standard attention plumbing. Phi-3: a fused qkv_proj, RoPE on half of each head.
tiny_phi3 = decoder(tf.Phi3ForCausalLM, tf.Phi3Config, rope_parameters=PARTIAL_ROPE)
tiny_olmo = decoder(tf.OlmoForCausalLM, tf.OlmoConfig, clip_qkv=0.5)  # clamps q, k, v
tiny_olmo2 = decoder(tf.Olmo2ForCausalLM, tf.Olmo2Config)  # q_norm over the whole projection
tiny_granite = decoder(tf.GraniteForCausalLM, tf.GraniteConfig, attention_multiplier=0.3)  # its own scaling
tiny_mixtral = decoder(
    tf.MixtralForCausalLM, tf.MixtralConfig, sliding_window=6, num_local_experts=2, num_experts_per_tok=1
)
tiny_qwen3_moe = decoder(
    tf.Qwen3MoeForCausalLM,
    tf.Qwen3MoeConfig,
    **HEAD_DIM,
    num_experts=2,
    num_experts_per_tok=1,
    moe_intermediate_size=32,
)
# Per-head q/k norms, query_pre_attn_scalar, a sliding layer with local RoPE beside a global one.
tiny_gemma3 = decoder(
    tf.Gemma3ForCausalLM,
    tf.Gemma3TextConfig,
    **HEAD_DIM,
    sliding_window=6,
    layer_types=["sliding_attention", "full_attention"],
)
tiny_stablelm = decoder(tf.StableLmForCausalLM, tf.StableLmConfig, qk_layernorm=True)  # partial rotary 0.25
tiny_cohere = decoder(tf.CohereForCausalLM, tf.CohereConfig, use_qk_norm=True)  # interleaved RoPE
tiny_smollm3 = decoder(tf.SmolLM3ForCausalLM, tf.SmolLM3Config, no_rope_layers=[1, 0])  # layer 1 is NoPE
tiny_starcoder2 = decoder(tf.Starcoder2ForCausalLM, tf.Starcoder2Config, sliding_window=6)  # biases
tiny_glm = decoder(tf.GlmForCausalLM, tf.GlmConfig)  # partial, interleaved RoPE
tiny_gemma2_no_softcap = decoder(
    tf.Gemma2ForCausalLM, tf.Gemma2Config, **HEAD_DIM, sliding_window=6, attn_logit_softcapping=None
)

FAMILY_CASES = [
    FamilyCase("llama", tiny_llama, LEFT_PADDED, causal=True, adapter="llama", core=True, mirrored=True, sample=True),
    FamilyCase("gpt2", tiny_gpt2, LEFT_PADDED, causal=True, adapter="gpt2", core=True, mirrored=True, sample=True),
    FamilyCase("vit", tiny_vit, IMAGE, causal=False, adapter="vit", core=True, mirrored=True, sample=True),
    FamilyCase("bert", tiny_bert_model, RIGHT_PADDED, causal=False, adapter="bert", mirrored=True, sample=True),
    # BERT's adapter with RoBERTa's classes: BERT stands for both in the sample.
    FamilyCase("roberta", tiny_roberta, RIGHT_PADDED, causal=False, adapter="bert"),
    FamilyCase("mistral", tiny_mistral, LEFT_PADDED, causal=True, adapter="llama", sample=True),
    FamilyCase("qwen2", tiny_qwen2, LEFT_PADDED, causal=True, adapter="llama"),
    FamilyCase("qwen3", tiny_qwen3, LEFT_PADDED, causal=True, adapter="llama"),
    FamilyCase("gemma", tiny_gemma, LEFT_PADDED, causal=True, adapter="llama"),
    FamilyCase("phi3", tiny_phi3, LEFT_PADDED, causal=True, adapter="standard", sample=True),
    FamilyCase("olmo", tiny_olmo, LEFT_PADDED, causal=True, adapter="standard"),
    FamilyCase("olmo2", tiny_olmo2, LEFT_PADDED, causal=True, adapter="standard"),
    FamilyCase("granite", tiny_granite, LEFT_PADDED, causal=True, adapter="standard"),
    FamilyCase("mixtral", tiny_mixtral, LEFT_PADDED, causal=True, adapter="standard"),
    FamilyCase("qwen3_moe", tiny_qwen3_moe, LEFT_PADDED, causal=True, adapter="standard"),
    FamilyCase("gemma3", tiny_gemma3, LEFT_PADDED, causal=True, adapter="standard"),
    FamilyCase("stablelm", tiny_stablelm, LEFT_PADDED, causal=True, adapter="standard"),
    FamilyCase("cohere", tiny_cohere, LEFT_PADDED, causal=True, adapter="standard"),
    FamilyCase("smollm3", tiny_smollm3, LEFT_PADDED, causal=True, adapter="standard"),
    # No entry on purpose: the generic fallback serves these, so it stays under test.
    FamilyCase("starcoder2", tiny_starcoder2, LEFT_PADDED, causal=True, adapter="standard", generic=True, sample=True),
    FamilyCase("glm", tiny_glm, LEFT_PADDED, causal=True, adapter="standard", generic=True),
    FamilyCase("gemma2_no_softcap", tiny_gemma2_no_softcap, LEFT_PADDED, causal=True, adapter="standard", generic=True),
]
_FAMILY_CASE = {case.name: case for case in FAMILY_CASES}


def family_case(name: str) -> FamilyCase:
    """The row of FAMILY_CASES named ``name``."""
    return _FAMILY_CASE[name]


def tiny_model(family: str, **overrides) -> nn.Module:
    """A tiny model of ``family`` (a FAMILY_CASES name), config ``overrides`` applied."""
    return family_case(family).build(**overrides)


def rows_where(table: list, *conditions: Callable[[object], bool], **where) -> list:
    """The rows of ``table`` whose attributes equal ``where`` (e.g. ``core=True``) and that meet ``conditions``."""
    return [
        row
        for row in table
        if all(getattr(row, key) == value for key, value in where.items()) and all(meets(row) for meets in conditions)
    ]


def family_cases(*conditions: Callable[[FamilyCase], bool], **where) -> list:
    """pytest params (id: the name) of the FAMILY_CASES rows picked as ``rows_where`` picks them."""
    return [pytest.param(case, id=case.name) for case in rows_where(FAMILY_CASES, *conditions, **where)]


def family_names(*conditions: Callable[[FamilyCase], bool], **where) -> list[str]:
    """The names of the FAMILY_CASES rows picked as ``rows_where`` picks them."""
    return [case.name for case in rows_where(FAMILY_CASES, *conditions, **where)]


CORE_FAMILIES = tuple(family_names(core=True))


def model_inputs(family: str, batch: int = 2, seq: int = 12, seed: int = 1) -> dict[str, torch.Tensor]:
    """Unpadded inputs for a model of ``family``: (batch, 3, 16, 16) pixels, or (batch, seq) token ids."""
    generator = torch.Generator().manual_seed(seed)
    if family_case(family).inputs == IMAGE:
        return {"pixel_values": torch.randn(batch, 3, 16, 16, generator=generator)}
    return {"input_ids": torch.randint(2, VOCAB, (batch, seq), generator=generator)}


def padded_inputs(kind: str) -> dict[str, torch.Tensor]:
    """Two examples as their processors make them (``kind``: a FamilyCase's ``inputs``): IMAGE pixels, or (2, 10)
    token ids whose second row is padded on the left (LEFT_PADDED, decoders) or the right (RIGHT_PADDED, BERT-style
    encoders), with their attention mask."""
    generator = torch.Generator().manual_seed(1)
    if kind == IMAGE:
        return {"pixel_values": torch.randn(2, 3, 16, 16, generator=generator)}
    ids = torch.randint(3, VOCAB, (2, 10), generator=generator)
    mask = torch.ones(2, 10, dtype=torch.long)
    padding = slice(0, 4) if kind == LEFT_PADDED else slice(6, 10)
    ids[1, padding], mask[1, padding] = 1, 0
    return {"input_ids": ids, "attention_mask": mask}


def tokens(batch: int, seq: int, seed: int = 3) -> torch.Tensor:
    """(batch, seq) random token ids of the tiny vocabulary (0 and 1 left out: pad and special ids)."""
    return torch.randint(2, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def training_labels(model, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """Labels for the model's own loss: the input ids (language modelling), or for images the classes 0, 1,
    2, ... of the batch's examples (modulo the number of labels)."""
    if "pixel_values" in inputs:
        return torch.arange(inputs["pixel_values"].shape[0]) % model.config.num_labels
    return inputs["input_ids"]


def training_loss(model, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**inputs, labels=training_labels(model, inputs)).loss


def assert_left_padding_and_cache_exact(model, atol: float = 1e-4) -> None:
    """A decoder with live scorers: a left-padded batch gives each sequence's own logits, and logits computed
    from the KV cache (two steps after a 7-token prefix) equal those of the full sequence."""
    long, short = tokens(1, 9, seed=4), tokens(1, 6, seed=5)
    ids = torch.zeros(2, 9, dtype=torch.long)
    ids[0], ids[1, 3:] = long[0], short[0]
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :3] = 0
    batched = model(ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    torch.testing.assert_close(batched[0], model(long).logits[0], rtol=0, atol=atol)
    torch.testing.assert_close(batched[1, 3:], model(short).logits[0], rtol=0, atol=atol)
    ids = tokens(2, 10)
    full = model(ids).logits
    prefix = model(ids[:, :7], use_cache=True)
    step = model(ids[:, 7:9], past_key_values=prefix.past_key_values, use_cache=True)
    torch.testing.assert_close(prefix.logits, full[:, :7], rtol=0, atol=atol)
    torch.testing.assert_close(step.logits, full[:, 7:9], rtol=0, atol=atol)


def perturb_scorers(model, std: float = 0.3, seed: int = 0) -> None:
    """Move every new parameter away from its init, so the scorer's nonlinear path is live."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in hf_neural_attn.scorer_parameters(model).values():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * std)


def save_live_patched(model, folder: Path, scorer: str, **options) -> Path:
    """Patch ``model`` with ``scorer``, move the scorers off their function-preserving init (so their terms and
    gradients are live) and save it to ``folder``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the from-scratch options (key_dim, mode="replace") warn
        hf_neural_attn.patch_model(model, scorer, **options)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, parameter in sorted(hf_neural_attn.scorer_parameters(model).items()):
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.3)
    model.save_pretrained(folder)
    return Path(folder)


def launch_processes(worker: Callable[[int, str], dict], root: Path, world: int = 2) -> dict:
    """Run ``worker(rank, root)`` on ``world`` CPU processes joined over gloo (as torchrun would set them up: its
    environment variables, which transformers reads, one thread each) and return what process 0's call returned.
    ``worker`` must be a module-level function (the processes are spawned)."""
    import torch.multiprocessing as mp

    mp.start_processes(_process_main, args=(worker, str(root), world), nprocs=world, start_method="spawn")
    return torch.load(Path(root) / "results.pt")


def _process_main(rank: int, worker: Callable[[int, str], dict], root: str, world: int) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    # A collective that one process never reaches fails after the timeout instead of hanging the suite.
    dist.init_process_group(
        "gloo", init_method=f"file://{root}/init", rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )
    results = worker(rank, root)
    if rank == 0:
        torch.save(results, f"{root}/results.pt")
    dist.barrier()
    dist.destroy_process_group()


def logits(model, inputs: dict[str, torch.Tensor], **kwargs) -> torch.Tensor:
    return model(**inputs, **kwargs).logits


# --- Installed packages ------------------------------------------------------------------------------------------


def transformers_refuses_installed_peft() -> str | None:
    """Why transformers' own PEFT integration (``add_adapter``, ``load_adapter``, Auto classes over an adapter folder)
    refuses the installed PEFT, or None. transformers 5.24 asks for peft>=0.22, newer than PyPI's newest when it came
    out; the library's own PEFT paths (``get_peft_model``, PEFT's classes) do not go through that check. The tests
    of the integration run in ``make test-oldest`` (transformers 5.18) then."""
    try:
        import peft
        from transformers.integrations.peft import MIN_PEFT_VERSION
    except ImportError:
        return None  # no peft: those tests skip themselves; an older transformers without the constant checks nothing
    from packaging.version import Version

    if Version(peft.__version__) < Version(MIN_PEFT_VERSION):
        return (
            f"transformers {tf.__version__}'s PEFT integration needs peft>={MIN_PEFT_VERSION}, found {peft.__version__}"
        )
    return None


# --- Compute paths -----------------------------------------------------------------------------------------------

IMPLS = IMPL_OPTIONS  # every public impl choice
# The choices that run on any machine: "triton" needs CUDA or Triton's CPU interpreter (the ``interpreter``
# fixture of conftest.py; tests/test_triton.py).
PORTABLE_IMPLS = tuple(impl for impl in IMPLS if impl != "triton")
# The portable choices that name one path; the first is "reference", the oracle the others are compared with.
PATH_IMPLS = tuple(impl for impl in PORTABLE_IMPLS if impl != "auto")
HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed: pip install -e '.[dev]'")


def always_blockwise(monkeypatch) -> None:
    """``impl="auto"`` materialises no score tensor while ``monkeypatch`` lasts: every scorer's threshold
    (``Scorer.reference_max_scores``) is 0, so each call of a softmax scorer runs the blockwise (or chunked) path."""
    for scorer_type in SCORERS.values():
        monkeypatch.setattr(scorer_type, "reference_max_scores", 0)


def scorer_impls(model: nn.Module) -> set[str]:
    """The compute choices (``impl``) the scorers of a patched model run, PEFT's copies of them included."""
    return {module.config.impl for module in model.modules() if isinstance(module, Scorer)}


# --- Checkpoints -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CheckpointKind:
    """One kind of patched checkpoint: how a patched model is saved as one and loaded back, and where the files keep
    the patch record and the scorer tensors."""

    save: Callable[[nn.Module, Path], None]  # save(patched model, folder)
    load: Callable[..., nn.Module]  # load(folder, **keywords): the patched model back
    record_file: str  # the JSON file holding the record
    record_field: str  # its field holding the record
    weights_file: str  # the safetensors file holding the scorer tensors
    on_saved_base: bool  # the patched model must come from a base model saved on disk, which the checkpoint names


# A full checkpoint (save_pretrained: the whole model, the patch record in config.json) and an adapter-only one
# (save_adapter: the scorer tensors, the record in the adapter JSON's "patch" field, the base model's id). Tests
# take a kind's name as their parameter (``@pytest.mark.parametrize("kind", CHECKPOINT_KINDS)``).
CHECKPOINT_KINDS: dict[str, CheckpointKind] = {
    "full": CheckpointKind(
        save=lambda model, folder: model.save_pretrained(folder),
        load=hf_neural_attn.from_pretrained,
        record_file="config.json",
        record_field=RECORD_KEY,
        weights_file="model.safetensors",
        on_saved_base=False,
    ),
    "adapter": CheckpointKind(
        save=hf_neural_attn.save_adapter,
        load=hf_neural_attn.from_pretrained,
        record_file=ADAPTER_CONFIG_NAME,
        record_field="patch",
        weights_file=ADAPTER_WEIGHTS_NAME,
        on_saved_base=True,
    ),
}


def save_base(folder: Path, family: str = "llama", **overrides) -> Path:
    """A tiny model of ``family`` (config ``overrides`` applied) saved to ``folder``, as a user's base model sits
    on disk; returns the folder."""
    tiny_model(family, **overrides).save_pretrained(folder)
    return folder


def load_patched(base: Path, family: str = "llama", scorer: str = "qana", **options) -> nn.Module:
    """The base model saved in ``base`` as a user would have it: loaded from its folder, patched with ``scorer`` and
    ``options``, trained (here: its scorers moved off their init)."""
    model = type(tiny_model(family)).from_pretrained(base).eval()
    hf_neural_attn.patch_model(model, scorer, **options)
    perturb_scorers(model)
    return model


def save_checkpoint(
    root: Path, kind: str, family: str = "llama", scorer: str = "qana", **options
) -> tuple[nn.Module, Path]:
    """A tiny model of ``family`` patched with ``scorer`` and ``options``, its scorers moved off their init
    ("trained"), saved as a checkpoint of ``kind`` (a CHECKPOINT_KINDS name) in ``root / kind``. A kind that names
    its base (an adapter) gets it saved to ``root / "base"`` first, and the model loaded from there. Returns the
    patched model and the checkpoint's folder."""
    checkpoint = CHECKPOINT_KINDS[kind]
    if checkpoint.on_saved_base:
        model = load_patched(save_base(root / "base", family), family, scorer, **options)
    else:
        model = tiny_model(family)
        hf_neural_attn.patch_model(model, scorer, **options)
        perturb_scorers(model)
    checkpoint.save(model, root / kind)
    return model, root / kind


def edit_json(path: Path, edit: Callable[[dict], None]) -> None:
    """Change a JSON file in place: ``edit`` mutates its content."""
    content = json.loads(path.read_text())
    edit(content)
    path.write_text(json.dumps(content))


def saved_record(folder: Path, kind: str) -> dict:
    """The patch record a ``kind`` checkpoint in ``folder`` saved, as the file holds it."""
    checkpoint = CHECKPOINT_KINDS[kind]
    return json.loads((folder / checkpoint.record_file).read_text())[checkpoint.record_field]


def edit_record(folder: Path, kind: str, edit: Callable[[dict], None]) -> None:
    """Change the patch record of a ``kind`` checkpoint in ``folder`` where that kind keeps it (config.json's
    "hf_neural_attn" field, the adapter JSON's "patch" field): ``edit`` mutates the record."""
    checkpoint = CHECKPOINT_KINDS[kind]
    edit_json(folder / checkpoint.record_file, lambda content: edit(content[checkpoint.record_field]))


# --- Scorers on their own, in float64 ----------------------------------------------------------------------------

HIDDEN, HEADS, KV_HEADS, D = 6, 2, 1, 4
F64 = torch.float64

# The activations the literal references write out, by the name the scorer configs take.
ACTIVATIONS = {"gelu": F.gelu, "tanh": torch.tanh, "relu": F.relu}


def geometry(**overrides) -> AttentionGeometry:
    values = dict(
        hidden_size=HIDDEN,
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=D,
        query_bias=True,
        query_weight_std=0.5,
        dtype=F64,
        device=torch.device("cpu"),
    )
    values.update(overrides)
    return AttentionGeometry(**values)


def randomise(module, seed=0, std=0.7) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator, dtype=F64) * std)


def rope_vector(vector, position, base=10000.0):
    """RoPE of one D-vector at one position, rotate-half convention (as Llama), written out."""
    half = vector.shape[-1] // 2
    out = torch.empty_like(vector)
    for m in range(half):
        angle = position * base ** (-2 * m / vector.shape[-1])
        x1, x2 = vector[m], vector[m + half]
        out[m] = x1 * math.cos(angle) - x2 * math.sin(angle)
        out[m + half] = x2 * math.cos(angle) + x1 * math.sin(angle)
    return out


def rope_rows(x, positions):
    """The library-side rotation: (batch, n, seq, D) rotated at ``positions`` (seq,), vectorised."""
    half = x.shape[-1] // 2
    inv_freq = 10000.0 ** (-torch.arange(half, dtype=F64) * 2 / x.shape[-1])
    angles = positions.to(F64)[:, None] * inv_freq[None]
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    rotated_half = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated_half * sin


def qana_case(batch: int = 2, q_len: int = 3, k_len: int = 5):
    """Hidden states (batch, q_len, HIDDEN), the model's own query projection W_s (HEADS * D, HIDDEN) and b_s,
    keys (batch, HEADS, k_len, D), and the query and key positions (float64, from the global RNG)."""
    hidden = torch.randn(batch, q_len, HIDDEN, dtype=F64)
    w_s, b_s = torch.randn(HEADS * D, HIDDEN, dtype=F64), torch.randn(HEADS * D, dtype=F64)
    keys = torch.randn(batch, HEADS, k_len, D, dtype=F64)
    return hidden, w_s, b_s, keys, torch.arange(2, 2 + q_len), torch.arange(k_len)


class AttentionUnderTest(nn.Module):
    """Hidden states and q, k, v in, attention output out: the whole scorer path, as a module."""

    def __init__(self, scorer, mask, positions):
        super().__init__()
        self.scorer, self.mask, self.positions = scorer, mask, positions

    def forward(self, hidden, query, key, value):
        extras = self.scorer.query_extras(hidden, lambda x: rope_rows(x, self.positions))
        return scored_attention(self.scorer, query, key, value, self.mask, scaling=D**-0.5, extras=extras)[0]


def causal_gradcheck(scorer, seq: int, seed: int = 0) -> bool:
    """float64 gradcheck of the whole scorer path under a causal mask, with respect to the hidden states,
    q, k, v and every scorer parameter."""
    mask = torch.zeros(1, 1, seq, seq, dtype=F64)
    mask[..., ~torch.ones(seq, seq, dtype=torch.bool).tril()] = torch.finfo(F64).min
    module = AttentionUnderTest(scorer, mask, torch.arange(seq))
    names = [name for name, _ in module.named_parameters()]

    def attention(hidden, query, key, value, *parameters):
        return functional_call(module, dict(zip(names, parameters)), (hidden, query, key, value))

    generator = torch.Generator().manual_seed(seed)
    inputs = (
        torch.randn(1, seq, HIDDEN, dtype=F64, generator=generator).requires_grad_(),
        *(torch.randn(1, HEADS, seq, D, dtype=F64, generator=generator).requires_grad_() for _ in range(3)),
        *(p.detach().clone().requires_grad_() for p in module.parameters()),
    )
    return torch.autograd.gradcheck(attention, inputs, eps=1e-6, atol=1e-7)


# --- The table of scorer cases -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ScorerCase:
    """One way of patching a model, and what docs/scorers.md says it should do. A new scorer (or a new mode of
    one) is one row of SCORER_CASES; tests/test_scorer_contracts.py then runs every common contract on it."""

    name: str
    options: dict = field(default_factory=dict)
    preserving: bool = True  # outputs equal the unpatched model's at init
    # Parameter names (last dotted component before .weight/.bias, e.g. "gate", "query_down") whose first
    # gradient is zero by construction and that move from the second step (docs/scorers.md, "Our init").
    waits: tuple[str, ...] = ()
    parameters: bool = True  # the scorer adds parameters to the model
    chunked: bool = True  # impl="chunked" applies
    families: tuple[str, ...] = CORE_FAMILIES  # the FAMILY_CASES it can patch

    @property
    def id(self) -> str:
        return "-".join([self.name, *(f"{key}={value}" for key, value in self.options.items())])

    @property
    def family(self) -> str:
        """The one family the costlier contracts (backward, chunked, checkpoint) run on."""
        return "gpt2" if "gpt2" in self.families else self.families[0]

    @property
    def fused(self) -> bool:
        """Whether the scorer has a fused form with these options (``Scorer.fused_unsupported_reason`` is None), so
        that the blockwise path and the Triton kernels serve it. Asked of the scorer itself, built on the float64
        test geometry (no RoPE; on a RoPE model Neural Attention's replace mode has none)."""
        scorer_type = scorer_class(self.name)
        scorer = scorer_type(scorer_type.config_class.from_options(self.options), geometry())
        return scorer.fused_unsupported_reason() is None


SCORER_CASES = [
    ScorerCase("qana", {}, waits=("gate",)),
    ScorerCase("neural", {}, waits=("gate",)),
    ScorerCase("neural", {"proj_dim": 2}, waits=("gate", "query_down", "key_down")),
    ScorerCase("neural", {"mode": "replace"}, preserving=False),
    ScorerCase("additive", {}, waits=("gate",)),
    ScorerCase("additive", {"mode": "replace"}, preserving=False),
    ScorerCase("general", {}),
    # No parameters and no softmax: for training from scratch. NSEA mixes every query into each key's weight,
    # so it refuses causal models.
    ScorerCase(
        "nsea",
        {"mode": "replace"},
        preserving=False,
        parameters=False,
        chunked=False,
        families=tuple(family_names(core=True, causal=False)),
    ),
    ScorerCase("hea", {"mode": "replace"}, preserving=False, parameters=False, chunked=False),
]


# The scorers with a fused form, each once, in SCORER_CASES' order: the tests that run scorers by name (paths,
# kernels, whole models) run these.
FUSED_SCORERS = tuple(dict.fromkeys(case.name for case in SCORER_CASES if case.fused))


def scorer_cases(with_family: bool = False, **where):
    """pytest params of SCORER_CASES rows whose attributes equal ``where``; with_family: one param per (row,
    family) the row can patch."""
    rows = rows_where(SCORER_CASES, **where)
    if not with_family:
        return [pytest.param(case, id=case.id) for case in rows]
    return [pytest.param(case, family, id=f"{case.id}-{family}") for case in rows for family in case.families]


def assert_same_outputs_and_grads(result, expected, atol: float) -> None:
    """``result`` and ``expected``, each (output, [gradient or None, ...]), agree: the output to ``atol``, each
    gradient to ``atol`` times its reference's largest magnitude (at least 1), None where the reference is None."""
    (output, grads), (ref_output, ref_grads) = result, expected
    torch.testing.assert_close(output, ref_output, rtol=0, atol=atol)
    for index, (grad, ref_grad) in enumerate(zip(grads, ref_grads, strict=True)):
        assert (grad is None) == (ref_grad is None), index
        if grad is not None:
            scale = max(1.0, ref_grad.abs().max().item())
            torch.testing.assert_close(
                grad, ref_grad, rtol=0, atol=atol * scale, msg=lambda m, i=index: f"tensor {i}: {m}"
            )


def negligible(grad: torch.Tensor, reference: torch.Tensor) -> bool:
    """Zero up to fp32 rounding, relative to a gradient that is really there."""
    return bool(grad.abs().max() <= 1e-4 * reference.abs().max())


def free_port() -> int:
    """A TCP port on 127.0.0.1 nothing listens on, for a server a test starts."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def healthy(url: str) -> bool:
    """Whether the server at ``url`` answers its ``/health`` endpoint (transformers serve's and vLLM's) with 200."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
            return response.status == 200
    except OSError:
        return False
