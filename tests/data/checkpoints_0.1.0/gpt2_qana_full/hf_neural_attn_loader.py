"""This checkpoint was patched by hf_neural_attn: `pip install hf-neural-attn`, then load it with
`hf_neural_attn.from_pretrained(path)`, or `import hf_neural_attn` before any transformers Auto class.

Without the library, transformers would build the unpatched base model and drop the trained scorers; this
file makes the load fail with an error naming the package instead.
"""

import hf_neural_attn  # noqa: F401
from hf_neural_attn.auto import PatchedCheckpointConfig  # noqa: F401
