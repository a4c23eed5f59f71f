"""Tensor parallelism: a patched model's scorers sharded with the attention heads, through transformers' own
plan and parallel styles.

Tensor parallelism (transformers' ``tp_plan`` / ``DistributedConfig``, accelerate's ``ParallelismConfig(tp_size)``):
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

The two styles of the library (:func:`parallel_styles`) are registered in transformers' registry by a row of
``integrations.installer.INTEGRATIONS`` (``"tensor-parallel styles"``) once transformers' tensor-parallel module is
imported; nothing here changes transformers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import torch
from torch import nn

from ..compat.internals import (
    mark_initialized,
    parameter_slots,
    set_tensor_parallel_plan,
    sharded_by_tensor_parallelism,
    tensor_parallel_plan,
)
from ..compat.tensors import is_dtensor
from ..placement.base import Placement
from ..placement.zero3 import is_partitioned
from ..scorers import HeadLayout, Scorer

# The parallel styles the library registers in transformers' registry (ALL_PARALLEL_STYLES), by name.
PER_HEAD_STYLE = "hf_neural_attn_per_head"
SHARED_STYLE = "hf_neural_attn_shared"
# transformers' styles the scorers' entries use, and what the attention modules' entries may be.
COLWISE = "colwise"
HEAD_SHARDING_STYLES = frozenset({COLWISE, "rowwise"})  # q/k/v colwise and o rowwise: each process its heads
WHOLE_HEAD_STYLES = frozenset({"colwise_gather_output", "colwise_rep", "rowwise_split_input", "rowwise_rep"})
SHARDS_ATTR = "_hf_neural_attn_shards"  # on a sharded scorer: its ScorerShards
_TP_HELP = 'docs/api.md ("Tensor, context and sequence parallelism")'


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
        if sharded_by_tensor_parallelism(child) and any(is_dtensor(parameter) for parameter in child.parameters())
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
            slots = parameter_slots(owner)
            parameter = slots[attribute]
            slots[attribute] = view(parameter)
            swapped.append((owner, attribute, parameter))
    try:
        yield
    finally:
        for owner, attribute, parameter in swapped:
            parameter_slots(owner)[attribute] = parameter


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
    if not {PER_HEAD_STYLE, SHARED_STYLE} <= set(tensor_parallel.ALL_PARALLEL_STYLES):
        raise ValueError(
            "hf_neural_attn's parallel styles are not in transformers' ALL_PARALLEL_STYLES: the integrations register "
            "them when transformers.integrations.tensor_parallel is imported (the 'tensor-parallel styles' row of "
            "hf_neural_attn.integrations.INTEGRATIONS, kept under HF_NEURAL_ATTN_NO_INTEGRATIONS). Something took "
            "them out of the registry; import hf_neural_attn before transformers' tensor parallelism runs."
        )
    return tensor_parallel


def parallel_styles(tensor_parallel: ModuleType) -> dict[str, Any]:
    """The library's parallel styles by name, made on transformers' ``TensorParallelLayer`` of ``tensor_parallel``
    (``transformers.integrations.tensor_parallel``): :data:`PER_HEAD_STYLE` and :data:`SHARED_STYLE`. The
    integrations register them in ``ALL_PARALLEL_STYLES`` when that module is imported."""

    class PerHeadParallel(tensor_parallel.TensorParallelLayer):
        """A scorer parameter whose first dimension holds the heads, of any number of dimensions: ``Shard(0)``
        (``"colwise"`` shards the second-to-last dimension, the heads only for one or two)."""

        def shard_param(self, module, param, mesh):
            from torch.distributed.tensor import Shard, distribute_tensor

            slots = parameter_slots(module)
            tensor = slots.get(param)
            if tensor is not None:
                sharded = distribute_tensor(tensor, mesh, [Shard(0)], src_data_rank=None)
                slots[param] = nn.Parameter(sharded, requires_grad=tensor.requires_grad)

    class SharedParallel(tensor_parallel.TensorParallelLayer):
        """A scorer parameter every head shares: whole on every process; hf_neural_attn sums its gradient over the
        processes where the scorer reads it (``parallel.tensor.sharded_parameters_local``)."""

    return {PER_HEAD_STYLE: PerHeadParallel(), SHARED_STYLE: SharedParallel()}


class TensorParallelSharding(Placement):
    """transformers' tensor parallelism: the scorer shards with its module's heads (or the patch is refused when it
    cannot), reads its shards as local tensors while it runs, and leaves the plan with the patch."""

    name = "tensor parallelism"

    def plan_layer(self, model, module, scorer, new_modules):
        return tensor_parallel_heads(model, module, scorer)

    def apply_layer(self, model, module, scorer, added, planned):
        if planned is not None:
            shard_scorer(model, module, scorer, planned, added)

    def scorer_in_place(self, scorer):
        return sharded_parameters_local(scorer)

    def heads_held(self, scorer, local_heads):
        return sharded_heads(scorer, local_heads)

    def remove_layer(self, model, module, scorer):
        forget_scorer_plan(model, _child_name(module, scorer))


PLACEMENT = TensorParallelSharding()
