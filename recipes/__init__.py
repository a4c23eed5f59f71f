"""Fine-tuning recipes for hf_neural_attn: ``accelerate launch recipes/finetune.py --help``.

* ``finetune.py``: the entry point and training loop (causal LM, the nine GLUE tasks, image classification).
* ``compare.py``: baseline and patched runs with the same data, seed and budget, as a markdown table and a plot.
* ``args.py``: the command line (Hugging Face example-script flag names) and YAML/JSON config files.
* ``tasks.py``: data loading, preprocessing and evaluation for each task kind.
* ``modeling.py``: building the model, tokenizer or image processor, and the patch.
* ``checkpointing.py``: atomic Accelerate checkpoints and resuming.
* ``hub.py``: deciding quickly whether the Hugging Face Hub is reachable (else: offline mode).
* ``report.py``: ``all_results.json``, the model card, the training plot, the comparison table, the Hub upload.
* ``metrics/``: offline `evaluate` modules (GLUE, accuracy).
* ``configs/``: example configs reproducing the papers' setups; ``accelerate_configs/``: launch configs.

See ``docs/recipes.md``.
"""
