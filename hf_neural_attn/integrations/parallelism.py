"""Tensor, context and sequence parallelism: what the library adds to transformers', torch's and DeepSpeed's so that a
patched model scales out, or is refused by name. Nothing else in the library touches those APIs.

**Tensor parallelism** (transformers' ``tp_plan`` / ``DistributedConfig``, accelerate's ``ParallelismConfig(tp_size)``):
transformers shards an attention module by head (``q_proj``, ``k_proj``, ``v_proj`` ``"colwise"``, ``o_proj``
``"rowwise"``), so the attention function gets this process's heads only. A scorer is sharded the same way, from what
it declares of its own parameters (:meth:`~hf_neural_attn.scorers.Scorer.head_layout`), through transformers' own
parallel styles and plan:

* a per-head ``nn.Linear`` the scorer calls as a module (QANA's widened query, whose rows come head by head) is
  ``"colwise"``, as ``q_proj`` is: its output is this process's heads' rows;
* other per-head parameters (gates, per-head matrices) are sharded on their first dimension, as transformers shards
  attention sinks: ``"colwise"`` for one or two dimensions, and :data:`PER_HEAD_STYLE`, registered in transformers'
  parallel-style registry, for more (``"colwise"`` would cut a 3-D tensor on its second dimension); the scorer reads
  them as local tensors while it runs (:func:`sharded_parameters_local`), as ``"local_params"`` makes sinks' owner do;
* parameters shared by every head (Neural Attention's MLP) stay whole on every process (:data:`SHARED_STYLE`,
  registered too), and the gradient each process computes from its own heads is summed over the processes where the
  parameter is read, as ``"replicated_with_grad_allreduce"`` does for Qwen3's q/k norms. (That style hooks a module's
  forward, and a scorer's parameters are read outside its forward, so the sum is taken where they are read; gradient
  accumulation then sums each step once.)

The scorer's entries join the model's ``tp_plan``; rank 0's init is broadcast first, so every process holds slices of
one init. An attention module whose heads are whole on every process (Phi-3's ``"colwise_gather_output"``) keeps its
scorer whole. Anything else, a scorer that has not declared its layout, heads that do not divide over the processes,
projections sharded another way, is refused by :func:`tensor_parallel_heads` before the model changes.

**Context parallelism** (torch's ``context_parallel``, which accelerate's ``cp_size`` runs): torch swaps
``scaled_dot_product_attention`` for a ring version and shards the sequence; the scorers never call SDPA, so each
process would score its queries against its own keys only. :func:`attention_across_ranks` gathers every process's keys
and values (with their gradients) and scores this process's queries against all of them, causal under torch's
load-balanced (head-tail) split or the plain one. What it cannot make right is refused by name.

**Sequence parallelism** (DeepSpeed's Ulysses, accelerate's ``sp_size``) is refused: :func:`refuse_ulysses` wraps
DeepSpeed's registration, and :func:`check_no_sequence_parallelism` catches a run whose registration it did not see.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
import sys
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..placement.zero3 import is_partitioned
from ..scorers import HeadLayout, Scorer
from .internals import (
    attn_implementation_of,
    mark_initialized,
    set_tensor_parallel_plan,
    tensor_parallel_plan,
)
from .wrapping import wrap_once

# The parallel styles the library registers in transformers' registry (ALL_PARALLEL_STYLES), by name.
PER_HEAD_STYLE = "hf_neural_attn_per_head"
SHARED_STYLE = "hf_neural_attn_shared"
# transformers' styles the scorers' entries use, and what the attention modules' entries may be.
COLWISE = "colwise"
HEAD_SHARDING_STYLES = frozenset({COLWISE, "rowwise"})  # q/k/v colwise and o rowwise: each process its heads
WHOLE_HEAD_STYLES = frozenset({"colwise_gather_output", "colwise_rep", "rowwise_split_input", "rowwise_rep"})
SHARDS_ATTR = "_hf_neural_attn_shards"  # on a sharded scorer: its ScorerShards
_TP_HELP = 'docs/api.md ("Tensor, context and sequence parallelism")'


def _dtensor_class() -> type | None:
    """torch's DTensor class, or None where nothing has imported it (then no tensor can be one)."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def is_dtensor(tensor: Any) -> bool:
    dtensor = _dtensor_class()
    return dtensor is not None and isinstance(tensor, dtensor)


def plan_style(plan: dict[str, str], name: str) -> str | None:
    """The style ``plan`` (transformers' ``tp_plan``, layer numbers as ``*``) gives module or parameter ``name``."""
    return plan.get(wildcard(name))


def wildcard(name: str) -> str:
    """``name`` with its layer numbers as ``*``, as transformers writes plan keys (``model.layers.*.self_attn``)."""
    return re.sub(r"\.\d+(\.|$)", lambda match: ".*" + match.group(1), name)


@dataclasses.dataclass(frozen=True)
class HeadShards:
    """How one attention module's heads are spread over a tensor-parallel mesh: ``mesh`` (1-D, one process per
    shard), each process holding ``heads // mesh.size()`` query heads and ``kv_heads // mesh.size()`` key/value heads,
    in order (process 0 the first)."""

    mesh: Any  # torch.distributed.device_mesh.DeviceMesh
    module_name: str


@dataclasses.dataclass(frozen=True)
class ScorerShards:
    """What a sharded scorer needs while it runs (:func:`sharded_parameters_local`): its per-head parameters held as
    shards that it reads as local tensors (``local``), its shared ones whose gradients are summed over the processes
    (``shared``), by their names in the scorer, and the ``mesh``. Frozen and copied as itself (a view of the scorer,
    ``Scorer.shared_copy``, shares it)."""

    mesh: Any
    local: tuple[str, ...]
    shared: tuple[str, ...]

    def __deepcopy__(self, memo) -> ScorerShards:
        return self


def tensor_parallel_heads(model: nn.Module, module: nn.Module, scorer: Scorer) -> HeadShards | None:
    """How ``module``'s heads are sharded, if tensor parallelism shards them, checked against what ``scorer`` (built
    whole for it) declares of its parameters; None when the attention is not sharded by head (no tensor parallelism,
    or its heads whole on every process, as Phi-3's plan keeps them), so the scorer stays whole too.

    Read before the model changes: ``patch_model`` calls it for every module it patches.

    Raises:
        ValueError: the attention is sharded, and the scorer cannot follow: it has not declared how its parameters
            relate to the heads, the heads do not divide over the processes, or the module's projections are sharded
            in a way this does not know (the message names the module and the styles).
    """
    # The projections transformers' apply_tensor_parallelism sharded (it marks what it hooks; FSDP2's DTensors, on
    # their own mesh, are not tensor parallelism's business).
    sharded = {
        name: child
        for name, child in module.named_children()
        if getattr(child, "_is_hooked", False) and any(is_dtensor(parameter) for parameter in child.parameters())
    }
    if not sharded:
        return None
    module_name = next(name for name, candidate in model.named_modules() if candidate is module)
    plan = tensor_parallel_plan(model)
    styles = {name: plan_style(plan, f"{module_name}.{name}") for name in sharded}
    if set(styles.values()) <= WHOLE_HEAD_STYLES:
        return None  # every projection's output is whole on every process: so are the heads, and the scorer
    where = f"{module_name} ({type(module).__name__})"
    if not set(styles.values()) <= HEAD_SHARDING_STYLES or COLWISE not in styles.values():
        raise ValueError(
            f"hf_neural_attn cannot shard the scorer of {where} under tensor parallelism: its projections are sharded "
            f"as {styles} (None: no plan entry), and the scorers shard with the heads, which needs the query, key and "
            "value projections 'colwise' and the output projection 'rowwise' (transformers' own plan for Llama-style "
            "attention), or every projection's output whole ('colwise_gather_output', as Phi-3's plan). Load the model "
            f"with tp_plan='auto' or such a plan, or without tensor parallelism ({_TP_HELP}). The model was not "
            "changed."
        )
    mesh = next(p for child in sharded.values() for p in child.parameters() if is_dtensor(p)).device_mesh
    geometry = scorer.geometry
    if mesh.ndim != 1 or geometry.num_heads % mesh.size() or geometry.num_kv_heads % mesh.size():
        raise ValueError(
            f"hf_neural_attn cannot shard the scorer of {where} over {mesh.size()} tensor-parallel processes: its "
            f"{geometry.num_heads} query heads and {geometry.num_kv_heads} key/value heads must each divide evenly "
            f"over a 1-D mesh, and the mesh is {tuple(mesh.shape)}. Use a tensor-parallel size that divides both "
            "head counts. The model was not changed."
        )
    layout = scorer.head_layout()
    names = [name for name, _ in scorer.named_parameters()]
    if layout is None or set(layout) != set(names):
        undeclared = names if layout is None else sorted(set(names) ^ set(layout))
        raise ValueError(
            f"hf_neural_attn cannot shard the {scorer.name!r} scorer of {where} under tensor parallelism: it does not "
            f"declare how its parameters {undeclared} relate to the attention heads (Scorer.head_layout: each one "
            "per head, heads first, or shared by every head), so there is no layout to shard them by. Declare it in "
            f"the scorer, or load the model without tensor parallelism ({_TP_HELP}). The model was not changed."
        )
    return HeadShards(mesh, module_name)


def shard_scorer(
    model: nn.Module, module: nn.Module, scorer: Scorer, shards: HeadShards, projections: dict[str, nn.Module]
) -> None:
    """Shard ``scorer``, just added to ``module`` (whose heads ``shards`` describes), with the heads: its entries
    join the model's ``tp_plan`` and are applied by transformers' ``apply_tensor_parallelism``. ``projections`` are
    the query and key projections QANA's ``key_dim`` put in place of the module's own (by attribute name): sharded
    ``"colwise"`` as the ones they replace were. Rank 0's values are broadcast first, so every process holds slices
    of one init. Collective: every process calls it, as every process calls ``patch_model``."""
    tensor_parallel = _transformers_tensor_parallel()
    _register_styles(tensor_parallel)
    source = torch.distributed.get_global_rank(shards.mesh.get_group(), 0)
    with torch.no_grad():
        for part in (scorer, *projections.values()):
            for tensor in part.parameters():
                torch.distributed.broadcast(tensor.data, src=source, group=shards.mesh.get_group())
    prefix = f"{shards.module_name}.{_child_name(module, scorer)}"
    plan, local, shared = {}, [], []
    layout = scorer.head_layout()
    linear_owners = _per_head_linears(scorer, layout)
    for name, parameter in scorer.named_parameters():
        owner = name.rpartition(".")[0]
        if layout[name] is HeadLayout.SHARED:
            plan[f"{prefix}.{name}"] = SHARED_STYLE
            shared.append(name)
        elif owner in linear_owners:
            plan[f"{prefix}.{name}"] = COLWISE
        else:
            plan[f"{prefix}.{name}"] = COLWISE if parameter.dim() <= 2 else PER_HEAD_STYLE
            local.append(name)
    for owner in linear_owners:
        plan[f"{prefix}.{owner}"] = COLWISE  # the module entry: its forward returns this process's heads' rows
    for attribute, projection in projections.items():
        name = f"{shards.module_name}.{attribute}"
        plan.update({f"{name}.{parameter}": COLWISE for parameter, _ in projection.named_parameters()})
        plan[name] = COLWISE
    tensor_parallel.apply_tensor_parallelism(model, shards.mesh, plan)
    for part in (scorer, *projections.values()):
        for parameter in part.parameters():
            mark_initialized(parameter)  # transformers' init_weights must not redraw them
    setattr(scorer, SHARDS_ATTR, ScorerShards(shards.mesh, tuple(local), tuple(shared)))
    entries = {wildcard(name): style for name, style in plan.items()}
    set_tensor_parallel_plan(model, {**tensor_parallel_plan(model), **entries})


def forget_scorer_plan(model: nn.Module, scorer_attr: str) -> None:
    """Take the scorers' entries (``...<scorer_attr>...``) out of the model's ``tp_plan`` (``unpatch_model``)."""
    plan = tensor_parallel_plan(model)
    if plan:
        set_tensor_parallel_plan(
            model, {name: style for name, style in plan.items() if f".{scorer_attr}." not in f"{name}."}
        )


def _per_head_linears(scorer: Scorer, layout: dict[str, HeadLayout]) -> list[str]:
    """The scorer's submodules that are ``nn.Linear`` with every parameter per head (QANA's ``query_extension``):
    sharded ``"colwise"`` as modules, so their forward returns this process's rows."""
    return [
        name
        for name, child in scorer.named_modules()
        if name
        and isinstance(child, nn.Linear)
        and all(layout[f"{name}.{parameter}"] is HeadLayout.PER_HEAD for parameter, _ in child.named_parameters())
    ]


def _child_name(module: nn.Module, child: nn.Module) -> str:
    return next(name for name, candidate in module.named_children() if candidate is child)


@contextlib.contextmanager
def sharded_parameters_local(scorer: nn.Module) -> Iterator[None]:
    """Within the block, a sharded scorer (:func:`shard_scorer`) reads its per-head parameters as this process's
    local slices, and its shared ones through a step that sums their gradients over the processes; other scorers as
    they are. Both are differentiable: a slice's gradient goes to its shard."""
    shards: ScorerShards | None = getattr(scorer, SHARDS_ATTR, None)
    if shards is None:
        yield
        return
    swapped = []
    group = shards.mesh.get_group()
    for names, view in (
        (shards.local, lambda parameter: parameter.to_local()),
        (shards.shared, functools.partial(_summed_gradient, group=group)),
    ):
        for name in names:
            owner_name, _, attribute = name.rpartition(".")
            owner = scorer.get_submodule(owner_name)
            parameter = owner._parameters[attribute]
            owner._parameters[attribute] = view(parameter)
            swapped.append((owner, attribute, parameter))
    try:
        yield
    finally:
        for owner, attribute, parameter in swapped:
            owner._parameters[attribute] = parameter


def sharded_heads(scorer: nn.Module, local_heads: int) -> tuple[int, int] | None:
    """For a scorer tensor parallelism sharded (:func:`shard_scorer`), the place of this process's ``local_heads``
    heads among all: (its first head, the number of heads); None for any other scorer."""
    shards: ScorerShards | None = getattr(scorer, SHARDS_ATTR, None)
    if shards is None:
        return None
    return shards.mesh.get_local_rank() * local_heads, shards.mesh.size() * local_heads


def _summed_gradient(parameter: torch.Tensor, group) -> torch.Tensor:
    """``parameter`` as it is in the forward, whose gradient is summed over ``group`` in the backward."""
    if is_dtensor(parameter):  # made a replicated DTensor by another wrapper (accelerate with FSDP2 beside TP)
        from torch.distributed.tensor import Partial

        return parameter.to_local(grad_placements=[Partial()])
    if not (torch.is_grad_enabled() and parameter.requires_grad):
        return parameter
    return _SumGradients.apply(parameter, group)


class _SumGradients(torch.autograd.Function):
    """Identity forward; the backward sums the gradient over a process group (each process saw its own heads)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


def whole_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` whole: a sharded one gathered from every process (collective: every process asks), another as it
    is."""
    return tensor.full_tensor() if is_dtensor(tensor) else tensor


@contextlib.contextmanager
def one_writer(tensors) -> Iterator[bool]:
    """Whether this process writes the files of a checkpoint holding ``tensors`` (gathered whole already): every
    process that calls, unless tensor parallelism sharded some of them or DeepSpeed ZeRO-3 partitioned them, when
    process 0 writes (every process runs the same save) and the others wait for it at the end of the block."""
    if not any(is_dtensor(tensor) or is_partitioned(tensor) for tensor in tensors):
        yield True
        return
    try:
        yield torch.distributed.get_rank() == 0
    finally:
        torch.distributed.barrier()


def copy_whole_tensor(parameter: torch.Tensor, whole: torch.Tensor) -> None:
    """Copy ``whole`` (the full tensor, the same on every process, as read from a checkpoint) into ``parameter``, a
    plain parameter or this process's shard of a sharded one."""
    if not is_dtensor(parameter):
        parameter.copy_(whole)
        return
    from torch.distributed.tensor import distribute_tensor

    whole = whole.to(device=parameter.device, dtype=parameter.dtype)
    parameter.copy_(distribute_tensor(whole, parameter.device_mesh, parameter.placements, src_data_rank=None))


def _transformers_tensor_parallel() -> ModuleType:
    """transformers' tensor-parallel API (``ALL_PARALLEL_STYLES``, ``apply_tensor_parallelism``), or a
    ``ValueError`` naming the library where this transformers has none."""
    try:
        from transformers.integrations import tensor_parallel
    except ImportError as error:  # pragma: no cover - transformers without tensor parallelism
        raise ValueError(f"hf_neural_attn shards scorers with transformers' tensor parallelism: {error}") from None
    if not hasattr(tensor_parallel, "apply_tensor_parallelism"):
        raise ValueError(
            "hf_neural_attn shards scorers with transformers' apply_tensor_parallelism, which this transformers does "
            "not have; upgrade transformers (5.24 was tested) or load the model without tensor parallelism."
        )
    return tensor_parallel


def _register_styles(tensor_parallel: ModuleType) -> None:
    """Register :data:`PER_HEAD_STYLE` and :data:`SHARED_STYLE` in transformers' parallel-style registry (once)."""
    styles = tensor_parallel.ALL_PARALLEL_STYLES
    if PER_HEAD_STYLE in styles:
        return
    from torch.distributed.tensor import Shard, distribute_tensor

    class PerHeadParallel(tensor_parallel.TensorParallelLayer):
        """A scorer parameter whose first dimension holds the heads, of any number of dimensions: ``Shard(0)``
        (``"colwise"`` shards the second-to-last dimension, the heads only for one or two)."""

        def shard_param(self, module, param, mesh):
            tensor = module._parameters.get(param)
            if tensor is not None:
                sharded = distribute_tensor(tensor, mesh, [Shard(0)], src_data_rank=None)
                module._parameters[param] = nn.Parameter(sharded, requires_grad=tensor.requires_grad)

    class SharedParallel(tensor_parallel.TensorParallelLayer):
        """A scorer parameter every head shares: whole on every process; hf_neural_attn sums its gradient over the
        processes where the scorer reads it (``integrations.parallelism.sharded_parameters_local``)."""

    styles.register(PER_HEAD_STYLE, PerHeadParallel())
    styles.register(SHARED_STYLE, SharedParallel())


# ---------------------------------------------------------------------------------------------------------------------
# Context parallelism

_CONTEXT_PARALLEL = "torch.distributed.tensor.experimental._context_parallel._attention"
_CP_HELP = 'docs/api.md ("Tensor, context and sequence parallelism")'


@dataclasses.dataclass(frozen=True)
class ContextShards:
    """torch's context parallelism as one call sees it: the ``mesh`` the sequence is split over (this process's
    place in it), and whether the split is torch's load-balanced one (``load_balanced``: the sequence cut into
    ``2 * size`` chunks, process ``r`` holding chunks ``r`` and ``2 * size - 1 - r``) or contiguous."""

    mesh: Any
    load_balanced: bool

    @property
    def size(self) -> int:
        return self.mesh.size()

    @property
    def rank(self) -> int:
        return self.mesh.get_local_rank()


def context_parallel_shards() -> ContextShards | None:
    """torch's ``context_parallel`` as it stands now (the block is open: torch has swapped
    ``scaled_dot_product_attention`` for its ring version), or None.

    Raises:
        RuntimeError: it is open, and its mesh cannot be read (a torch whose layout this does not know): never a
            silent local-only score.
    """
    context_parallel = sys.modules.get(_CONTEXT_PARALLEL)
    if context_parallel is None or F.scaled_dot_product_attention not in getattr(
        context_parallel, "_replaced_functions", {}
    ):
        return None
    function = F.scaled_dot_product_attention
    cells = dict(zip(function.__code__.co_freevars, function.__closure__ or (), strict=True))
    mesh = cells["device_mesh"].cell_contents if "device_mesh" in cells else None
    options = getattr(context_parallel, "_cp_options", None)
    if mesh is None or options is None:
        raise RuntimeError(
            "hf_neural_attn found torch's context parallelism active but cannot read its mesh from this torch "
            f"({torch.__version__}), so it cannot score across the processes; it refuses rather than score each "
            f"process's keys alone. Run without context parallelism ({_CP_HELP})."
        )
    return ContextShards(mesh, bool(options.enable_load_balance))


def check_context_parallel_scorer(scorer: Scorer) -> None:
    """Refuse a scorer whose outputs mix queries (NSEA) under context parallelism: each process holds some of them."""
    if scorer.mixes_queries:
        raise ValueError(
            f"hf_neural_attn cannot run the {scorer.name!r} scorer under context parallelism: each of its outputs "
            "depends on every query, and each process holds a slice of the queries. Run it without context "
            f"parallelism ({_CP_HELP})."
        )


def refuse_packed_under_context_parallelism() -> None:
    """A packed call (``cu_seq_lens_q``: several sequences in one row) under context parallelism: each process holds
    a slice of the row, and the sequences' bounds are the whole row's. Refused."""
    if context_parallel_shards() is not None:
        raise ValueError(
            "hf_neural_attn cannot score a packed call (cu_seq_lens_q / cu_seq_lens_k: several sequences in one row) "
            "under context parallelism: each process holds a slice of the row, which the sequences' bounds do not "
            f"describe. Pass the sequences as a batch, or run packed calls without context parallelism ({_CP_HELP})."
        )


def refuse_unscored_under_context_parallelism(implementation: str, module: nn.Module) -> None:
    """A module the patch does not score runs its base implementation; under context parallelism only SDPA's is
    swapped for torch's ring, so an eager base would attend within each process's slice: refused."""
    if implementation != "sdpa":
        raise ValueError(
            f"hf_neural_attn cannot run {type(module).__name__}, a module it does not score, on the {implementation!r} "
            "base under context parallelism: torch's context parallelism replaces SDPA only, so it would attend "
            "within each process's slice of the sequence. Set the model's base to SDPA "
            f"(model.set_attn_implementation('sdpa')), or patch every layer ({_CP_HELP})."
        )


def attention_across_ranks(
    shards: ContextShards,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    extras: Any,
    *,
    is_causal: bool,
    need_weights: bool,
    attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Any, int], torch.Tensor],
) -> torch.Tensor:
    """This process's queries scored against the keys of every process: the full sequence's attention output for
    them, with gradients to every process's keys and values.

    Args:
        query: (batch, heads, local_len, head_dim), this process's slice of the sequence; key, value: (batch,
            kv_heads, local_len, head_dim), likewise.
        attention_mask: the call's mask, which must say no more than causal (or, for a module that is not causal,
            nothing): torch's context parallelism has no padding or window masks.
        extras: the scorer's per-query inputs for these queries (``query_block`` gives a slice), or None.
        attend: ``attend(query_rows, keys, values, extras_rows, first_position)`` scores a block of queries, whose
            first sits at ``first_position`` of the sequence, against the keys given, causal aligned to the end of
            the keys when the module is causal, and returns (batch, rows, heads, head_dim).

    Returns:
        (batch, local_len, heads, head_dim).

    Raises:
        ValueError: what cannot be made right (named): a padding or window mask, a KV cache, DTensor inputs
            (torch's module-wrapper form of context parallelism), the attention probabilities.
    """
    group = shards.mesh.get_group()
    _check_context_call(query, key, attention_mask, is_causal, need_weights, group)
    keys = _GatherSequence.apply(key, group, shards.size, shards.rank)
    values = _GatherSequence.apply(value, group, shards.size, shards.rank)
    local_len = query.shape[-2]
    if shards.load_balanced:
        # Process r holds chunks r and 2W-1-r: the chunks of the sequence in order, then each of ours with its place.
        chunk = local_len // 2
        size, rank = shards.size, shards.rank
        parts = [
            (keys[c], values[c], 0) if c < size else (keys[2 * size - 1 - c], values[2 * size - 1 - c], chunk)
            for c in range(2 * size)
        ]
        keys = torch.cat([k[..., start : start + chunk, :] for k, _, start in parts], dim=-2)
        values = torch.cat([v[..., start : start + chunk, :] for _, v, start in parts], dim=-2)
        blocks = [(0, chunk, rank * chunk), (chunk, 2 * chunk, (2 * size - 1 - rank) * chunk)]
    else:
        keys, values = torch.cat(keys, dim=-2), torch.cat(values, dim=-2)
        blocks = [(0, local_len, shards.rank * local_len)]
    outputs = []
    for start, end, position in blocks:
        # A causal block sees the keys up to its own last position; a bidirectional one every key.
        seen = position + (end - start) if is_causal else keys.shape[-2]
        block_extras = extras.query_block(start, end) if extras is not None else None
        outputs.append(attend(query[:, :, start:end], keys[:, :, :seen], values[:, :, :seen], block_extras, position))
    return torch.cat(outputs, dim=1)


def _check_context_call(query, key, attention_mask, is_causal: bool, need_weights: bool, group) -> None:
    if is_dtensor(query) or is_dtensor(key):
        raise ValueError(
            "hf_neural_attn got DTensor queries or keys: torch's module-wrapper form of context parallelism, which it "
            "does not support. Use torch's context_parallel context manager (what accelerate's cp_size runs) "
            f"({_CP_HELP})."
        )
    if need_weights:
        raise ValueError(
            "hf_neural_attn does not return attention probabilities under context parallelism (each process holds "
            "a slice of the rows). Ask for them without context parallelism."
        )
    q_len, kv_len = query.shape[-2], key.shape[-2]
    if q_len != kv_len:
        raise ValueError(
            f"hf_neural_attn under context parallelism scores a sequence's own slice ({q_len} queries, {kv_len} keys "
            "here: a KV cache?). Generate without context parallelism."
        )
    # Every process must refuse together: one whose slice has no padding would otherwise wait in the gather below
    # for one that refused. (The other refusals above depend on the call's shapes and flags, the same everywhere.)
    says_more = torch.tensor([0 if _plain_mask(attention_mask, q_len, kv_len, is_causal) else 1])
    torch.distributed.all_reduce(says_more, group=group)
    if says_more.item():
        raise ValueError(
            "hf_neural_attn under context parallelism scores full causal (or, for encoders, full) attention only: "
            "this call's mask says more (padding, a sliding window or packed sequences), which torch's context "
            "parallelism cannot split. Pass no attention_mask (accelerate's cp_size removes it), or run without "
            f"context parallelism ({_CP_HELP})."
        )


def _plain_mask(attention_mask: torch.Tensor | None, q_len: int, kv_len: int, is_causal: bool) -> bool:
    """Whether a slice's mask says no more than causal (or, not causal, nothing): what the scorers can split."""
    if attention_mask is None:
        return True
    if attention_mask.dtype == torch.bool:
        allowed = attention_mask
    else:
        allowed = attention_mask > torch.finfo(attention_mask.dtype).min / 2
    expected = torch.ones(q_len, kv_len, dtype=torch.bool, device=allowed.device)
    return bool((allowed == (expected.tril() if is_causal else expected)).all())


class _GatherSequence(torch.autograd.Function):
    """Every process's slice of a (batch, heads, local_len, dim) tensor, as a tuple in process order; the backward
    sums each slice's gradient over the processes (whose queries read it) and keeps this process's."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group, size: int, rank: int):
        ctx.group, ctx.rank = group, rank
        slices = [torch.empty_like(tensor) for _ in range(size)]
        torch.distributed.all_gather(slices, tensor.contiguous(), group=group)
        return tuple(slices)

    @staticmethod
    def backward(ctx, *grads):
        # autograd hands zeros for a slice no query read (materialised gradients, its default)
        whole = torch.stack(grads).contiguous()
        torch.distributed.all_reduce(whole, group=ctx.group)
        return whole[ctx.rank], None, None, None


# ---------------------------------------------------------------------------------------------------------------------
# Sequence parallelism

_ULYSSES_STATE = "deepspeed.runtime.sequence_parallel.parallel_state_sp"
_SP_REFUSAL = (
    "hf_neural_attn does not support DeepSpeed's Ulysses sequence parallelism (accelerate's sp_size): Ulysses trades "
    "the sequence for the heads around the attention function it wraps, and the scorers' per-query inputs and "
    "per-head parameters are not traded with them. For long sequences use context parallelism instead (torch's "
    "context_parallel, accelerate's cp_size), which hf_neural_attn supports; for memory, tensor parallelism, FSDP2 "
    f"or ZeRO-3 ({_CP_HELP})."
)


def refuse_ulysses(ulysses: ModuleType, *, attn_implementation: str) -> None:
    """Wrap DeepSpeed's ``UlyssesSPAttentionHF.register_with_transformers`` (what accelerate's ``sp_size`` calls) so
    that it refuses a patched model (one whose config runs ``attn_implementation``), or that implementation named as
    the core, with the library's words, before it sets anything up."""
    hub = getattr(ulysses, "UlyssesSPAttentionHF", None)
    if not isinstance(vars(hub).get("register_with_transformers") if hub is not None else None, classmethod):
        return  # another DeepSpeed layout: the check at the first scored call still refuses

    def refusing(original):
        @functools.wraps(original)
        def register_with_transformers(
            cls, model_name_or_path, core_attn_implementation, sequence_parallel_size, *args, **kwargs
        ):
            config = getattr(model_name_or_path, "config", None)
            patched = config is not None and attn_implementation_of(config) == attn_implementation
            if sequence_parallel_size != 1 and (patched or core_attn_implementation == attn_implementation):
                raise ValueError(_SP_REFUSAL)
            return original(cls, model_name_or_path, core_attn_implementation, sequence_parallel_size, *args, **kwargs)

        return register_with_transformers

    wrap_once(hub, "register_with_transformers", refusing)


# Read once per trace under torch.compile: traced, the lookup in sys.modules would guard on its length, and every
# import after the first call (any lazy import in transformers) would compile the model again.
@torch.compiler.assume_constant_result
def _sequence_parallel_size() -> int:
    state = sys.modules.get(_ULYSSES_STATE)
    group = getattr(state, "_SEQUENCE_PARALLEL_GROUP", None)
    return 1 if group is None else torch.distributed.get_world_size(group=group)


def check_no_sequence_parallelism() -> None:
    """Refuse to score while DeepSpeed's sequence-parallel groups are set up (a registration that named the model by
    path, which :func:`refuse_ulysses` cannot tell from an unpatched one): the sequence is split over the processes."""
    if _sequence_parallel_size() > 1:
        raise ValueError(_SP_REFUSAL)
