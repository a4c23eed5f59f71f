"""torch's distributed tensor type, recognised without importing it.

``torch.distributed.tensor`` is imported by whatever shards a model (transformers' tensor parallelism, FSDP2,
torch's context parallelism); until something has, no tensor can be a DTensor, and importing it only to ask would
cost every process that never shards anything.
"""

from __future__ import annotations

import sys
from typing import Any


def dtensor_class() -> type | None:
    """torch's DTensor class, or None where nothing has imported it (then no tensor can be one)."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def is_dtensor(tensor: Any) -> bool:
    """Whether ``tensor`` is a DTensor (sharded or replicated over a device mesh)."""
    dtensor = dtensor_class()
    return dtensor is not None and isinstance(tensor, dtensor)
