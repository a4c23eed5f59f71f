"""The patch record, and the names the patch leaves on a model: what every layer above reads to know a patch.

A patched model's config carries ``config.hf_neural_attn``, the record of its patch, and saves it in config.json
(an adapter-only checkpoint saves it in its own JSON). On disk and in the config it is a plain mapping, since that
is what transformers serialises. In the code it is a :class:`PatchRecord`: its fields are declared once, here,
:meth:`PatchRecord.from_dict` is the only reader of the mapping (checked field by field, so a damaged file is an
error naming the file and the field) and :meth:`PatchRecord.to_dict` the only writer. Where the mapping sits on a
config is known here only: :meth:`PatchRecord.of` reads it, :meth:`PatchRecord.write_to` and :func:`remove_record`
change it, :func:`carries_record` asks whether it is there.

The record describes the model, not how it runs: the compute path (``impl``) is a run-time setting, which no
record saves (:meth:`PatchRecord.scorer_config` takes it from the caller).

The read-only questions asked of a model (is it patched, with which record, which parameters are new) are here
too, judged from the names below; the modules that write them (:mod:`hf_neural_attn.patching`,
:mod:`hf_neural_attn.attention`) sit above this one.

``import hf_neural_attn`` reads this module (the names, the record type), so what only a model needs (transformers'
modeling stack) is imported where it is used: that is seconds to import. The record does not know the model families:
a loader checks that the recorded family is one this version has (``loading/rebuild.py``), where it needs one.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from torch import nn

from ._version import __version__
from .ops.choices import DEFAULT_IMPL
from .scorers import SCORERS, ScorerConfig

ATTN_IMPLEMENTATION = "hf_neural_attn"  # the name registered in transformers' Attention(Mask)Interface
RECORD_KEY = "hf_neural_attn"  # the config attribute (and config.json field) holding the record
PATCHED_MODEL_TYPE = "hf_neural_attn"  # model_type written to a patched checkpoint's config.json
SCORER_ATTR = "attn_scorer"  # submodule of each patched attention module
# On every attention module that reads the patched config: (family name, original implementation), so the modules
# the patch does not score keep running the model's own attention. Its presence is what "patched" means.
FALLBACK_ATTR = "_hf_neural_attn_fallback"
# On modules the patch put in place of the model's own (narrow query and key projections, hf_neural_attn.narrow_keys):
# their parameters are new, like the scorers' (they train, save and load with the patch).
ADDED_MODULE_ATTR = "_hf_neural_attn_added"
EXTRAS_KWARG = "hf_neural_attn_extras"  # per-query scorer inputs passed from the pre-hook to the attention function
# On the classes the loaders build a patched checkpoint's base model with: transformers' from_pretrained, which sends
# patched checkpoints to the loaders (hf_neural_attn.integrations.transformers_loading), lets them through.
BASE_LOAD_ATTR = "_hf_neural_attn_loads_base"
# The parts of the names PEFT gives a wrapped module's tensors (ModulesToSaveWrapper, a tuner layer's base_layer): a
# scorer tensor saved under one of them was saved while PEFT wrapped the scorer.
PEFT_WRAPPER_PARTS = (".modules_to_save.", ".original_module.", ".base_layer.")


def known_implementations() -> list[str]:
    """The attention implementations a model can run under the patch (``base_attn_implementation``): eager, and
    those registered in transformers' ``AttentionInterface`` (SDPA, flash, flex, kernels loaded so far), not ours."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    ours = ATTN_IMPLEMENTATION  # the patch's own name, and the generic family's probe
    return ["eager", *(name for name in ALL_ATTENTION_FUNCTIONS.valid_keys() if not name.startswith(ours))]


# The layout of the saved record, numbered: a reader knows which fields and options to expect from it. Records
# without the number are format 1 (hf_neural_attn 0.1.0 before it was written): their options may hold the run-time
# ``impl``, which format 2 leaves out. Raise it whenever the saved layout changes, and read the older ones in
# PatchRecord.from_dict.
RECORD_FORMAT = 2


def damaged(source: str, filename: str | None, field_name: str | None, problem: str) -> ValueError:
    """The error for a damaged patch record, naming the file it came from and the field. ``filename`` None: the
    record a config object in memory carries, which no file holds now (it was set or changed on the config, or read
    from a file whose name the config does not keep): the message then blames no file."""
    where = f"field {field_name!r} of " if field_name else ""
    if filename is None:
        return ValueError(
            f"The hf_neural_attn record that {source} carries (config.{RECORD_KEY}) is not valid: {where}the record "
            f"{problem}. patch_model and the loaders write that record; it was changed since, or read from a "
            "config.json that was. Patch the model again, or load it again from an intact checkpoint."
        )
    return ValueError(
        f"The hf_neural_attn record in {source}/{filename} is damaged: {where}the record {problem}. "
        "Save the model (or adapter) again with hf_neural_attn, or restore the file."
    )


@dataclass(frozen=True)
class PatchRecord:
    """What a patch was: enough to apply it again to the same base model.

    Attributes:
        scorer: the scorer's name (a key of ``hf_neural_attn.scorers.SCORERS``).
        options: the scorer config's options (``ScorerConfig.to_dict()``: the run-time ``impl`` is not one of them;
            records saved before it was left out carry it, and it is checked and ignored, see :meth:`scorer_config`).
        layers: the patched attention layers, sorted non-negative indices.
        family: the model family's name (``hf_neural_attn.families.FAMILIES``); None in records that predate it.
        base_attn_implementation: the attention implementation the model ran before the patch (``"eager"``,
            ``"sdpa"``, ...): its unscored modules keep running it, and ``unpatch_model`` restores it.
        base_model_type: the config's ``model_type`` before the patch (``"llama"``); a saved config.json says
            ``"hf_neural_attn"`` instead, and this is how it is rebuilt.
        version: the hf_neural_attn version that made the patch. (The layout of the saved mapping is numbered
            apart from it, :data:`RECORD_FORMAT`: one version can read and write several.)
        origin: where the record was read from, ``(source, filename)`` (filename None: a config in memory), for
            error messages; not saved.
    """

    scorer: str
    options: Mapping[str, Any]
    layers: tuple[int, ...]
    family: str | None = None
    base_attn_implementation: str | None = None
    base_model_type: str | None = None
    version: str = __version__
    origin: tuple[str, str | None] | None = field(default=None, compare=False, repr=False)

    # The fields a saved record must have; the others were added later and may be absent.
    REQUIRED: ClassVar[tuple[str, ...]] = ("scorer", "options", "layers", "version")
    OPTIONAL_NAMES: ClassVar[tuple[str, ...]] = ("family", "base_attn_implementation", "base_model_type")

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "this model", filename: str | None = "config.json") -> PatchRecord:
        """The record a saved mapping holds, checked field by field, in the layout its ``format`` number names
        (:data:`RECORD_FORMAT`; none: format 1). ``filename`` None: the mapping a config object in memory carries.

        Raises:
            ValueError: a field is missing or malformed (the message names ``source``/``filename`` and the field),
                the record is of a format this version does not know (a newer version wrote it), or the scorer is
                one this version of the library does not have.
        """
        if not isinstance(data, Mapping):
            raise damaged(source, filename, None, f"must be a mapping with {list(cls.REQUIRED)}, got {data!r}")
        record_format = _record_format(data, source, filename)
        for name in cls.REQUIRED:
            if name not in data:
                raise damaged(source, filename, name, f"lacks it (expected {list(cls.REQUIRED)})")
        scorer, options, layers, version = (data[name] for name in cls.REQUIRED)
        if not isinstance(scorer, str):
            raise damaged(source, filename, "scorer", f"must name a scorer, got {scorer!r}")
        if scorer not in SCORERS:
            raise ValueError(
                f"{source} was patched with scorer {scorer!r}, which this version of hf_neural_attn "
                f"({__version__}) does not have. Available scorers: {sorted(SCORERS)}."
            )
        if not isinstance(options, Mapping) or not all(isinstance(key, str) for key in options):
            raise damaged(source, filename, "options", f"must be a mapping of option names to values, got {options!r}")
        saved_runtime = sorted(set(options) & _runtime_options(scorer))
        if saved_runtime and record_format >= 2:
            problem = f"holds run-time options {saved_runtime}, which records of format {record_format} leave out"
            raise damaged(source, filename, "options", problem)
        if not (
            isinstance(layers, list) and layers and all(isinstance(i, int) and not isinstance(i, bool) for i in layers)
        ):
            raise damaged(source, filename, "layers", f"must be a non-empty list of layer indices, got {layers!r}")
        if any(i < 0 for i in layers) or layers != sorted(set(layers)):
            raise damaged(source, filename, "layers", f"must hold sorted non-negative layer indices, got {layers!r}")
        if not isinstance(version, str) or not re.fullmatch(r"\d+(\.\d+)*\S*", version):
            raise damaged(source, filename, "version", f"must be a version string, got {version!r}")
        names = {}
        for name in cls.OPTIONAL_NAMES:
            value = data.get(name)
            if value is not None and not isinstance(value, str):
                raise damaged(source, filename, name, f"must be a name, got {value!r}")
            names[name] = value
        implementation = names["base_attn_implementation"]
        if implementation is not None and implementation not in known_implementations():
            problem = f"names no attention implementation ({known_implementations()}), got {implementation!r}"
            raise damaged(source, filename, "base_attn_implementation", problem)
        return cls(scorer, dict(options), tuple(layers), **names, version=version, origin=(source, filename))

    @classmethod
    def of(cls, model_or_config: Any, *, source: str | None = None, filename: str | None = None) -> PatchRecord | None:
        """The record a model's config, a config, or a config.json's content (a mapping) carries, or None. A record
        that does not read is an error naming ``source``/``filename``: the file it was read from, where the caller
        names one; by default the config in memory, whose record was changed since it was written (or written by a
        newer version)."""
        config = model_or_config
        if not isinstance(config, Mapping):  # a model answers with its config
            config = getattr(config, "config", config)
        data = _record_data(config)
        if data is None:
            return None
        source = source or f"this model's config ({type(config).__name__})"
        return cls.from_dict(data, source=source, filename=filename)

    def write_to(self, config: Any) -> None:
        """Make this the record ``config`` carries (and saves in its config.json)."""
        setattr(config, RECORD_KEY, self.to_dict())

    def to_dict(self) -> dict[str, Any]:
        """The mapping saved in config.json (and in an adapter's JSON), in the current :data:`RECORD_FORMAT` (a
        record read from an older format is written in the current one: without run-time options)."""
        runtime = _runtime_options(self.scorer)
        return {
            "format": RECORD_FORMAT,
            "scorer": self.scorer,
            "options": {name: value for name, value in self.options.items() if name not in runtime},
            "layers": list(self.layers),
            "family": self.family,
            "base_attn_implementation": self.base_attn_implementation,
            "base_model_type": self.base_model_type,
            "version": self.version,
        }

    @property
    def base_to_run(self) -> str | None:
        """The base implementation a model rebuilt from this record runs unless told otherwise: the recorded one
        where every machine runs it (eager, SDPA); None for a flash or flex base, which needs its kernels (the model
        then takes transformers' default), or where the record predates the field."""
        base = self.base_attn_implementation
        return base if base in ("eager", "sdpa") else None

    def scorer_config(self, impl: str | None = None) -> ScorerConfig:
        """The scorer config this record describes, computing on the path ``impl`` names (None: the default,
        :data:`~hf_neural_attn.ops.choices.DEFAULT_IMPL`), checked like any option.

        The compute path is a run-time setting, not part of the model (every path computes the same scores), so
        the record does not hold it. A record saved before it was left out carries an ``impl`` option: it is
        checked with the other options (a value no version wrote is a damaged record) and ignored.

        Raises:
            ValueError: the options do not describe a scorer of this kind (a damaged record, naming where it was
                read), or ``impl`` is not a compute path.
        """
        source, filename = self.origin or ("this model's config", None)
        config_class = SCORERS[self.scorer].config_class
        try:
            config = config_class.from_record(dict(self.options))
        except (TypeError, ValueError) as error:
            problem = f"does not describe a {self.scorer!r} scorer: {str(error).rstrip('.')}"
            raise damaged(source, filename, "options", problem) from error
        return dataclasses.replace(config, impl=impl if impl is not None else DEFAULT_IMPL)


def _record_format(data: Mapping[str, Any], source: str, filename: str | None) -> int:
    """The ``format`` number of a saved record (1 where it has none: written before the number was).

    Raises:
        ValueError: not a positive whole number (damaged), or above :data:`RECORD_FORMAT` (a newer version wrote it).
    """
    record_format = data.get("format", 1)
    if isinstance(record_format, bool) or not isinstance(record_format, int) or record_format < 1:
        raise damaged(source, filename, "format", f"must be a record format number, got {record_format!r}")
    if record_format > RECORD_FORMAT:
        where = f"{source}/{filename}" if filename else source
        raise ValueError(
            f"The hf_neural_attn record in {where} is of format {record_format}, written by a newer version of "
            f"hf_neural_attn; this version ({__version__}) reads record formats 1 to {RECORD_FORMAT}. Upgrade "
            "hf_neural_attn (pip install -U hf-neural-attn) to load it."
        )
    return record_format


def _runtime_options(scorer: str) -> set[str]:
    """The options of ``scorer`` that are run-time settings (``impl``), which records of format 2 on leave out."""
    return {item.name for item in SCORERS[scorer].config_class.option_fields() if item.metadata.get("runtime")}


def patch_record(model: nn.Module) -> PatchRecord | None:
    """The record of ``model``'s patch (scorer, options, layers, family, base implementation, base model type,
    version), or None when ``model`` is not patched. A sentence-transformers model answers for the transformers
    model it holds."""
    inner = inner_transformers_model(model)
    if inner is not None:
        model = inner
    return PatchRecord.of(model) if is_patched(model) else None


def inner_transformers_model(model: nn.Module) -> nn.Module | None:
    """The transformers model inside a sentence-transformers ``SentenceTransformer`` (its ``Transformer`` module's
    ``auto_model``), or None for any other object. Looked up by shape, so sentence-transformers is never imported."""
    from transformers import PreTrainedModel

    if isinstance(model, PreTrainedModel) or not isinstance(model, nn.Sequential):
        return None
    inner = [getattr(part, "auto_model", None) for part in model.children()]
    inner = [candidate for candidate in inner if isinstance(candidate, PreTrainedModel)]
    return inner[0] if len(inner) == 1 else None


def is_patched(model: nn.Module) -> bool:
    """Whether ``model`` carries a patch. Judged by its modules, not by ``config.hf_neural_attn``: a config loaded
    from a patched checkpoint by plain transformers carries the record over an unpatched model."""
    return isinstance(model, nn.Module) and any(hasattr(module, FALLBACK_ATTR) for module in model.modules())


def carries_record(config: Any) -> bool:
    """Whether a config, or a config.json's content (a mapping), carries a patch record, whether it reads or not.
    A composite model's sub-configs carry none: the record is the top config's."""
    return _record_data(config) is not None


def remove_record(config: Any) -> None:
    """Take the record off ``config`` (``unpatch_model``); a config without one is left as it is."""
    vars(config).pop(RECORD_KEY, None)


def recorded_base_model_type(config_dict: Mapping[str, Any]) -> Any:
    """The ``base_model_type`` field of the record a config.json's content carries, read alone and unchecked (None
    where there is no record or no such field): what picks a patched checkpoint's config class, before a loader
    reads the whole record with :meth:`PatchRecord.from_dict`, where its messages can name the folder."""
    data = _record_data(config_dict)
    return data.get("base_model_type") if isinstance(data, Mapping) else None


def _record_data(config: Any) -> Any:
    """The saved form of the record ``config`` carries, unread: the ``hf_neural_attn`` field of a config.json's
    content, or attribute of a config object; None where there is none."""
    if isinstance(config, Mapping):
        return config.get(RECORD_KEY)
    return getattr(config, RECORD_KEY, None)


def scorer_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The parameters the patch added, by their names in ``model.named_parameters()``: the scorers', and those of
    the narrower query and key projections that narrow keys (:mod:`hf_neural_attn.narrow_keys`) put in place of the
    model's."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"scorer_parameters expects a model (a torch nn.Module), got {type(model).__name__}.")
    marker = f".{SCORER_ATTR}."
    added = {name for name, module in model.named_modules() if getattr(module, ADDED_MODULE_ATTR, False)}
    return {
        name: parameter
        for name, parameter in model.named_parameters()
        if marker in f".{name}" or (added and name.rpartition(".")[0] in added)
    }
