"""What ``import hf_neural_attn`` installs in other libraries, as one table, and the switch that leaves them alone.

Each row of :data:`INTEGRATIONS` names one change, the library it changes, what it changes and when it is installed:
at the import of hf_neural_attn, when a patched config class is made (by ``patch_model``, or by ``AutoConfig``
reading a patched checkpoint), or once a given module is imported, by whoever imports it (without importing it
first: transformers' modeling stack takes seconds to import, see :mod:`.import_hooks`).

**The opt-out.** ``HF_NEURAL_ATTN_NO_INTEGRATIONS`` in the environment when the library is imported leaves rows out:
``1`` (or ``true``, ``yes``, ``all``) every row not marked ``required``, or a comma-separated list of row names
(``"push card, continuous batching"``) those rows. :func:`uninstall` takes every optional row back after the import;
:func:`install` puts every row back. The required rows stay: the attention function patched models call by name and
the family probe ``patch_model`` checks a standard attention module with (registrations in transformers' public
attention registry), the library's two tensor-parallel styles (a patch under tensor parallelism shards its scorers
with them), and torch.compile's view of two of the library's own cached lookups (which changes no other library).
With every optional row out, transformers' own ``from_pretrained``, ``save_pretrained``, push cards, Auto classes,
continuous batching and DeepSpeed's Ulysses registration are transformers' and DeepSpeed's, unchanged; the explicit
API (``hf_neural_attn.patch_model``, ``hf_neural_attn.from_pretrained``, ``save_pretrained`` of a patched model)
still works.

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
    from . import deepspeed_ulysses

    deepspeed_ulysses.install(ulysses, attn_implementation=ATTN_IMPLEMENTATION)


def _register_probe(standard_family: ModuleType) -> None:
    # The probe runs on a model's attention modules, whose modeling module imported transformers' modeling stack
    # (the registries) first; waiting for it keeps the family's import from importing that stack.
    after_import(
        "transformers.modeling_utils",
        lambda _: register_attention(standard_family.PROBE_IMPLEMENTATION, standard_family.probe_attention),
    )


def _register_parallel_styles(tensor_parallel: ModuleType) -> None:
    from ..parallel.tensor import parallel_styles

    for name, style in parallel_styles(tensor_parallel).items():
        if name not in tensor_parallel.ALL_PARALLEL_STYLES:
            tensor_parallel.ALL_PARALLEL_STYLES.register(name, style)


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
        "family probe",
        "transformers",
        '"hf_neural_attn_probe" in AttentionInterface (a public registry): the function that records, once per module '
        "before a patch, what a standard-plumbing attention module hands its attention function "
        "(hf_neural_attn.families.standard); a patch of such a model cannot check it without",
        "hf_neural_attn.families.standard",
        _register_probe,
        required=True,
    ),
    Integration(
        "tensor-parallel styles",
        "transformers",
        '"hf_neural_attn_per_head" and "hf_neural_attn_shared" in ALL_PARALLEL_STYLES (a public registry): how tensor '
        "parallelism shards a scorer's per-head parameters of any rank and keeps its shared ones whole "
        "(hf_neural_attn.parallel.tensor); a patch under tensor parallelism cannot shard its scorers without",
        "transformers.integrations.tensor_parallel",
        _register_parallel_styles,
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
_enabled: frozenset[str] = frozenset()  # the optional rows installed (or waiting for their module), by name
_hooks_placed = False
_SWITCH_ON = ("1", "true", "yes", "all")
_SWITCH_OFF = ("", "0", "false", "no")


def optional_rows() -> frozenset[str]:
    """The names of the rows the opt-out may leave out (those not marked ``required``)."""
    return frozenset(row.name for row in INTEGRATIONS if not row.required)


def rows_left_out(value: str | None = None) -> frozenset[str]:
    """The names of the rows :data:`OPT_OUT_VARIABLE` (or ``value``) leaves out: none when it is unset, empty, ``0``,
    ``false`` or ``no``; every optional row for ``1``, ``true``, ``yes`` or ``all``; else the rows it names,
    comma-separated (case and spaces around a name do not matter).

    Raises:
        ValueError: it names a row the table does not have, or a required one (the message lists the optional rows).
    """
    value = os.environ.get(OPT_OUT_VARIABLE, "") if value is None else value
    switch = value.strip().lower()
    if switch in _SWITCH_OFF:
        return frozenset()
    if switch in _SWITCH_ON:
        return optional_rows()
    by_name = {row.name.lower(): row for row in INTEGRATIONS}
    named = [name.strip().lower() for name in value.split(",") if name.strip()]
    wrong = [name for name in named if name not in by_name or by_name[name].required]
    if wrong:
        raise ValueError(
            f"{OPT_OUT_VARIABLE}={value!r} names {wrong}, which are not optional rows of "
            f"hf_neural_attn.integrations.INTEGRATIONS. Set it to 1 to leave out every optional row, or to a "
            f"comma-separated list of some of {sorted(optional_rows())}. (The required rows cannot be left out: "
            "patched models need them.)"
        )
    return frozenset(by_name[name].name for name in named)


def opted_out() -> bool:
    """Whether the environment leaves out every optional row (:data:`OPT_OUT_VARIABLE` set to ``1``, ...)."""
    return rows_left_out() == optional_rows()


def install() -> None:
    """Install every row of :data:`INTEGRATIONS` (the import-triggered ones once their module is imported). Running
    it again changes nothing; after :func:`uninstall`, or an import that left rows out, it puts everything back."""
    _enable(optional_rows())


def install_on_import() -> None:
    """What ``import hf_neural_attn`` runs: every row but those :func:`rows_left_out` names."""
    _enable(optional_rows() - rows_left_out())


def uninstall() -> list[str]:
    """Take back every change of the rows not marked ``required``: the wrapped methods get their originals back, the
    Auto classes and AutoConfig forget the patched types, and modules imported later are left alone. Returns what
    was undone, in words. Patched models keep working through the explicit API."""
    global _enabled
    with _lock:
        _enabled = frozenset()
        return undo_all()


def installed() -> bool:
    """Whether every optional row is installed (none left out by the environment, no :func:`uninstall` since)."""
    return _enabled == optional_rows()


def enabled_rows() -> list[str]:
    """The names of the rows in force, in table order: the required ones and the optional ones not left out (a row
    waiting for its module's import counts)."""
    return [row.name for row in INTEGRATIONS if row.required or row.name in _enabled]


def _enable(names: frozenset[str]) -> None:
    """Put the optional rows ``names`` in force (beside those already), placing every row's hooks once."""
    global _enabled
    with _lock:
        reinstalling = _hooks_placed  # hooks that fired while a row was off: run those rows now
        added = names - _enabled
        _enabled = _enabled | names
        _place_hooks()
        for integration in INTEGRATIONS:
            if integration.name in added and integration.when == AT_IMPORT:
                integration.install()
        if reinstalling:
            _rerun_for_what_is_there(added)


def _place_hooks() -> None:
    """Hand every row that waits for something to what it waits for, once per process. The callbacks of optional
    rows check that their row is in force when they fire, so :func:`uninstall` needs no way to take a hook back."""
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
        if integration.required or integration.name in _enabled:
            integration.install(*arguments)

    return run


def _rerun_for_what_is_there(names: frozenset[str]) -> None:
    """Rows ``names`` put in force after the import (:func:`install` after :func:`uninstall`, or after an import that
    left them out): the modules already imported and the patched config classes already made get them now (their
    hooks fired while the rows were off)."""
    for integration in INTEGRATIONS:
        if integration.name not in names or integration.when == AT_IMPORT:
            continue
        if integration.when == PER_PATCHED_CONFIG_CLASS:
            for patched_class, base_class in made_patched_classes():
                integration.install(patched_class, base_class)
        elif integration.when in sys.modules:
            integration.install(sys.modules[integration.when])
