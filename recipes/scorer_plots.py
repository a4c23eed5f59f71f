"""The pictures a patched run adds: its scorers' gates and norms over training, and one layer's attention maps.

* ``scorer_history.json`` / ``scorer_history.png``: at step 0 and at every logging step,
  :func:`hf_neural_attn.plotting.scorer_statistics` of each patched layer (per-head gates, the norm of the new
  parameters, and how far the attention on a fixed probe input is from the unpatched model's).
* ``attention_maps.png``: after training, the heads of one attention layer (``--attention_map_layer``, default
  the first patched one) on the probe input, for the fine-tuned patched model beside the same weights without
  the patch (dot-product attention), and their difference.

The probe input is the first evaluation example, text cut to its first ``--attention_map_tokens`` tokens.
Everything here is cheap next to training: two forward passes on one short input per logging step.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

SCORER_HISTORY_FILE = "scorer_history.json"
SCORER_PLOT_FILE = "scorer_history.png"
ATTENTION_PLOT_FILE = "attention_maps.png"
MODEL_INPUT_KEYS = ("input_ids", "attention_mask", "token_type_ids", "pixel_values")
# Where parameters are sharded across processes, a forward pass outside the wrapped model is not possible on one
# process alone: the pictures are skipped there.
SHARDED = ("FSDP", "DEEPSPEED", "MEGATRON_LM")


def supported(accelerator) -> bool:
    kind = str(getattr(accelerator.distributed_type, "value", accelerator.distributed_type)).upper()
    return not any(name in kind for name in SHARDED)


def probe_inputs(data, task, args) -> tuple[dict[str, torch.Tensor], str]:
    """Model inputs of the first evaluation example (text cut to ``--attention_map_tokens``) and a description."""
    name, dataset = next(iter(data.eval_datasets.items()))
    batch = data.eval_collate([dataset[0]])
    inputs = {key: batch[key] for key in MODEL_INPUT_KEYS if isinstance(batch.get(key), torch.Tensor)}
    if "input_ids" in inputs:
        limit = args.attention_map_tokens
        length = inputs["input_ids"].shape[1]
        for key in ("input_ids", "attention_mask", "token_type_ids"):
            if key in inputs:
                inputs[key] = inputs[key][:, :limit]
        described = f"the first {min(limit, length)} tokens of the first `{name}` example"
    else:
        described = f"the first `{name}` example"
    return inputs, described


def record(progress, model, probe) -> None:
    """Append this step's scorer statistics to the run's history (every process computes the same)."""
    from hf_neural_attn.plotting import scorer_statistics

    progress.scorer_history.append({"step": progress.completed_steps, "layers": scorer_statistics(model, probe)})


def draw(model, history, probe, described, output: Path, args, tokenizer, title: str) -> dict[str, Any]:
    """Write the scorer history (JSON and PNG) and the attention maps; return what the model card shows."""
    from hf_neural_attn import plotting

    from .report import write_json

    plots: dict[str, Any] = {}
    if history:
        write_json(output / SCORER_HISTORY_FILE, {"history": history})
        plotting.plot_scorer_history(history, output / SCORER_PLOT_FILE, title=title)
        plots["scorer_history"] = SCORER_PLOT_FILE
    if args.attention_map_layer != "none" and probe is not None:
        layer = None if args.attention_map_layer is None else int(args.attention_map_layer)
        try:
            maps = plotting.plot_attention_maps(
                model, probe, output / ATTENTION_PLOT_FILE, layer=layer, tokenizer=tokenizer, title=title
            )
        except ValueError as error:  # e.g. a layer index out of range: the run itself is fine
            logger.warning("No attention maps drawn: %s", error)
        else:
            plots.update(
                attention_maps=ATTENTION_PLOT_FILE,
                attention_layer=maps.layer,
                attention_input=described,
                attention_change=maps.total_variation(),
            )
    return plots
