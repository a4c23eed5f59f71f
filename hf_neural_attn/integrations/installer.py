"""What ``import hf_neural_attn`` installs in other libraries, as one table, and the switch that leaves them alone.

Each row of :data:`INTEGRATIONS` names one change, the library it changes, what it changes and when it is installed:
at the import of hf_neural_attn, when a patched config class is made (by ``patch_model``, or by ``AutoConfig``
reading a patched checkpoint), or once a given module of that library is imported, by whoever imports it (without
importing it first: transformers' modeling stack takes seconds to import, see :mod:`.import_hooks`).

**The opt-out.** With ``HF_NEURAL_ATTN_NO_INTEGRATIONS=1`` in the environment when the library is imported, or after
:func:`uninstall`, only the rows marked ``required`` stay: the attention function patched models call by name (a
patched model cannot run without it), and torch.compile's view of two of the library's own cached lookups (which
changes no other library). transformers' own ``from_pretrained``, ``save_pretrained``, push cards, Auto classes,
continuous batching and DeepSpeed's Ulysses registration are then transformers' and DeepSpeed's, unchanged; the
explicit API (``hf_neural_attn.patch_model``, ``hf_neural_attn.from_pretrained``, ``save_pretrained`` of a patched
model) still works. :func:`install` puts everything back.

What other libraries load from the outside (the vLLM plugin, :mod:`.vllm`) is not installed here: vLLM calls its
entry point.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
from collections.abc import Callable
from types import ModuleType

from ..patched_config import PatchedCheckpointConfig, made_patched_classes, on_patched_class
from ..record import ATTN_IMPLEMENTATION, PATCHED_MODEL_TYPE
from .attention_registry import register_attention
from .import_hooks import after_import, constant_when_compiled
from .wrapping import register, undo_all

OPT_OUT_VARIABLE = "HF_NEURAL_ATTN_NO_INTEGRATIONS"

# When a row is installed: at the import of hf_neural_attn, or as each patched config class is made; any other value
# names the module whose import installs it.
AT_IMPORT = "import hf_neural_attn"
PER_PATCHED_CONFIG_CLASS = "each patched config class"


@dataclasses.dataclass(frozen=True)
class Integration:
    """One change the library makes to another library.

    ``install`` is called without arguments (:data:`AT_IMPORT`), with ``(patched_class, base_class)``
    (:data:`PER_PATCHED_CONFIG_CLASS`), or with the imported module (a module name). ``required``: kept under the
    opt-out, because patched models need it or because it changes nothing of the other library."""

    name: str
    library: str
    changes: str
    when: str
    install: Callable[..., None]
    required: bool = False


# The installers import what they install when they run: what they wrap belongs to transformers' modeling stack,
# which takes seconds to import, and `import hf_neural_attn` stays cheap.


def _register_attention_function(patched_class, base_class) -> None:
    from ..attention import hf_neural_attention_forward, hf_neural_attention_mask

    register_attention(ATTN_IMPLEMENTATION, hf_neural_attention_forward, hf_neural_attention_mask)


def _register_checkpoint_config() -> None:
    # What AutoConfig.register does, through the mapping it writes to, so that uninstall() can take it out again.
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    register(CONFIG_MAPPING, PATCHED_MODEL_TYPE, PatchedCheckpointConfig)


def _register_auto_classes(patched_class, base_class) -> None:
    from .auto_classes import register_patched_config

    register_patched_config(patched_class, base_class)


def _install_loading(modeling_utils: ModuleType) -> None:
    from . import transformers_loading

    transformers_loading.install()


def _install_push_card(modeling_utils: ModuleType) -> None:
    from transformers.utils import hub

    from . import transformers_hub

    # push_to_hub calls transformers.utils.hub's function, save_pretrained(push_to_hub=True) the name modeling_utils
    # imported from it: both are wrapped.
    transformers_hub.install(hub, modeling_utils)


def _install_continuous_batching(continuous_api: ModuleType) -> None:
    from . import continuous_batching

    continuous_batching.install(continuous_api)


def _refuse_ulysses(ulysses: ModuleType) -> None:
    from .parallelism import refuse_ulysses

    refuse_ulysses(ulysses, attn_implementation=ATTN_IMPLEMENTATION)


INTEGRATIONS: tuple[Integration, ...] = (
    Integration(
        "attention function",
        "transformers",
        '"hf_neural_attn" in AttentionInterface and AttentionMaskInterface (public registries): the function a '
        "patched model's attention modules call, and the mask builder beside it",
        PER_PATCHED_CONFIG_CLASS,
        _register_attention_function,
        required=True,
    ),
    # Two cached lookups of the library's own, asked on every call, become constants to torch.compile. Each waits
    # for its module's import to finish (the function must exist), then for torch._dynamo's (import_hooks).
    Integration(
        "compile constant: Triton check",
        "torch",
        "hf_neural_attn.ops.triton.triton_available becomes assume_constant_result under torch.compile, once "
        "torch._dynamo is imported; nothing of torch changes",
        "hf_neural_attn.ops.triton",
        lambda module: constant_when_compiled(module.__name__, "triton_available"),
        required=True,
    ),
    Integration(
        "compile constant: forward signatures",
        "torch",
        "hf_neural_attn.families.base.forward_parameters (a signature lookup per attention class) becomes "
        "assume_constant_result under torch.compile, once torch._dynamo is imported; nothing of torch changes",
        "hf_neural_attn.families.base",
        lambda module: constant_when_compiled(module.__name__, "forward_parameters"),
        required=True,
    ),
    Integration(
        "checkpoint config type",
        "transformers",
        'model_type "hf_neural_attn" in AutoConfig: a patched checkpoint\'s config.json reads as its patched config',
        AT_IMPORT,
        _register_checkpoint_config,
    ),
    Integration(
        "Auto classes",
        "transformers",
        "each patched config class in every AutoModel* mapping that serves its base (to a loader that returns the "
        "patched model) and in the tokenizer, image-processor, feature-extractor and processor mappings",
        PER_PATCHED_CONFIG_CLASS,
        _register_auto_classes,
    ),
    Integration(
        "model classes' loading",
        "transformers",
        "PreTrainedModel.from_pretrained (a patched checkpoint loads patched), save_pretrained (refuses scorers PEFT "
        "still wraps) and post_init (a model built from a patched config is patched as recorded)",
        "transformers.modeling_utils",
        _install_loading,
    ),
    Integration(
        "push card",
        "transformers",
        "create_and_tag_model_card (transformers.utils.hub and transformers.modeling_utils): push_to_hub writes the "
        "library's card for a patched checkpoint where transformers would write its template",
        "transformers.modeling_utils",
        _install_push_card,
    ),
    Integration(
        "continuous batching",
        "transformers",
        "ContinuousBatchingManager.switch_to_cb_friendly_attn keeps a patched model's implementation",
        "transformers.generation.continuous_batching.continuous_api",
        _install_continuous_batching,
    ),
    Integration(
        "Ulysses refusal",
        "deepspeed",
        "UlyssesSPAttentionHF.register_with_transformers refuses a patched model by name",
        "deepspeed.runtime.sequence_parallel.ulysses_sp",
        _refuse_ulysses,
    ),
)

_lock = threading.RLock()
_optional_enabled = False
_hooks_placed = False


def opted_out() -> bool:
    """Whether the environment asks the library to leave other libraries alone (:data:`OPT_OUT_VARIABLE` set to
    anything but empty, ``0``, ``false`` or ``no``)."""
    return os.environ.get(OPT_OUT_VARIABLE, "").strip().lower() not in ("", "0", "false", "no")


def install() -> None:
    """Install every row of :data:`INTEGRATIONS` (the import-triggered ones once their module is imported). Running
    it again changes nothing; after :func:`uninstall` it puts everything back."""
    global _optional_enabled
    with _lock:
        reinstalling = _hooks_placed  # the hooks fired while the optional rows were off: run those rows now
        _optional_enabled = True
        _place_hooks()
        for integration in INTEGRATIONS:
            if not integration.required and integration.when == AT_IMPORT:
                integration.install()
        if reinstalling:
            _rerun_for_what_is_there()


def install_on_import() -> None:
    """What ``import hf_neural_attn`` runs: :func:`install`, or the required rows only under the opt-out."""
    if opted_out():
        with _lock:
            _place_hooks()
    else:
        install()


def uninstall() -> list[str]:
    """Take back every change of the rows not marked ``required``: the wrapped methods get their originals back, the
    Auto classes and AutoConfig forget the patched types, and modules imported later are left alone. Returns what
    was undone, in words. Patched models keep working through the explicit API."""
    global _optional_enabled
    with _lock:
        _optional_enabled = False
        return undo_all()


def installed() -> bool:
    """Whether the optional rows are installed (not opted out, not uninstalled)."""
    return _optional_enabled


def _place_hooks() -> None:
    """Hand every row that waits for something to what it waits for, once per process. The callbacks of optional
    rows check :func:`installed` when they fire, so :func:`uninstall` needs no way to take a hook back."""
    global _hooks_placed
    if _hooks_placed:
        return
    _hooks_placed = True
    for integration in INTEGRATIONS:
        if integration.when == AT_IMPORT:
            if integration.required:
                integration.install()
        elif integration.when == PER_PATCHED_CONFIG_CLASS:
            on_patched_class(_when_enabled(integration))
        else:
            after_import(integration.when, _when_enabled(integration))


def _when_enabled(integration: Integration) -> Callable[..., None]:
    def run(*arguments) -> None:
        if integration.required or _optional_enabled:
            integration.install(*arguments)

    return run


def _rerun_for_what_is_there() -> None:
    """After an :func:`uninstall`, :func:`install` again: the modules already imported and the patched config classes
    already made get their optional rows now (their hooks fired while the rows were off)."""
    for integration in INTEGRATIONS:
        if integration.required or integration.when == AT_IMPORT:
            continue
        if integration.when == PER_PATCHED_CONFIG_CLASS:
            for patched_class, base_class in made_patched_classes():
                integration.install(patched_class, base_class)
        elif integration.when in sys.modules:
            integration.install(sys.modules[integration.when])
