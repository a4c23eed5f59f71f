"""The standard attention plumbing of transformers decoders, described once and checked per module.

Most transformers attention modules share one layout: a query projection read from the forward's
``hidden_states``, RoPE from the decoder's ``position_embeddings = (cos, sin)`` applied by their modeling
module's ``apply_rotary_pos_emb``, and a call to the attention function that ``config._attn_implementation``
names. :class:`StandardAttentionFamily` serves every such module. A model family that has this layout needs
at most a description of where its query rows live (:meth:`StandardAttentionFamily.query_projection`,
``q_proj`` by default; Phi-3 slices its fused ``qkv_proj``).

Matching by attribute names alone would also accept modules that only look standard, so before a module is
patched a *probe* runs its own forward once on a few random tokens, with the attention function swapped
for one that records what the module hands it (nothing of the model changes):

* the query it scores must be the query projection of ``hidden_states``, optionally through the module's
  own query norm (Qwen3, OLMo2, Gemma3, Cohere, StableLM: QANA's extra rows are not normalised, as in the
  Llama adapter), with ``num_heads * head_dim`` rows (a projection that also carries gates is refused);
* with ``cos = 1, sin = 0`` the query must be unrotated, and with random angles it must equal the module's
  ``apply_rotary_pos_emb`` applied to that unrotated query (partial rotary included), which is exactly
  what QANA's row-wise RoPE does to its extra rows. A module that leaves the query unrotated (SmolLM3's
  NoPE layers) gets no row-wise RoPE either;
* the attention it asks for must be plain ``softmax(scaling * q k^T) v``: its own eager attention function
  is run on the recorded call and compared with that. Logit soft-capping (Gemma2), attention sinks
  (GPT-OSS) and other changes to the scores are refused, naming the module and the reason. A non-standard
  ``scaling`` (Granite, Gemma's ``query_pre_attn_scalar``) is fine: it reaches the scorer as it is.

Sliding windows, causal and padding masks come with the mask transformers builds for the patch (the same
as the model's eager path), and the KV cache stays the model's own.
"""

from __future__ import annotations

import copy
import functools
import inspect
import sys
import warnings
import weakref
from collections.abc import Callable

import torch
from torch import nn
from transformers import PretrainedConfig

from ..compat.internals import DISPATCH_ATTRIBUTE, store_implementation
from ..placement.quantized import dense_weight
from ..scorers import AttentionGeometry
from .base import ModelFamily, call_argument, forward_parameters, query_weight_std, rotation

PROBE_IMPLEMENTATION = "hf_neural_attn_probe"
PROBE_TOKENS = 5
_QUERY_NORM_NAMES = ("q_norm", "q_layernorm", "query_layernorm", "query_norm")
_CROSS_ATTENTION_PARAMETERS = ("key_value_states", "encoder_hidden_states", "cross_attention_states")


class UnsupportedAttentionError(TypeError):
    """An attention module looks standard but does something the scorers do not reproduce."""


class StandardAttentionFamily(ModelFamily):
    """Adapter for attention modules with transformers' standard plumbing, checked by a probe.

    Used as it is, it is the generic fallback (``name = "standard"``): it recognises modules by their layout.
    A subclass that names ``attention_classes`` is an explicit entry for a tested model family.
    """

    name = "standard"
    attention_classes: tuple[type[nn.Module], ...] = ()

    def __init__(self) -> None:
        # What the probe found for each module: whether its query turns under RoPE (not in NoPE layers), and
        # its (query heads, key/value heads).
        self._rotates: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()
        self._probed: weakref.WeakKeyDictionary[nn.Module, tuple[int, int]] = weakref.WeakKeyDictionary()
        # Per module that turns its query under RoPE: the dimension each dimension turns with (see AttentionGeometry).
        self._rope_partner: weakref.WeakKeyDictionary[nn.Module, tuple[int, ...]] = weakref.WeakKeyDictionary()

    @property
    def generic(self) -> bool:
        """Whether this is the generic fallback, which recognises modules by their layout alone and warns that the
        model is not in the tested matrix; an entry that names its attention classes is tested."""
        return not self.attention_classes

    # --- recognising modules -------------------------------------------------------------------------------

    def matches(self, module: nn.Module) -> bool:
        if self.attention_classes:
            return isinstance(module, self.attention_classes) and not getattr(module, "is_cross_attention", False)
        return looks_standard(module)

    def reads_shared_config(self, module: nn.Module) -> bool:
        if self.attention_classes:
            return isinstance(module, self.attention_classes)
        # The modules of the patched kind, cross-attention instances (which keep their original attention) too.
        return looks_standard(module, cross_attention=True)

    def check(self, modules: list[nn.Module]) -> None:
        """Probe every module the patch may score (see :meth:`probe`); the generic path also needs them to be
        of one kind of attention, not, say, a vision and a text tower.

        Raises:
            UnsupportedAttentionError: naming the module and the reason.
        """
        classes = sorted({type(module).__name__ for module in modules})
        if not self.attention_classes and len(classes) > 1:
            raise UnsupportedAttentionError(
                f"The generic standard-attention path found several attention classes in this model ({classes}); "
                "it patches models with one kind of self-attention only. Multi-tower and encoder-decoder models "
                "need an explicit family adapter (see docs/families.md)."
            )
        for module in modules:
            self.probe(module)

    # --- the description --------------------------------------------------------------------------------

    def query_projection(self, module: nn.Module) -> tuple[nn.Module, int | None]:
        """The linear layer that produces the module's queries (an ``nn.Linear``, or the bitsandbytes or torchao layer
        that quantized one), and how many of its leading output rows are the query: None for all of them (Phi-3's
        fused ``qkv_proj`` carries keys and values after them)."""
        return module.q_proj, None

    def query_weight(self, module: nn.Module) -> torch.Tensor:
        """The (query rows, hidden) weights of the module's queries, dequantized where they are quantized."""
        layer, rows = self.query_projection(module)
        return dense_weight(layer)[:rows]

    def head_dim(self, module: nn.Module) -> int:
        config = module.config
        return getattr(module, "head_dim", None) or config.hidden_size // config.num_attention_heads

    def rotary_dim(self, module: nn.Module) -> int:
        """How many leading dimensions of each head RoPE rotates (fewer than ``head_dim`` under partial rotary)."""
        config = module.config
        rope = getattr(config, "rope_parameters", None) or {}
        factor = getattr(config, "partial_rotary_factor", None) or rope.get("partial_rotary_factor", 1.0)
        return int(self.head_dim(module) * factor)

    # --- what the patch asks of a family --------------------------------------------------------------------

    def geometry(self, module: nn.Module) -> AttentionGeometry:
        heads, kv_heads = self._probed.get(module) or self.probe(module)
        layer, _ = self.query_projection(module)
        weight = self.query_weight(module)
        return AttentionGeometry(
            hidden_size=layer.in_features,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=self.head_dim(module),
            query_bias=layer.bias is not None,
            query_weight_std=query_weight_std(module, weight),
            dtype=weight.dtype,
            device=weight.device,
            rope_partner=self._rope_partner.get(module),
        )

    def rotary(self, module, args, kwargs) -> Callable[[torch.Tensor], torch.Tensor] | None:
        if not self._rotates.get(module, True):
            return None
        position_embeddings = call_argument(module, args, kwargs, "position_embeddings")
        if position_embeddings is None:
            raise RuntimeError(
                f"{type(module).__name__} was called without position_embeddings; hf_neural_attn applies the "
                "model's RoPE to QANA's extra query rows from them. Call it through the model."
            )
        cos, sin = position_embeddings
        return rotation(module, cos, sin)

    # --- the probe ------------------------------------------------------------------------------------------

    @torch.no_grad()
    def probe(self, module: nn.Module) -> tuple[int, int]:
        """Run ``module`` on random tokens and check that it has the plumbing this adapter assumes.

        Returns:
            (query heads, key/value heads) as the module hands them to its attention function.

        Raises:
            UnsupportedAttentionError: naming the module and what it does that the patch cannot reproduce.
        """
        label = f"{type(module).__name__} ({type(module).__module__})"
        if isinstance(getattr(module, "sinks", None), nn.Parameter):
            raise UnsupportedAttentionError(
                f"{label} uses attention sinks (a learned per-head logit joined to every softmax), which "
                "hf_neural_attn's scorers do not implement; patching it would change the model's outputs."
            )
        layer, rows = self.query_projection(module)
        weight = self.query_weight(module)
        head_dim, rotary_dim = self.head_dim(module), self.rotary_dim(module)
        generator = torch.Generator().manual_seed(0)
        hidden = torch.randn(1, PROBE_TOKENS, layer.in_features, generator=generator).to(weight)
        angles = torch.rand(1, PROBE_TOKENS, rotary_dim, generator=generator).to(weight) * 6.28
        unrotated = _record_call(module, hidden, (torch.ones_like(angles), torch.zeros_like(angles)), label)
        rotated = _record_call(module, hidden, (angles.cos(), angles.sin()), label)
        query = unrotated["query"]
        heads, kv_heads = query.shape[1], unrotated["key"].shape[1]
        if query.shape != (1, heads, PROBE_TOKENS, head_dim) or heads % kv_heads:
            raise UnsupportedAttentionError(
                f"{label} hands its attention function a query of shape {tuple(query.shape)} and a key of "
                f"shape {tuple(unrotated['key'].shape)}; hf_neural_attn expects (batch, heads, seq, head_dim={head_dim}) "
                "with key/value heads dividing query heads."
            )
        if weight.shape[0] != heads * head_dim:
            raise UnsupportedAttentionError(
                f"{label}'s query projection has {weight.shape[0]} output rows but its attention scores "
                f"{heads} heads x {head_dim}: the projection carries more than the query (output gates?), "
                "which hf_neural_attn cannot widen."
            )
        # The query as the module's own projection computes it (a quantized one included), its query rows kept.
        projected = layer(hidden)[..., :rows]
        if not any(_close(query, candidate) for candidate in _query_candidates(module, projected, head_dim)):
            raise UnsupportedAttentionError(
                f"{label}'s query is not its query projection of hidden_states (optionally through its own "
                "q_norm), so hf_neural_attn cannot tell what QANA's extra query rows should read."
            )
        rotates = not _close(rotated["query"], query)
        if rotates:
            try:
                expected = rotation(module, *rotated["position_embeddings"])(query)
            except Exception as error:  # any failure: the description does not fit
                raise UnsupportedAttentionError(
                    f"{label}'s apply_rotary_pos_emb cannot rotate a (batch, heads, seq, head_dim) query by itself "
                    f"({type(error).__name__}: {error}); its RoPE is not the standard one."
                ) from error
            if not _close(rotated["query"], expected):
                raise UnsupportedAttentionError(
                    f"{label} rotates its query differently from its modeling module's apply_rotary_pos_emb "
                    "(multimodal or 2-D RoPE, or a position-dependent query scale), so QANA's row-wise RoPE "
                    "would not match it."
                )
            partner = _rope_partner(rotation(module, *rotated["position_embeddings"]), head_dim, query)
            if partner is not None:
                self._rope_partner[module] = partner
        _check_plain_softmax(module, rotated, label)
        self._rotates[module] = rotates
        self._probed[module] = (heads, kv_heads)
        return heads, kv_heads

    def warn_if_generic(self, model: nn.Module, modules: list[nn.Module]) -> None:
        if self.generic:
            warnings.warn(
                f"{type(model).__name__}: {type(modules[0]).__name__} has no tested hf_neural_attn family; it is "
                "patched through the generic standard-attention path, whose probe checked its query, RoPE and "
                "attention math. Check outputs (docs/families.md).",
                UserWarning,
                stacklevel=4,
            )


def looks_standard(module: nn.Module, cross_attention: bool = False) -> bool:
    """Whether ``module`` has the layout the generic path can describe (the probe checks the rest).
    Instances flagged ``is_cross_attention`` count only with ``cross_attention=True``."""
    if not all(isinstance(getattr(module, name, None), nn.Linear) for name in ("q_proj", "k_proj", "v_proj")):
        return False
    if not isinstance(getattr(module, "config", None), PretrainedConfig):
        return False
    if getattr(module, "is_cross_attention", False) and not cross_attention:
        return False
    module_class = type(module)
    parameters = forward_parameters(module_class)
    modeling = sys.modules.get(module_class.__module__)
    return (
        "hidden_states" in parameters
        and "position_embeddings" in parameters
        and not any(name in parameters for name in _CROSS_ATTENTION_PARAMETERS)
        and hasattr(modeling, "apply_rotary_pos_emb")
        and hasattr(modeling, "eager_attention_forward")
        and _reads_attention_registry(module_class)
    )


@functools.cache
def _reads_attention_registry(module_class: type[nn.Module]) -> bool:
    """Whether the class's forward looks its attention function up in transformers' registry."""
    try:
        source = inspect.getsource(module_class.forward)
    except (OSError, TypeError):
        return False
    return "ALL_ATTENTION_FUNCTIONS" in source and DISPATCH_ATTRIBUTE in source


class _Recording:
    calls: list[dict] | None = None


def probe_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Registered as ``"hf_neural_attn_probe"`` (the ``"family probe"`` row of ``integrations.installer.INTEGRATIONS``,
    once this module and transformers' modeling stack are imported): records the call, returns zeros of the output's
    shape."""
    if _Recording.calls is None:
        raise RuntimeError(f"{PROBE_IMPLEMENTATION!r} is hf_neural_attn's internal probe, not an attention function.")
    _Recording.calls.append(
        {"module": module, "query": query, "key": key, "value": value, "scaling": scaling, "kwargs": kwargs}
    )
    return torch.zeros_like(query).transpose(1, 2).contiguous(), None


def _record_call(module: nn.Module, hidden: torch.Tensor, position_embeddings: tuple, label: str) -> dict:
    """Call ``module`` on ``hidden`` with the probe as its attention function; the one call it made."""
    config, was_training = module.config, module.training
    # The module reads the probe's name from a shallow copy of its config, so the model's own config (shared
    # with its other modules, maybe with other models) never changes. A patched model's config class pins
    # its implementation (patched_config), so the copy takes the plain base class. The internal attribute,
    # not the property: the property's setter would also rewrite every sub-config.
    probe_config = copy.copy(config)
    probe_config.__class__ = getattr(config, "_base_config_class", type(config))
    store_implementation(probe_config, PROBE_IMPLEMENTATION)
    _Recording.calls = []
    try:
        module.config = probe_config
        module.eval()
        module.forward(hidden_states=hidden, position_embeddings=position_embeddings, attention_mask=None)
    except Exception as error:  # the module is not what the description says
        raise UnsupportedAttentionError(
            f"{label} could not be run as a standard attention module (hidden_states, position_embeddings=(cos, "
            f"sin), attention_mask=None): {type(error).__name__}: {error}"
        ) from error
    finally:
        calls, _Recording.calls = _Recording.calls, None
        module.config = config
        module.train(was_training)
    if len(calls) != 1 or calls[0]["module"] is not module:
        raise UnsupportedAttentionError(
            f"{label} made {len(calls)} attention-function calls through config._attn_implementation in one forward "
            "(the patch needs exactly one, by the module itself)."
        )
    return {**calls[0], "position_embeddings": position_embeddings}


def _query_candidates(module, projected, head_dim):
    """What the unrotated query may be, given the query projection of the probe's hidden states (batch, seq, rows):
    the projection (clamped where the config sets ``clip_qkv``), or the module's own query norm of it (per head or
    over the whole projection), as (batch, heads, seq, head_dim)."""
    clip = getattr(module.config, "clip_qkv", None)  # OLMo clamps q, k, v before anything else
    for projection in (projected,) if clip is None else (projected, projected.clamp(-clip, clip)):
        per_head = projection.view(*projection.shape[:2], -1, head_dim)
        yield per_head.transpose(1, 2)
        for name in _QUERY_NORM_NAMES:
            norm = getattr(module, name, None)
            if not isinstance(norm, nn.Module):
                continue
            yield from _normed(norm, projection, per_head)


def _normed(norm: nn.Module, projection: torch.Tensor, per_head: torch.Tensor):
    """``norm`` applied per head (either layout) or over the whole projection, where its shape allows."""
    forms = (
        lambda: norm(per_head).transpose(1, 2),
        lambda: norm(per_head.transpose(1, 2)),
        lambda: norm(projection).view(per_head.shape).transpose(1, 2),
    )
    for form in forms:
        try:
            yield form()
        except (RuntimeError, ValueError, TypeError, IndexError):  # a norm of another shape
            continue


def _check_plain_softmax(module: nn.Module, call: dict, label: str) -> None:
    """The module's own eager attention on the recorded call must be ``softmax(scaling * q k^T) v``."""
    kwargs = call["kwargs"]
    # Named first: on the probe's small random logits their effect can hide under the tolerance below.
    for name, reason in (("softcap", "logit soft-capping"), ("s_aux", "attention sinks")):
        if kwargs.get(name) is not None:
            _refuse_math(label, f"{reason} ({name}={kwargs[name] if name == 'softcap' else '...'})")
    query, key, value = (call[name].float() for name in ("query", "key", "value"))
    scaling = call["scaling"] if call["scaling"] is not None else query.shape[-1] ** -0.5
    groups = query.shape[1] // key.shape[1]
    repeated_key, repeated_value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    # Logits of standard deviation ~4, so a change to the scores shows in the softmax.
    query = query * 4 / (query @ repeated_key.transpose(-1, -2) * scaling).std().clamp(min=1e-6)
    reference = torch.softmax(query @ repeated_key.transpose(-1, -2) * scaling, dim=-1) @ repeated_value
    eager = sys.modules[type(module).__module__].eager_attention_forward
    try:
        output = eager(module, query, key, value, None, scaling=scaling, dropout=0.0, **kwargs)[0]
    except Exception as error:  # any failure: its attention is not the plain one
        raise UnsupportedAttentionError(
            f"{label}'s eager attention could not be run on its own recorded call ({type(error).__name__}: {error})."
        ) from error
    if not _close(output.float(), reference.transpose(1, 2), tolerance=1e-4):
        _refuse_math(label, f"an attention that is not softmax(scaling * q k^T) v (extra arguments: {sorted(kwargs)})")


def _refuse_math(label: str, reason: str) -> None:
    raise UnsupportedAttentionError(
        f"{label} uses {reason}, which hf_neural_attn's scorers do not implement; patching it would change the "
        "model's outputs."
    )


def _close(actual: torch.Tensor, expected: torch.Tensor, tolerance: float | None = None) -> bool:
    if actual.shape != expected.shape:
        return False
    if tolerance is None:
        # Same operations on the same tensors: equal to a few units of rounding in the model's dtype.
        tolerance = 16 * torch.finfo(actual.dtype).eps if actual.is_floating_point() else 0.0
    scale = max(float(expected.abs().max()), 1.0)
    return bool((actual.float() - expected.float()).abs().max() <= tolerance * scale)


def _rope_partner(rotate, head_dim: int, like: torch.Tensor) -> tuple[int, ...] | None:
    """For each dimension of a head, the one ``rotate`` (a :func:`rotation` at the probe's angles) turns it with,
    itself where it is left alone; None if some dimension mixes with more than one other (not a RoPE of pairs).

    Read off the rotation itself, so Llama's rotate-half layout, interleaved RoPE (Cohere, GLM) and partial rotary
    all come out right without the family naming its layout.
    """
    basis = torch.eye(head_dim, dtype=like.dtype, device=like.device)
    turned = rotate(basis[None, :, None, :].expand(1, head_dim, PROBE_TOKENS, head_dim))
    touches = (turned[0].abs() > 1e-6).any(dim=1)  # (head_dim, head_dim): where each basis vector ends up
    partner = []
    for dim in range(head_dim):
        others = [other for other in touches[dim].nonzero().flatten().tolist() if other != dim]
        if len(others) > 1:
            return None
        partner.append(others[0] if others else dim)
    if any(partner[partner[dim]] != dim for dim in range(head_dim)):
        return None
    return tuple(partner)
