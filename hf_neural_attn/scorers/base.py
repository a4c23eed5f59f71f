"""What every scorer shares: its configuration, the geometry of the attention it joins, and the module API.

A *scorer* replaces the score ``q_i . k_j / sqrt(d)`` of one attention module with a richer function of
``(q_i, k_j)``. It owns only the scoring math and its parameters; how the scores become an attention
output (full matrix, chunked, fused kernel) lives in :mod:`hf_neural_attn.ops`, and how a model family
hands over q, k and RoPE lives in :mod:`hf_neural_attn.families`.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import itertools
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ..compat.internals import mark_initialized
from ..ops.choices import DEFAULT_IMPL, IMPL_OPTIONS

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "relu": F.relu,
    "silu": F.silu,
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
}

INITS = ("default", "zero")


def option(
    default: Any, help: str, *, choices=None, minimum: int | None = None, nullable: bool = False, runtime: bool = False
) -> Any:
    """A scorer option: a dataclass field whose metadata declares its meaning and constraints once.

    ``help`` is the text shown by ``--help`` in the recipes and in the docs; ``choices`` the accepted values;
    ``minimum`` makes it an integer option of at least that value (numpy integers and 0-d integer tensors are
    accepted and stored as Python ints); ``nullable`` allows ``None``. An option whose default is a bool takes
    only ``True`` or ``False``. ``runtime`` marks a setting of how the model runs rather than of the model (the
    compute path ``impl``): :meth:`ScorerConfig.to_dict`, what a patch record saves, leaves it out.
    :meth:`ScorerConfig.validate` checks these constraints, and the recipes build their flags, resume checks and
    config-file keys from them.
    """
    metadata = {"help": help, "choices": tuple(choices) if choices is not None else None}
    metadata.update(minimum=minimum, nullable=nullable, runtime=runtime)
    return field(default=default, metadata=metadata)


def redefault(config_class: type, name: str, default: Any) -> Any:
    """The option ``name`` of ``config_class`` with another default (help and constraints kept)."""
    return field(default=default, metadata=config_class.__dataclass_fields__[name].metadata)


@dataclass
class ScorerConfig:
    """Options every scorer has. Each option's meaning and constraints are in its field's metadata
    (:func:`option`); :meth:`option_fields` lists them."""

    scorer_name: ClassVar[str] = ""
    # Options added after checkpoints were written with a different behaviour: a patch record without the option
    # meant this value (see :meth:`from_record`).
    record_defaults: ClassVar[dict[str, Any]] = {}
    # The options a patch is named by in one line (the recipes' report titles and logs), as (option, label):
    # ``qana, h=4, layers=[0]``.
    summary_options: ClassVar[tuple[tuple[str, str], ...]] = (("h", "h"),)

    impl: str = option(
        DEFAULT_IMPL,
        "how scores become attention outputs: auto (the default) picks per call, the reference path for small "
        "score tensors and chunked above (see ops.dispatch.resolve_impl); reference materialises the score matrix "
        "(the test oracle); chunked computes blocks of queries and recomputes them in backward (memory linear in n); "
        "triton runs fused CUDA kernels (QANA, Neural Attention with depth 1)",
        choices=IMPL_OPTIONS,
        runtime=True,
    )

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Normalise integer options to Python ints, then check every declared constraint."""
        for item in self.option_fields():
            value = _as_int(getattr(self, item.name)) if item.metadata.get("minimum") is not None else None
            if value is not None:
                setattr(self, item.name, value)
        for item in self.option_fields():
            _check_option(item, getattr(self, item.name))

    @classmethod
    def option_fields(cls) -> list[dataclasses.Field]:
        return list(dataclasses.fields(cls))

    @classmethod
    def option_names(cls) -> list[str]:
        return [f.name for f in cls.option_fields()]

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> ScorerConfig:
        """Build a config from keyword options, naming any option this scorer does not have."""
        unknown = sorted(set(options) - set(cls.option_names()))
        if unknown:
            raise ValueError(
                f"Unknown option(s) {unknown} for scorer {cls.scorer_name!r}. Valid options: {cls.option_names()}."
            )
        return cls(**options)

    @classmethod
    def from_record(cls, options: dict[str, Any]) -> ScorerConfig:
        """The config a saved patch record's options describe; options the record predates take the value that
        reproduces what was saved (:attr:`record_defaults`), not today's default."""
        return cls.from_options({**cls.record_defaults, **options})

    def to_dict(self, *, runtime: bool = False) -> dict[str, Any]:
        """The options a patch record saves: every option but the run-time ones (``impl``), unless ``runtime``."""
        return {
            item.name: _jsonable(getattr(self, item.name))
            for item in self.option_fields()
            if runtime or not item.metadata.get("runtime")
        }

    def from_scratch_reason(self) -> str | None:
        """Why these options cannot keep a pretrained model's outputs (``patch_model`` warns with it), or None."""
        return None

    @property
    def narrow_key_dim(self) -> int | None:
        """The width of queries and keys this scorer asks the attention module to compute at, below the model's head
        dimension (the patch then replaces the query and key projections by narrower new ones,
        :mod:`hf_neural_attn.narrow_keys`), or None: the model's own width. Scorers that have such an option override
        this; no other module reads the option by its name."""
        return None

    def resolved(self, geometry: AttentionGeometry) -> ScorerConfig:
        """This config with every option whose value depends on the model (an ``"auto"``) resolved for an attention
        module of this ``geometry``: what the patch computes, and so what its record says. Options resolved here
        make a saved record independent of the loading version's rule."""
        return self

    @property
    def has_gates(self) -> bool:
        """Whether the scorer has per-head gates alpha (a ``gate`` parameter) that weigh its term beside the dot
        product: the function-preserving forms start them at 0 and training opens them."""
        return False


@dataclass
class MLPScorerConfig(ScorerConfig):
    """Options of the scorers built around a small MLP (QANA, Neural Attention, additive)."""

    h: int = option(4, "hidden width of the scoring MLP", minimum=1)
    activation: str = option("gelu", "the scoring MLP's nonlinearity", choices=ACTIVATIONS)
    init: str = option(
        "default",
        "init of the new parameters: default keeps the model's outputs and lets gradients reach the new parameters; "
        "zero is the papers' literal all-zero init, under which no gradient ever reaches them (it warns)",
        choices=INITS,
    )


def attention_head_dim(module: nn.Module) -> int | None:
    """The per-head width an attention module states (``head_dim``; ``attention_head_size`` in BERT and ViT), or
    the config's ``hidden_size // num_attention_heads``; None when it states none."""
    for name in ("head_dim", "attention_head_size"):
        value = getattr(module, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    config = getattr(module, "config", None)
    hidden, heads = getattr(config, "hidden_size", None), getattr(config, "num_attention_heads", None)
    return hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads else None


def _as_int(value: Any) -> int | None:
    """A numpy integer or 0-d integer tensor as a Python int (sweeps make them); None for anything else."""
    if isinstance(value, (bool, int)) or value is None:
        return None
    if getattr(value, "ndim", 0) != 0 or getattr(value, "is_floating_point", lambda: False)():
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _check_option(item: dataclasses.Field, value: Any) -> None:
    meta = item.metadata
    if value is None and meta.get("nullable"):
        return
    if isinstance(item.default, bool) and not isinstance(value, bool):
        raise ValueError(f"{item.name} must be True or False: {meta['help']}; got {item.name}={value!r}.")
    if meta.get("minimum") is not None:
        minimum = meta["minimum"]
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            kind = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
            alternative = " (or None)" if meta.get("nullable") else ""
            raise ValueError(f"{item.name} must be {kind}{alternative}: {meta['help']}; got {item.name}={value!r}.")
    if meta.get("choices") is not None:
        _check_choice(item.name, value, meta["choices"])


def _check_choice(name: str, value: Any, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not supported; choose one of {sorted(choices)}.")


def _jsonable(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


class HeadLayout(enum.Enum):
    """How one scorer parameter relates to the attention heads, which is how it shards when the heads do (tensor
    parallelism: each process holds a slice of the heads, ``docs/api.md``).

    ``PER_HEAD``: its first dimension holds the heads, in equal contiguous blocks (a per-head gate ``(heads,)``, a
    per-head matrix ``(heads, h, d)``, the widened query's rows ``(heads * rows, hidden)``, head by head): a process
    holds the blocks of its own heads. ``SHARED``: one value serves every head (Neural Attention's MLP): every process
    holds all of it, and the gradient each computes from its own heads is summed over the processes.
    """

    PER_HEAD = "per_head"
    SHARED = "shared"


@dataclass(frozen=True)
class AttentionGeometry:
    """The shape facts a scorer needs about the attention module it joins.

    Attributes:
        hidden_size: width of the hidden states the query projection reads.
        num_heads: query heads.
        num_kv_heads: key/value heads (fewer than ``num_heads`` under grouped-query attention).
        head_dim: per-head width D_K of queries and keys.
        query_bias: whether the pretrained query projection has a bias (its widening gets one too).
        query_weight_std: standard deviation of the pretrained query projection's weights, the scale
            new query rows are drawn at; for weights on the meta device, the config's ``initializer_range``
            (see ``families.base.query_weight_std``).
        dtype, device: where the pretrained query projection lives; new parameters go there too.
        rope_partner: for each dimension of a head, the dimension the model's RoPE turns it with (itself where RoPE
            leaves it alone): ``p + head_dim/2`` in Llama's rotate-half layout, ``p ± 1`` in an interleaved one. None
            for no RoPE, or a RoPE the family does not describe.
    """

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    query_bias: bool
    query_weight_std: float
    dtype: torch.dtype
    device: torch.device
    rope_partner: tuple[int, ...] | None = None


class Scorer(nn.Module):
    """Base class: the parameters and math of one attention scoring function.

    Subclasses set ``name`` and ``config_class`` and implement :meth:`scores`. A scorer whose
    parameters are functions of the hidden states (QANA's widened query) sets
    ``needs_hidden_states`` and implements :meth:`query_extras`; the patch then computes those extras
    in the attention module's forward and hands them to :meth:`scores`.
    """

    name: ClassVar[str]
    config_class: ClassVar[type[ScorerConfig]]
    needs_hidden_states: ClassVar[bool] = False
    # Scorers whose attention weights are not a softmax of logits (NSEA, HEA) set this to False and
    # implement :meth:`attend`; the ``impl`` paths, which are all softmax attention, then do not apply.
    uses_softmax: ClassVar[bool] = True
    # impl="auto" materialises the scores (the reference path) while batch * heads * q_len * kv_len * h is at most
    # this many numbers, and computes them a block of queries at a time above (ops.dispatch.resolve_impl reads it).
    # Where the two paths cross depends on the scorer: one whose blockwise form crosses elsewhere sets its own value,
    # measured by benchmarks/auto_threshold.py (docs/benchmarks.md, "The auto rule"). This default serves the generic
    # chunked path, measured before the fused scorers got values of their own.
    reference_max_scores: ClassVar[int] = 3 * 2**19
    # Whether a query's output can depend on other queries (NSEA's column sums run over every query). Such a scorer
    # cannot score a slice of the queries alone, which is what context parallelism hands each process.
    mixes_queries: ClassVar[bool] = False

    def __init__(self, config: ScorerConfig, geometry: AttentionGeometry):
        super().__init__()
        self.config = config
        self.geometry = geometry

    def reset_parameters(self) -> None:
        """Draw the parameters' initial values (scorers with parameters implement it)."""

    @torch.no_grad()
    def init_parameters(self) -> None:
        """Give the parameters their initial values where they have storage; subclasses call it last in
        ``__init__``.

        Parameters on the meta device (the model was built on meta: ``with torch.device("meta")``, accelerate's
        ``init_empty_weights()``) have no values to draw; they are drawn when the model is materialised, see
        :meth:`_apply`. Once drawn, every parameter is flagged ``_is_hf_initialized``: transformers'
        ``init_weights()`` would otherwise redraw the scorer's ``nn.Linear`` layers like the model's own
        (normal at ``initializer_range``, zero bias) and leave its other parameters alone, which breaks the
        mirrored pairs that keep the patched model's outputs equal to the original's. transformers' init
        functions skip flagged tensors.
        """
        if any(parameter.is_meta for parameter in self.parameters()):
            return
        self.reset_parameters()
        for parameter in self.parameters():
            mark_initialized(parameter)

    def _apply(self, fn, recurse=True):
        # model.to_empty(device=...) (like .to, .cuda, .half) goes through _apply. When it gives meta parameters
        # storage, that memory holds garbage and transformers' init does not know this module: draw the init here,
        # from the geometry recorded at patch time (its std came from the config, see families.query_weight_std).
        was_meta = any(parameter.is_meta for parameter in self.parameters())
        result = super()._apply(fn, recurse=recurse)
        if was_meta:
            self.init_parameters()
        return result

    def head_layout(self) -> dict[str, HeadLayout] | None:
        """How each parameter relates to the heads, by its name in ``named_parameters()`` (``"gate"``,
        ``"query_extension.weight"``): what tensor parallelism shards with the heads and what it keeps whole. A scorer
        with parameters declares every one of them; None (the default for a scorer with parameters) says it has not,
        and tensor parallelism then refuses it rather than guess. A scorer without parameters has nothing to
        declare."""
        return {} if not any(True for _ in self.parameters()) else None

    @classmethod
    def check_module(cls, config: ScorerConfig, module: nn.Module) -> None:
        """Raise ``ValueError`` if this scorer cannot serve the attention ``module`` (called by
        ``patch_model`` on every selected module before the model is changed)."""

    def query_extras(self, hidden_states: torch.Tensor, rotate: Callable[[torch.Tensor], torch.Tensor] | None) -> Any:
        """Per-query inputs computed from ``hidden_states`` (batch, seq, hidden); ``rotate`` applies the
        model's RoPE at the query positions to a (batch, n, seq, head_dim) tensor, or is None.

        What is returned must be a NamedTuple of tensors with a ``query_block(start, end)`` method giving
        the same inputs for queries ``start:end`` (the chunked path scores one block of queries at a time).
        """
        return None

    def scores(self, query: torch.Tensor, key: torch.Tensor, extras: Any, scaling: float) -> torch.Tensor:
        """Attention logits before masking and softmax.

        Args:
            query: (batch, heads, q_len, head_dim), after the model's RoPE.
            key: (batch, kv_heads, kv_len, head_dim), after RoPE and the KV cache, kv_heads dividing heads: under
                grouped-query attention each query head scores the keys of its group's kv head (not repeated:
                see :mod:`hf_neural_attn.ops.grouped`).
            extras: what :meth:`query_extras` returned for these queries (or None).
            scaling: the model's own dot-product scale (``1/sqrt(head_dim)``, or whatever it uses).

        Returns:
            (batch, heads, q_len, kv_len) logits.
        """
        raise NotImplementedError

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        *,
        scaling: float,
        dropout: float,
        is_causal: bool,
        need_weights: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attention output of a scorer that is not softmax-based (``uses_softmax = False``).

        Args as :meth:`scores`, plus ``value`` (batch, heads, kv_len, head_dim) and the additive float
        ``attention_mask`` (batch or 1, 1, q_len, kv_len) or None, and the attention ``dropout``
        probability to apply to the weights (0 outside training).

        Returns:
            output (batch, heads, q_len, head_dim) and, when ``need_weights``, the weights it applied to
            the values (batch, heads, q_len, kv_len).
        """
        raise NotImplementedError

    def forward(self, query: torch.Tensor, key: torch.Tensor, extras: Any, scaling: float) -> torch.Tensor:
        """Same as :meth:`scores`; lets ``torch.func.functional_call`` run a scorer with given parameters."""
        return self.scores(query, key, extras, scaling)

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.config.to_dict(runtime=True).items())

    def dot_product_view(self) -> Scorer:
        """This scorer reduced to the plain scaled dot product ``scaling * q . k`` of the queries and keys it is
        given, for a patch that cannot be undone (``plotting.unpatched_view``: QANA's ``key_dim`` replaced the
        query and key projections, so the model has no original attention to go back to).

        Returns a new scorer of the same geometry whose parameters *are* this one's tensors (nothing is copied; do
        not train it) and whose scores are exactly that dot product on every path, the probabilities included;
        ``self`` is unchanged. Scorers that keep the dot product beside a term they can switch off override it (see
        :meth:`shared_copy`); the others raise ``ValueError``.
        """
        raise ValueError(
            f"scorer {self.name!r} has no dot-product-only view: its scores do not keep the model's dot product "
            "beside a term that can be switched off. Compare with the model before patching instead "
            "(hf_neural_attn.unpatch_model restores it when the patch replaced no projection)."
        )

    def shared_copy(self) -> Scorer:
        """A copy of this module (config, geometry, submodules) whose parameters and buffers are this one's tensors,
        for views such as :meth:`dot_product_view` to edit without touching ``self``."""
        shared = {id(tensor): tensor for tensor in itertools.chain(self.parameters(), self.buffers())}
        return copy.deepcopy(self, memo=shared)

    def fused_unsupported_reason(self) -> str | None:
        """Why this scorer's configuration has no fused form (a pair-MLP term, :meth:`fused_inputs`), or None
        if it has one. The fused form is what the Triton kernels and the blockwise chunked path compute;
        scorers with one override this and :meth:`fused_inputs`."""
        return f"scorer {self.name!r} has no fused form (only 'qana' and one-layer 'neural' do)"

    def fused_inputs(self, query: torch.Tensor, key: torch.Tensor, extras: Any):
        """What the fused paths need for one call: a :class:`hf_neural_attn.ops.terms.FusedInputs` of
        plain tensors and static values. ``key`` has its kv heads (not repeated for grouped-query
        attention). Called only when :meth:`fused_unsupported_reason` returned None."""
        raise NotImplementedError(f"scorer {self.name!r} has no fused form")
