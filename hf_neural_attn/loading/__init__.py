"""Loading patched checkpoints, one wing; every module here sits above :mod:`hf_neural_attn.patching`.

* :mod:`.files`: the caller's keywords split as transformers splits them, the config, the model class, the names
  tensors have on disk, safetensors reads;
* :mod:`.checksums`: what an adapter records of its base model's weights;
* :mod:`.load`: the record read and checked, and load -> patch -> fill, the one sequence every loader runs (the
  only loading module that calls ``patch_model``);
* :mod:`.full` and :mod:`.adapters`: full checkpoints (``save_pretrained``) and adapter-only ones
  (``save_adapter``); :mod:`.checkpoints` is ``from_pretrained``, which dispatches between them;
* :mod:`.auto`: transformers' Auto classes load patched checkpoints patched.
"""
