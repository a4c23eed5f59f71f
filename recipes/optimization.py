"""The optimizer and the scorers' gate policy of a fine-tuning run.

* :func:`build_optimizer`: AdamW over the trainable parameters, grouped by whether they decay and whether they are
  the scorers' (``--scorer_learning_rate``);
* :class:`GateSchedule` and :func:`gate_schedule`: ``--gate_schedule fixed`` / ``warmup`` holding the scorers'
  per-head gates alpha (``learned``, the default, holds nothing).
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from recipes import report
from recipes.errors import RecipeError
from recipes.patch_flags import describe_gated_scorers


def build_optimizer(model, args: argparse.Namespace):
    """AdamW; no weight decay on biases, norms and gates (1-d parameters); the new parameters may get their own LR."""
    import hf_neural_attn

    scorer_names = set(hf_neural_attn.scorer_parameters(model))
    groups: dict[tuple[bool, bool], list] = {}
    for name, parameter in model.named_parameters():
        if parameter.requires_grad:
            # The whole tensor's rank: under DeepSpeed ZeRO-3 every parameter's own is its 1-d empty placeholder's.
            matrix = len(hf_neural_attn.full_shape(parameter)) >= 2
            groups.setdefault((name in scorer_names, matrix), []).append(parameter)
    param_groups = []
    for (is_scorer, decay), parameters in sorted(groups.items()):
        group = {"params": parameters, "weight_decay": args.weight_decay if decay else 0.0}
        if is_scorer and args.scorer_learning_rate is not None:
            group["lr"] = args.scorer_learning_rate
        param_groups.append(group)
    if not param_groups:
        raise RecipeError("The model has no trainable parameters.")
    return torch.optim.AdamW(param_groups, lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2))


class GateSchedule:
    """Holds the scorers' per-head gates alpha where ``--gate_schedule`` says so (fixed, or warmup).

    * fixed: every gate keeps its initial value for the whole run;
    * warmup: alpha = min(1, step / N) while ``step`` (completed optimizer steps) < N, so alpha is 0 for the first
      step; at step N it is set to 1 and from then on trained like any parameter, its Adam state cleared so that
      the optimizer starts fresh for it.

    The gates stay trainable (``requires_grad`` is never toggled: DDP only synchronises the parameters that required
    a gradient when it wrapped the model, and FSDP flattens by that flag). While a gate is held, its gradient is
    dropped (``.grad = None``) before clipping and ``optimizer.step()``: AdamW skips a parameter without a gradient,
    weight decay included, and clipping does not count it. The held value is written under ``torch.no_grad()``
    before every forward pass and after every optimizer step (so logs and checkpoints show it), and it depends only
    on the number of completed steps: a resumed run holds exactly what an uninterrupted one would.
    """

    def __init__(self, schedule: str, warmup_steps: int | None, gates: dict[str, Any], optimizer) -> None:
        self.schedule = schedule
        self.warmup_steps = warmup_steps
        self.gates = gates
        self.optimizer = optimizer
        with torch.no_grad():
            self.initial = {name: gate.detach().clone() for name, gate in gates.items()}

    def held(self, step: int) -> bool:
        """Whether the gates are held (not learned) for the optimizer step that follows ``step`` completed ones."""
        return self.schedule == "fixed" or (self.schedule == "warmup" and step < self.warmup_steps)

    @torch.no_grad()
    def hold(self, step: int) -> None:
        """Write the value the schedule prescribes after ``step`` completed optimizer steps, if any."""
        if self.schedule == "fixed":
            for name, gate in self.gates.items():
                gate.copy_(self.initial[name])
        elif self.schedule == "warmup" and step <= self.warmup_steps:
            for gate in self.gates.values():
                gate.fill_(min(1.0, step / self.warmup_steps))
            if step == self.warmup_steps:  # the end of the warmup: learned from 1.0 on, with fresh Adam moments
                optimizer = getattr(self.optimizer, "optimizer", self.optimizer)  # Accelerate's wrapper
                for gate in self.gates.values():
                    optimizer.state.pop(gate, None)

    def drop_gradients(self, step: int) -> None:
        """Before clipping and the optimizer step: no update for a held gate."""
        if self.held(step):
            for gate in self.gates.values():
                gate.grad = None

    def describe(self) -> str:
        return report.describe_gate_schedule(self.schedule, self.warmup_steps)


def gate_schedule(args: argparse.Namespace, accelerator, model, optimizer) -> GateSchedule | None:
    """The run's GateSchedule, or None for --gate_schedule learned; refuses a patch without gates."""
    import hf_neural_attn

    if args.gate_schedule in (None, "learned"):
        return None
    if str(getattr(accelerator.distributed_type, "value", accelerator.distributed_type)).upper() == "DEEPSPEED":
        raise RecipeError(
            f"--gate_schedule {args.gate_schedule} is not supported under DeepSpeed, whose optimizer keeps its own "
            "copies of the weights and gradients; use DDP or FSDP, or --gate_schedule learned."
        )
    gates = {
        name: parameter
        for name, parameter in hf_neural_attn.scorer_parameters(accelerator.unwrap_model(model)).items()
        if name.endswith(".gate")
    }
    if not gates:
        raise RecipeError(
            f"--gate_schedule {args.gate_schedule} holds the scorers' gates alpha, but this patch has none (only "
            f"{describe_gated_scorers()}, have gates; under FSDP1 the parameters must keep their names: "
            "use_orig_params). Drop --gate_schedule or use a gated scorer."
        )
    return GateSchedule(args.gate_schedule, args.gate_warmup_steps, gates, optimizer)
