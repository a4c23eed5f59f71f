"""Pictures of what the patch does: attention maps beside the unpatched model's, and the scorers over training.

    from hf_neural_attn import plotting

    maps = plotting.plot_attention_maps(model, inputs, "maps.png", tokenizer=tokenizer)  # one layer's heads
    tracker = plotting.ScorerTracker(probe=inputs)
    tracker.record(model, step)                      # in the training loop, at each logging step
    tracker.plot("scorer_history.png")               # gates and norms of each patched layer over steps

*Unpatched* always means the same model with the same weights, its attention scored by the plain dot
product: what :func:`hf_neural_attn.unpatch_model` would leave, run with transformers' eager attention. For a
function-preserving patch (the default init) the two are equal at init; after training, the difference is what
the new scorers learned. It is computed on a shallow copy of the model that shares the parameter tensors
(:func:`unpatched_view`), so nothing is copied and the caller's model is not touched.

matplotlib is imported inside the drawing functions only (with the non-interactive Agg backend), so
``import hf_neural_attn`` stays light.
"""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from . import narrow_keys
from .families import find_attention
from .patching import unpatch_model
from .record import SCORER_ATTR, is_patched, patch_record
from .scorers import Scorer

# Layout of the attention-map figure, in inches at ``dpi``: the image is
# (panel_size * heads + MAP_EXTRA_WIDTH) x (panel_size * rows + MAP_EXTRA_HEIGHT) inches.
MAP_EXTRA_WIDTH = 1.2  # row labels and colour bars
MAP_EXTRA_HEIGHT = 1.0  # title and tick labels
# Positions are labelled with their tokens up to this many; beyond, every k-th one.
MAX_TICK_LABELS = 40
# The token labels' font: at least MIN_LABEL_POINTS points and MIN_LABEL_PIXELS pixels high in the saved image, up to
# MAX_LABEL_POINTS where a panel has room; every k-th position is labelled, with LABEL_SPACING label heights between.
MIN_LABEL_POINTS = 7.0
MIN_LABEL_PIXELS = 10.0
MAX_LABEL_POINTS = 9.0
LABEL_SPACING = 1.3

__all__ = [
    "AttentionMaps",
    "ScorerTracker",
    "attention_maps",
    "plot_attention_maps",
    "plot_scorer_history",
    "scorer_statistics",
    "unpatched_view",
]


# ------------------------------------------------------------------------------------------ unpatched


def unpatched_view(model: nn.Module) -> nn.Module:
    """The model without its patch, sharing ``model``'s parameter and buffer tensors, with eager attention.

    A copy of the module tree whose parameters *are* the model's (no memory is copied; do not train it), from
    which the patch is removed with :func:`hf_neural_attn.unpatch_model`. Its outputs are exactly those of
    the base model with the same weights; ``model`` itself (parameters, patch, config, hooks) is unchanged.
    Works for unpatched models too (a plain eager copy).
    """
    shared: dict[int, Any] = {id(t): t for t in model.parameters()}
    shared.update({id(t): t for t in model.buffers()})
    view = copy.deepcopy(model, memo=shared)
    for module in view.modules():
        # A forward set on the instance (Accelerate's mixed-precision wrapper, say) may close over the original
        # module: the copy would silently run the patched model. Fall back to the class's own forward.
        module.__dict__.pop("forward", None)
    if is_patched(view) and narrow_keys.width_of(view) is not None:
        # The patch replaced the query and key projections by narrower ones, so there is no original model.
        # The plain dot product of the same (narrower) queries and keys is what each scorer answers for as its
        # dot-product-only view (Scorer.dot_product_view). The scorers return probabilities on every path, as eager
        # would.
        for module in list(view.modules()):
            scorer = getattr(module, SCORER_ATTR, None)
            if isinstance(scorer, Scorer):
                setattr(module, SCORER_ATTR, scorer.dot_product_view())
        return view.eval()
    if is_patched(view):
        unpatch_model(view)
    # Attention probabilities come only from the eager path (SDPA and flash return none).
    if hasattr(view, "set_attn_implementation"):
        view.set_attn_implementation("eager")
    return view.eval()


# ----------------------------------------------------------------------------------------- maps, data


@dataclass
class AttentionMaps:
    """What :func:`attention_maps` computed and :func:`plot_attention_maps` drew.

    Attributes:
        layer: index of the attention layer (as in ``patch_model(layers=...)``).
        patched: (heads, q_len, kv_len) attention probabilities of the model as given.
        unpatched: the same for the unpatched model (same weights, dot-product attention).
        tokens: a label per position (tokens when a tokenizer was given), or None.
        heads: the head indices drawn (columns of the figure).
        path: where the PNG was written (None until drawn).
        size_px: (width, height) of the PNG in pixels.
    """

    layer: int
    patched: np.ndarray
    unpatched: np.ndarray
    tokens: list[str] | None = None
    heads: list[int] = field(default_factory=list)
    path: Path | None = None
    size_px: tuple[int, int] | None = None

    @property
    def difference(self) -> np.ndarray:
        """patched - unpatched, (heads, q_len, kv_len)."""
        return self.patched - self.unpatched

    def total_variation(self) -> float:
        """Mean over heads and queries of the total-variation distance between the two maps' rows (0..1)."""
        return float(0.5 * np.abs(self.difference).sum(-1).mean())


def _model_inputs(inputs: Mapping[str, Any], example: int) -> dict[str, Any]:
    """One example of a batch of model inputs, as a batch of one."""
    chosen = {}
    for key, value in inputs.items():
        if isinstance(value, torch.Tensor) and value.dim() >= 1:
            if not 0 <= example < value.shape[0]:
                raise ValueError(f"example={example} is out of range for a batch of {value.shape[0]} ({key}).")
            value = value[example : example + 1]
        chosen[key] = value
    return chosen


def _attentions(model: nn.Module, inputs: dict[str, Any]) -> tuple[torch.Tensor, ...]:
    """Every layer's attention probabilities, (1, heads, q_len, kv_len) each, in eval mode, without grad."""
    modes = {module: module.training for module in model.modules()}
    device = next(model.parameters()).device
    inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    try:
        model.eval()
        with torch.no_grad():
            outputs = model(**inputs, output_attentions=True)
    finally:
        for module, mode in modes.items():
            module.training = mode
    attentions = getattr(outputs, "attentions", None)
    if not attentions:
        raise RuntimeError(
            f"{type(model).__name__} returned no attentions for output_attentions=True; the maps need its "
            "attention probabilities (eager attention or a patched layer)."
        )
    return attentions


def _valid_positions(inputs: dict[str, Any]) -> np.ndarray | None:
    mask = inputs.get("attention_mask")
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        return None
    return mask[0].bool().cpu().numpy()


def _layer_index(model: nn.Module, layer: int | None, num_layers: int) -> int:
    if layer is None:
        record = patch_record(model)
        if record is None:
            raise ValueError("This model is not patched: pass layer= to choose the attention layer to draw.")
        return record.layers[0]
    if isinstance(layer, bool) or not isinstance(layer, int) or not -num_layers <= layer < num_layers:
        raise ValueError(f"layer must be an attention layer index in 0..{num_layers - 1} (or negative), got {layer!r}.")
    return layer % num_layers


def _token_labels(tokenizer, inputs: dict[str, Any], keep: np.ndarray | None) -> list[str] | None:
    ids = inputs.get("input_ids")
    if tokenizer is None or not isinstance(ids, torch.Tensor):
        return None
    ids = ids[0].tolist()
    if keep is not None:
        ids = [i for i, k in zip(ids, keep) if k]
    labels = []
    for token_id in ids:
        text = tokenizer.decode([token_id])
        if not text.strip() and text:  # whitespace tokens stay visible
            text = text.replace(" ", "␣").replace("\n", "\\n").replace("\t", "\\t")
        labels.append(text.strip() if text.strip() else (text or repr(token_id)))
    return labels


def attention_maps(
    model: nn.Module,
    inputs: Mapping[str, Any],
    *,
    layer: int | None = None,
    example: int = 0,
    heads: Sequence[int] | None = None,
    tokenizer=None,
) -> AttentionMaps:
    """The attention maps of one layer's heads, for ``model`` and for the unpatched model, on one input.

    Args:
        model: a transformers model, patched (or not, then ``layer`` is required).
        inputs: model inputs as for ``model(**inputs)``: ``input_ids`` (+ ``attention_mask``), ``pixel_values``...
        layer: attention layer index (as in ``patch_model(layers=...)``); default the first patched layer.
        example: which example of the batch.
        heads: which heads (default all).
        tokenizer: labels positions with their tokens (``tokenizer.decode`` of each id).

    Positions the ``attention_mask`` marks as padding are left out (queries and keys). Nothing about
    ``model`` changes; see :func:`unpatched_view` for what "unpatched" is.
    """
    if example < 0:
        raise ValueError(f"example must be a batch index >= 0, got {example}.")
    inputs = _model_inputs(inputs, example)
    _, modules, _ = find_attention(model)
    index = _layer_index(model, layer, len(modules))
    unpatched = unpatched_view(model)
    # A patched model returns its probabilities (through its scorers, and through eager attention in the
    # layers it leaves alone); an unpatched one may run SDPA, which returns none: it is its own eager view.
    patched_all = _attentions(model if is_patched(model) else unpatched, inputs)
    if len(patched_all) != len(modules):
        raise RuntimeError(f"The model returned {len(patched_all)} attention maps for {len(modules)} attention layers.")
    unpatched_all = _attentions(unpatched, inputs)
    num_heads = patched_all[index].shape[1]
    heads = list(range(num_heads)) if heads is None else [int(h) for h in heads]
    if not heads or any(not 0 <= h < num_heads for h in heads):
        raise ValueError(f"heads must be indices in 0..{num_heads - 1}, got {heads}.")
    keep = _valid_positions(inputs)

    def select(maps: torch.Tensor) -> np.ndarray:
        array = maps[0, heads].detach().float().cpu().numpy()
        if keep is not None:  # drop padding: queries, and keys when they are the same positions
            array = array[:, keep] if array.shape[1] == keep.size else array
            array = array[:, :, keep] if array.shape[2] == keep.size else array
        return array

    return AttentionMaps(
        layer=index,
        patched=select(patched_all[index]),
        unpatched=select(unpatched_all[index]),
        tokens=_token_labels(tokenizer, inputs, keep),
        heads=heads,
    )


# --------------------------------------------------------------------------------------- maps, figure


def _pyplot():
    try:
        import matplotlib
    except ImportError as error:
        raise ImportError(
            "hf_neural_attn.plotting draws with matplotlib: pip install 'hf-neural-attn[plots]'"
        ) from error

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _label_points(dpi: int, panel_size: float, count: int) -> float:
    """The font size of the token labels: at least MIN_LABEL_POINTS and MIN_LABEL_PIXELS at ``dpi``, larger (up to
    MAX_LABEL_POINTS) where a panel of ``panel_size`` inches has room to label each of ``count`` positions."""
    smallest = max(MIN_LABEL_POINTS, MIN_LABEL_PIXELS * 72 / dpi)
    fitting = 0.8 * panel_size * 72 / (max(count, 1) * LABEL_SPACING)
    return min(max(smallest, fitting), max(smallest, MAX_LABEL_POINTS))


def _label_axes(
    axis, labels: list[str] | None, counts: tuple[int, int], shown: tuple[bool, bool], points: float
) -> None:
    """Tick labels of one map: keys along x (``counts[0]``; shown on the last row), queries along y (shown on the first
    column), every k-th position, k such that labels of ``points`` keep LABEL_SPACING label heights apart along the
    axis's drawn length."""
    box = axis.get_window_extent()
    for count, length, set_ticks, set_labels, show in (
        (counts[0], box.width, axis.set_xticks, axis.set_xticklabels, shown[0]),
        (counts[1], box.height, axis.set_yticks, axis.set_yticklabels, shown[1]),
    ):
        label_pixels = points * axis.figure.dpi / 72 * LABEL_SPACING
        step = max(1, math.ceil(count / MAX_TICK_LABELS), math.ceil(count * label_pixels / max(length, 1.0)))
        positions = list(range(0, count, step))
        set_ticks(positions)
        if not show:
            set_labels([])
        elif labels is not None and len(labels) >= count:
            names = labels[-count:] if count < len(labels) else labels  # keys may outnumber queries (cache)
            set_labels(
                [names[p] for p in positions], fontsize=points, rotation=90 if set_ticks == axis.set_xticks else 0
            )
        else:
            set_labels([str(p) for p in positions], fontsize=points)


def plot_attention_maps(
    model: nn.Module,
    inputs: Mapping[str, Any],
    path: str | os.PathLike,
    *,
    layer: int | None = None,
    example: int = 0,
    heads: Sequence[int] | None = None,
    tokenizer=None,
    difference: bool = True,
    title: str | None = None,
    panel_size: float = 2.4,
    dpi: int = 100,
) -> AttentionMaps:
    """Draw one layer's attention maps, patched beside unpatched, to a PNG; return the maps and the path.

    A grid with a column per head and the rows ``patched``, ``unpatched`` and (``difference=True``)
    ``patched - unpatched``: rows are queries, columns keys, on one colour scale for the two maps and a
    diverging one centred at 0 for the difference. The image is
    ``dpi * (panel_size * len(heads) + 1.2)`` by ``dpi * (panel_size * rows + 1.0)`` pixels. The axes are labelled
    with the tokens (or positions) at least MIN_LABEL_POINTS and MIN_LABEL_PIXELS high at ``dpi``, every k-th
    position where not all fit.

    "Unpatched" is the base model with the same weights, its attention scored by the plain dot product (for a
    function-preserving patch at init, the model before patching); see :func:`unpatched_view`. The model is
    left as it was. Arguments as for :func:`attention_maps`.
    """
    maps = attention_maps(model, inputs, layer=layer, example=example, heads=heads, tokenizer=tokenizer)
    plt = _pyplot()
    rows = [("patched", maps.patched), ("unpatched", maps.unpatched)]
    if difference:
        rows.append(("patched − unpatched", maps.difference))
    columns = len(maps.heads)
    figsize = (panel_size * columns + MAP_EXTRA_WIDTH, panel_size * len(rows) + MAP_EXTRA_HEIGHT)
    # Constrained layout fits the panels around their labels, colour bars and title, whatever the tokens' length.
    figure, axes = plt.subplots(len(rows), columns, figsize=figsize, dpi=dpi, squeeze=False, layout="constrained")
    figure.get_layout_engine().set(w_pad=0.03, h_pad=0.03, wspace=0.02, hspace=0.02)
    heading = f"layer {maps.layer}: attention (rows: queries, columns: keys)"
    record = patch_record(model)
    if record is not None:
        heading = f"layer {maps.layer}, {record.scorer} patch vs unpatched (same weights, dot-product attention)"
    heading = heading if title is None else f"{title}\n{heading}"
    top = float(max(maps.patched.max(), maps.unpatched.max(), 1e-12))
    spread = float(max(np.abs(maps.difference).max(), 1e-12))
    n_query, n_key = maps.patched.shape[1:]
    points = _label_points(dpi, panel_size, max(n_query, n_key))
    for row, (name, values) in enumerate(rows):
        is_difference = row == 2
        scale = (
            {"cmap": "RdBu_r", "vmin": -spread, "vmax": spread}
            if is_difference
            else {"cmap": "viridis", "vmin": 0.0, "vmax": top}
        )
        for column, head in enumerate(maps.heads):
            axis = axes[row, column]
            image = axis.imshow(values[column], interpolation="nearest", aspect="auto", **scale)
            if row == 0:
                axis.set_title(f"head {head}", fontsize=9)
            if column == 0:
                axis.set_ylabel(name, fontsize=9)
        colorbar = figure.colorbar(image, ax=list(axes[row]), fraction=0.02, pad=0.01)
        colorbar.ax.tick_params(labelsize=points)
    figure.suptitle(heading, fontsize=9)
    # Labelled once for the layout, then again along the panels' laid-out lengths (how many labels fit there).
    for laid_out in (False, True):
        if laid_out:
            figure.draw_without_rendering()
        for (row, column), axis in np.ndenumerate(axes):
            shown = (row == len(rows) - 1, column == 0)
            _label_axes(axis, maps.tokens, (n_key, n_query), shown, points)
    path = Path(path)
    figure.savefig(path, dpi=dpi)
    plt.close(figure)
    maps.path = path
    maps.size_px = (round(figsize[0] * dpi), round(figsize[1] * dpi))
    return maps


# ---------------------------------------------------------------------------------- scorer statistics


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """A plain tensor of a parameter (gathers a sharded DTensor)."""
    tensor = tensor.detach()
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def scorer_statistics(model: nn.Module, probe: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
    """Per patched layer, the numbers that show whether and how much its new path is in use.

    Returns a list, one JSON-ready dict per patched layer, in layer order:

    * ``layer``: attention layer index; ``scorer``: the scorer's name.
    * ``gate``: the per-head gate (alpha) values, or None for a scorer without a gate (``mode="replace"``);
      ``gate_mean`` and ``gate_abs_mean``: their mean and mean absolute value.
    * ``param_norm``: the L2 norm of the layer's new parameters other than the gate.
    * ``attention_change`` (only with ``probe``, model inputs as for ``model(**probe)``): the total-variation
      distance between the patched and the unpatched model's attention rows (0 = the same maps, 1 = disjoint),
      averaged over heads, queries and examples. It measures the whole model up to that layer: from the
      second patched layer on, earlier layers' changes to the hidden states count too. It is 0 for a
      function-preserving patch at init.

    Costs nothing without ``probe``; with it, two forward passes on the probe.
    """
    _, modules, _ = find_attention(model)
    records = []
    for index, module in enumerate(modules):
        scorer = getattr(module, SCORER_ATTR, None)
        if scorer is None:
            continue
        gate = getattr(scorer, "gate", None)
        gate_values = _full(gate).float().cpu() if isinstance(gate, torch.Tensor) else None
        squares = sum(
            float(_full(p).float().pow(2).sum())
            for name, p in scorer.named_parameters()
            if name.split(".")[-1] != "gate"
        )
        records.append(
            {
                "layer": index,
                "scorer": getattr(scorer, "name", type(scorer).__name__),
                "gate": None if gate_values is None else gate_values.tolist(),
                "gate_mean": None if gate_values is None else float(gate_values.mean()),
                "gate_abs_mean": None if gate_values is None else float(gate_values.abs().mean()),
                "param_norm": math.sqrt(squares),
            }
        )
    if probe is not None and records:
        probe = dict(probe)
        patched, unpatched = _attentions(model, probe), _attentions(unpatched_view(model), probe)
        valid = probe.get("attention_mask")
        for record in records:
            p, u = patched[record["layer"]].float(), unpatched[record["layer"]].float()
            distance = 0.5 * (p - u).abs().sum(-1)  # (batch, heads, q_len)
            if isinstance(valid, torch.Tensor) and valid.dim() == 2 and valid.shape[-1] == distance.shape[-1]:
                weights = valid.to(distance.device, distance.dtype)[:, None, :].expand_as(distance)
                change = (distance * weights).sum() / weights.sum().clamp(min=1)
            else:
                change = distance.mean()
            record["attention_change"] = float(change)
    return records


class ScorerTracker:
    """Records :func:`scorer_statistics` over training and draws them.

    tracker = ScorerTracker(probe=first_eval_batch)   # probe optional: adds attention_change
    for step in ...:
        ...
        tracker.record(model, step)
    tracker.plot("scorer_history.png")
    json.dump(tracker.history, ...)                    # [{"step": s, "layers": [...]}, ...]
    """

    def __init__(self, probe: Mapping[str, Any] | None = None, history: list[dict[str, Any]] | None = None):
        self.probe = probe
        self.history: list[dict[str, Any]] = list(history or [])

    def record(self, model: nn.Module, step: int) -> dict[str, Any]:
        entry = {"step": int(step), "layers": scorer_statistics(model, self.probe)}
        self.history.append(entry)
        return entry

    def plot(self, path: str | os.PathLike, title: str | None = None) -> Path:
        return plot_scorer_history(self.history, path, title=title)


def plot_scorer_history(
    history: Sequence[Mapping[str, Any]], path: str | os.PathLike, *, title: str | None = None, dpi: int = 100
) -> Path:
    """Draw per-layer gates and norms over training steps to a PNG; return its path.

    ``history``: records ``{"step": int, "layers": scorer_statistics(...)}`` (what :class:`ScorerTracker`
    keeps). Panels: the mean gate of each layer with the range of its heads shaded; the norm of the new
    parameters; and, when recorded, the attention change against the unpatched model. One line per layer.
    The image is ``dpi * (4.2 * panels)`` by ``dpi * 3.6`` pixels.
    """
    if not history:
        raise ValueError("The history is empty: record at least one step (ScorerTracker.record) before plotting.")
    steps = [int(entry["step"]) for entry in history]
    layers = sorted({record["layer"] for entry in history for record in entry["layers"]})
    if not layers:
        raise ValueError("The history holds no patched layer.")

    def series(key: str, layer: int, pick=lambda value: value) -> tuple[list[int], list[float]]:
        xs, ys = [], []
        for step, entry in zip(steps, history):
            for record in entry["layers"]:
                if record["layer"] == layer and record.get(key) is not None:
                    xs.append(step)
                    ys.append(pick(record[key]))
        return xs, ys

    has_gate = any(series("gate", layer)[0] for layer in layers)
    has_change = any(series("attention_change", layer)[0] for layer in layers)
    panels = ["param_norm"] + (["gate"] if has_gate else []) + (["attention_change"] if has_change else [])
    panels.sort(key=["gate", "param_norm", "attention_change"].index)
    plt = _pyplot()
    figure, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), dpi=dpi, squeeze=False)
    colours = plt.get_cmap("viridis")(np.linspace(0.0, 0.85, len(layers)))
    for axis, panel in zip(axes[0], panels):
        for colour, layer in zip(colours, layers):
            label = f"layer {layer}"
            if panel == "gate":
                xs, gates = series("gate", layer)
                gates = np.array(gates, dtype=float)
                axis.plot(xs, gates.mean(1), color=colour, label=label, linewidth=1.3)
                axis.fill_between(xs, gates.min(1), gates.max(1), color=colour, alpha=0.2, linewidth=0)
            else:
                axis.plot(
                    *series(panel, layer),
                    color=colour,
                    label=label,
                    linewidth=1.3,
                    marker="." if len(steps) < 30 else None,
                )
        axis.set(
            xlabel="step",
            title={
                "gate": "gate α (mean; band: min–max over heads)",
                "param_norm": "norm of the new parameters (excl. gate)",
                "attention_change": "attention change vs unpatched (TV distance)",
            }[panel],
        )
        axis.title.set_fontsize(9)
        axis.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    if title:
        figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    path = Path(path)
    figure.savefig(path, dpi=dpi)
    plt.close(figure)
    return path
