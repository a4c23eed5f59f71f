"""Where and how a model's weights are held, as the patch reads and writes them: accelerate's offloading
(``offload.py``: weights on the meta device until a hook loads them), DeepSpeed ZeRO-3's partitioning (``zero3.py``:
each process holds a shard; the whole shape and the gathered weights), and quantized bases (``quantized.py``:
bitsandbytes' and torchao's tensors, their dequantized copies, the scorers' dtype on such a base). Not model
families: every family's adapter reads its weights through these.

``base.py`` is the interface each of them implements for the patch, phase by phase (``Placement``; each module's
``PLACEMENT``); ``hf_neural_attn.placements`` lists them, with tensor parallelism's (``hf_neural_attn.parallel``).
"""
