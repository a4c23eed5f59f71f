"""Loading patched checkpoints, one wing; every module here sits above :mod:`hf_neural_attn.patching`.

* :mod:`.files`: the caller's keywords split as transformers splits them, the config, the model class, the names
  tensors have on disk, safetensors reads;
* :mod:`.checksums`: what an adapter records of its base model's weights;
* :mod:`.rebuild`: the record read and checked, and load -> check -> patch -> fill, the one sequence every loader
  runs, with the one check that the base model fits the record;
* :mod:`.full` and :mod:`.adapters`: full checkpoints (``save_pretrained``) and adapter-only ones
  (``save_adapter``); :mod:`.peft_adapters`: PEFT adapters over a patched checkpoint;
* :mod:`.dispatch`: ``from_pretrained``, which tells the kinds apart and hands each to its loader.

transformers' own entry points (the Auto classes, a model class's ``from_pretrained``) reach these loaders through the
integrations: :mod:`hf_neural_attn.integrations.auto_classes` and :mod:`hf_neural_attn.integrations.transformers_loading`.
"""
