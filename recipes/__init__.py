"""Fine-tuning recipes for hf_neural_attn, a one-way layer over the library, run as modules from the repository
root (``pip install -e ".[recipes]"`` first): ``accelerate launch -m recipes.finetune --help``.

* ``finetune.py``: one run's command line: parse, then ``training.run`` (causal LM, the nine GLUE tasks, images).
* ``training.py``: one run: setup -> train -> write outputs; ``run_state.py``: ``TrainingRun``, what a run carries;
  ``optimization.py``: the optimizer and the gate policy (``--gate_schedule``); ``outputs.py``: what a trained run
  writes (model, results, plots, card, harness scores, upload).
* ``compare.py``: baseline and patched runs with the same data, seed and budget, as a markdown table and a plot;
  with no arguments, the offline demo (``make demo``). It is a sweep of one configuration paired with its
  baseline, so it imports ``sweep`` (which imports ``training``), never the other way round.
* ``tasks/``: one module per task (``clm``, ``glue``, ``image``; ``text`` shares the text tasks' parts) and their
  registry (``recipes.tasks.TASKS``, ``get_task``). A task owns its data flags' checks, data, metrics, model head,
  preprocessor, Hub names and model-card rows: adding one is a module and a registry line (docs/recipes.md, "Adding
  a task"), and no other module branches on a task's name.
* ``args.py``: the command line (Hugging Face example-script flag names), parsed and checked: ``parse_args``,
  ``parse_values``; ``config_files.py``: YAML/JSON config files; ``checks.py``: the checks that need no model or
  data; ``patch_flags.py``: the scorer flags, generated from the library's scorer registry and configs (no scorer
  is named in the recipes); ``errors.py``: ``RecipeError``, which every room raises.
* ``modeling.py``: building the model with the task's head, and the patch.
* ``qlora.py``: a quantized base (bitsandbytes, torchao) and LoRA adapters beside the scorers: the flags, their
  checks, the ``quantization_config``, PEFT's wrapping, and what the card says of them.
* ``checkpointing.py``: atomic Accelerate checkpoints and resuming.
* ``hub.py``: deciding quickly whether the Hugging Face Hub is reachable (else: offline mode); the push check.
* ``report.py``: ``all_results.json``, the model card, the training plot, evaluation curves, the Hub upload.
* ``scorer_plots.py``: a patched run's scorer history and attention maps.
* ``metrics/``: offline `evaluate` modules (GLUE, accuracy).
* ``configs/``: example configs reproducing the papers' setups; ``accelerate_configs/``: launch configs.
* ``sweep/``: grids of runs over seeds from one config, resumable: ``plan.py``, ``run.py``, ``report.py``;
  ``stats.py``: the statistics of comparisons over seeds.
* ``harness.py``: evaluation with lm-evaluation-harness.
* ``demo.py``, ``plot_example.py``: the one-minute API tour and the pictures of docs/plots.md.
* ``quiet.py``: what a run would print that it does not act on (other libraries' start-up messages, warnings about
  what PEFT settles itself), filtered where it is printed.

The imports run one way: ``tasks``, ``patch_flags``, ``config_files`` and ``qlora`` import no other room (only
``errors`` and ``quiet``, which import none);
``checks``, ``modeling`` and ``report`` build on the first two; ``args`` on ``checks`` and ``config_files``;
``optimization``, ``run_state``, ``outputs`` and ``training`` on these, in that order; ``finetune`` (the command line)
and ``sweep`` on ``training``, the sweep never on ``finetune``; ``compare`` on ``sweep`` (tests/architecture/test_architecture.py
checks that there is no circle and that the sweep does not import ``finetune``).

See ``docs/recipes.md``.
"""

import importlib.util

# The recipes extra (pyproject.toml): checked when the package is imported, so that a library-only install says
# what to install in one line instead of failing deep inside a run. Only looked up, not imported: the recipes import
# them where they are used, so that parsing the command line (and --help) does not pay for them.
_REQUIRED = {"accelerate": "accelerate", "datasets": "datasets", "evaluate": "evaluate"}
_missing = [package for module, package in _REQUIRED.items() if importlib.util.find_spec(module) is None]
if _missing:
    raise ImportError(
        f"The recipes need {', '.join(_missing)}, not installed here: pip install 'hf-neural-attn[recipes]' "
        "(from a clone: pip install -e '.[recipes]')."
    )
