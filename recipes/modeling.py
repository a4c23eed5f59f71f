"""Building the model with the task's head, and the attention patch.

Where the model comes from:

* ``--model_name_or_path``: a pretrained model (Hub id or folder). A folder written by a patched run
  (``hf_neural_attn`` record in its config) is reloaded with its patch and scorer weights.
* ``--config_name`` / ``--model_type`` (+ ``--config_overrides``): a model built from scratch.
* none of them: the *embedded* model, a small config the task builds (``Task.embedded_config``: a GPT-2 shape with
  the byte-level ``ByT5Tokenizer`` for text, a ViT for images): nothing is downloaded.

The task (``recipes.tasks``) owns its head (``Task.model_classes``), its preprocessor and how the config fits them.
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import warnings
import zlib
from dataclasses import dataclass, field
from typing import Any

import torch

import hf_neural_attn
from recipes import qlora, quiet, widening
from recipes.errors import RecipeError
from recipes.patch_flags import BASELINE, FLAG_FOR_OPTION, example_scorers, runtime_options, scorer_options
from recipes.tasks import Task, get_task

logger = logging.getLogger(__name__)


@dataclass
class ModelBundle:
    model: Any
    source: str  # where the weights came from, for logs and the model card
    base_model: str | None = None  # Hub id of the pretrained model, for the model card
    from_scratch: bool = True
    new_parameters: set[str] = field(default_factory=set)  # names of parameters initialised in this run
    patch: hf_neural_attn.PatchRecord | None = None  # the model's patch (hf_neural_attn.patch_record), None: baseline
    widened_parameters: int = 0  # what --widen_mlp added (recipes.widening)


def load_config(args: argparse.Namespace, task: Task):
    """The model config, checked against the task, before any weights or data are loaded."""
    from transformers import CONFIG_MAPPING, AutoConfig

    if args.model_name_or_path or args.config_name:
        source = args.model_name_or_path or args.config_name
        try:
            config = AutoConfig.from_pretrained(source)
        except Exception as error:
            raise RecipeError(
                f"Could not load the model config from {source!r}: {error}\n"
                "Without Hub access, pass a local folder (or run with no model flags for the embedded model)."
            ) from error
    elif args.model_type:
        if args.model_type not in CONFIG_MAPPING:
            raise RecipeError(f"Unknown --model_type {args.model_type!r}; e.g. gpt2, llama, vit.")
        config = CONFIG_MAPPING[args.model_type]()
    else:
        config = task.embedded_config(args)
    if args.config_overrides:
        apply_config_overrides(config, args.config_overrides)

    if config.model_type not in task.model_classes():
        raise RecipeError(
            f"The model ({config.model_type}, from {describe_source(args)}) cannot take --task {args.task}: "
            f"transformers has no class with {task.head_description} for model type {config.model_type!r}. "
            f"{task.head_hint}"
        )
    if args.config_overrides:  # the model's own checks of the overridden values, before any data or weights load
        build_skeleton(copy.deepcopy(config), task, f"with --config_overrides {args.config_overrides!r}")
    record = patch_record_of(config, source=args.model_name_or_path or args.config_name)
    if record is not None and args.scorer != BASELINE:
        raise RecipeError(
            f"{args.model_name_or_path} is already patched (scorer {record.scorer!r}, layers {list(record.layers)}). "
            "Pass --scorer none to keep training it with its patch."
        )
    return config


def apply_config_overrides(config, overrides: str) -> None:
    """``--config_overrides "n_layer=8,attn_pdrop=0.1"`` onto ``config``: an item that is not key=value, a key the
    config does not have, a value of the wrong type, and a dropout probability (a numeric key with ``drop`` in its
    name: attn_pdrop, hidden_dropout_prob, layerdrop, drop_path_rate, ...) outside [0, 1] are RecipeErrors. A head
    width the config derived from the old width and head count follows the new ones (:func:`follow_head_dim`)."""
    derived_head_dim = _derived_head_dim(config)
    overridden = set()
    for item in (item.strip() for item in overrides.split(",")):
        key, equals, value = (part.strip() for part in item.partition("="))
        if not (equals and key and value) or "=" in value:
            raise RecipeError(
                f"--config_overrides {overrides!r}: {item!r} is not key=value; write key=value pairs separated by "
                'commas, e.g. "n_layer=8,n_head=8".'
            )
        if not hasattr(config, key):
            raise RecipeError(
                f"--config_overrides {item!r}: the {config.model_type} config ({type(config).__name__}) has no key "
                f"{key!r}; use one of its own keys."
            )
        old = getattr(config, key)
        if isinstance(old, bool) or not isinstance(old, (int, float, str)):
            kind = "true or false" if isinstance(old, bool) else None
        else:
            kind = {int: "an integer", float: "a number", str: "text"}[type(old)]
        if kind is None:
            raise RecipeError(
                f"--config_overrides {item!r}: {key} is {old!r} in the {config.model_type} config, and "
                "--config_overrides sets only numbers, true/false and text; set it in a config.json and pass its "
                "folder as --config_name."
            )
        overridden.add(key)
        try:
            config.update_from_string(f"{key}={value}")
        except ValueError:
            raise RecipeError(
                f"--config_overrides {item!r}: {key} takes {kind} (the {config.model_type} config has {key}={old!r})."
            ) from None
        new = getattr(config, key)
        if "drop" in key and isinstance(new, (int, float)) and not isinstance(new, bool) and not 0 <= new <= 1:
            raise RecipeError(
                f"--config_overrides {item!r}: a dropout probability must be in [0, 1] (0 turns the dropout off)."
            )
    if derived_head_dim and overridden & set(HEAD_SHAPE_KEYS) and "head_dim" not in overridden:
        follow_head_dim(config, overrides)


# The keys a head width is derived from: hidden_size // num_attention_heads (Llama, Mistral, Qwen3, ...).
HEAD_SHAPE_KEYS = ("hidden_size", "num_attention_heads")


def _derived_head_dim(config) -> bool:
    """Whether ``config`` holds a ``head_dim`` that is its width over its head count, as the configs that derive it
    at init store it (Llama's), rather than a width of its own (Gemma's 256 over 3072 / 16). A ``head_dim`` that is
    a property of the config class (Falcon's) is not stored: it follows the width and head count itself, and cannot
    be set."""
    if "head_dim" not in vars(config):
        return False
    head_dim, width, heads = (getattr(config, key, None) for key in ("head_dim", *HEAD_SHAPE_KEYS))
    return (
        all(isinstance(value, int) for value in (head_dim, width, heads)) and heads > 0 and head_dim == width // heads
    )


def follow_head_dim(config, overrides: str) -> None:
    """``config.head_dim`` set again from the overridden width and head count: a config that derived it at init keeps
    the old value otherwise (Llama's 128 under ``hidden_size=256,num_attention_heads=4``, where 64 is meant). A width
    the head count does not divide is a RecipeError: no head width follows from it."""
    width, heads = config.hidden_size, config.num_attention_heads
    if heads < 1 or width % heads:
        raise RecipeError(
            f"--config_overrides {overrides!r}: hidden_size {width} is not a multiple of num_attention_heads {heads}, "
            "so no head width follows from them: change one, or set head_dim too."
        )
    config.head_dim = width // heads
    logger.info("--config_overrides: head_dim = hidden_size / num_attention_heads = %d", config.head_dim)


def model_class_for(config, task: Task):
    """The transformers class of the task's head for ``config``'s model type (``load_config`` checked it has one)."""
    import transformers

    return getattr(transformers, task.model_classes()[config.model_type])


def build_skeleton(config, task: Task, what: str):
    """The task's model built from ``config`` on the meta device (no weights, no memory); a config the model refuses
    (a width its head count does not divide, an unknown activation, ...) is a RecipeError naming ``what``."""
    model_class = model_class_for(config, task)
    try:
        with torch.device("meta"):
            return model_class(config)
    except Exception as error:  # the model classes raise ValueError, KeyError, RuntimeError, ... on a bad config
        raise RecipeError(
            f"{model_class.__name__} cannot be built {what}: {type(error).__name__}: {error} Change those values."
        ) from None


def patch_record_of(config, source: str | None = None) -> hf_neural_attn.PatchRecord | None:
    """The patch record a checkpoint's config carries (it was saved by a patched run), or None; ``source``: the
    folder or Hub repo whose config.json it was read from, which a damaged record's message names."""
    try:
        return hf_neural_attn.PatchRecord.of(config, source=source, filename="config.json" if source else None)
    except ValueError as error:
        raise RecipeError(str(error)) from error


def describe_source(args: argparse.Namespace) -> str:
    if args.model_name_or_path:
        return args.model_name_or_path
    if args.config_name:
        return f"config {args.config_name} (from scratch)"
    if args.model_type:
        return f"model type {args.model_type} (from scratch)"
    return get_task(args.task).embedded_source(args)


def check_patch(args: argparse.Namespace) -> None:
    """Whether the run's config (its ``--config_overrides``) and patch fit its model (a ``key_dim`` on a family
    without it, an out-of-range layer), found before anything trains: the model's skeleton is built from its config
    on the meta device (no weights, no memory) and patched there. A sweep checks every run this way before the first
    one starts."""
    quiet.import_quietly()  # building the skeleton imports transformers' model code
    task = get_task(args.task)
    config = load_config(args, task)
    if args.scorer == BASELINE:
        return
    skeleton = build_skeleton(config, task, f"from {describe_source(args)}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the run itself shows the patch's warnings
            hf_neural_attn.patch_model(skeleton, args.scorer, layers=args.layers, **scorer_options(args))
    except (TypeError, ValueError) as error:
        raise RecipeError(f"Cannot patch {type(skeleton).__name__} with --scorer {args.scorer}: {error}") from error


def build_model(
    args: argparse.Namespace, task: Task, config, preprocessor, labels: dict[str, Any] | None
) -> ModelBundle:
    """Build or load the model for the task, patch it, and freeze what --train_only_new_params keeps."""
    model_class = model_class_for(config, task)
    task.configure_model(config, preprocessor, args, labels)

    bundle = ModelBundle(model=None, source=describe_source(args))
    path = args.model_name_or_path
    widening.check_widening(
        config, args.widen_mlp, from_scratch=path is None, quantized=qlora.quantization_config(args) is not None
    )
    if path is None:
        torch.manual_seed(args.seed)  # the from-scratch init depends on the seed only
        bundle.model = model_class(config)
        bundle.new_parameters = {name for name, _ in bundle.model.named_parameters()}
    else:
        bundle.from_scratch = False
        bundle.base_model = None if os.path.isdir(path) else path
        bundle.model, bundle.new_parameters = _load_pretrained(model_class, path, config, args)
        qlora.check_quantized(bundle.model, args)
        qlora.keep_4bit_trainable(bundle.model, args)

    model = bundle.model
    bundle.new_parameters |= task.adapt_model(model, preprocessor)
    if args.widen_mlp:
        bundle.widened_parameters = widening.widen_mlp(model, args.widen_mlp)

    if args.scorer != BASELINE:
        try:
            # The scorers' init depends on the seed only, not on what building the base drew before (a new head,
            # resized embeddings, DeepSpeed ZeRO-3's partitioned construction, which draws every weight before
            # loading it): a run under ZeRO-3 starts from the scorers of the same run under DDP. A stream of its
            # own, so that the scorers do not repeat the draws of a model built from scratch with --seed.
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(zlib.crc32(f"{args.seed}:scorers".encode()))
                hf_neural_attn.patch_model(model, args.scorer, layers=args.layers, **scorer_options(args))
        except (TypeError, ValueError) as error:
            raise RecipeError(f"Cannot patch {type(model).__name__} with --scorer {args.scorer}: {error}") from error
    if hf_neural_attn.is_patched(model):
        bundle.patch = hf_neural_attn.patch_record(model)
    else:
        for flag, given in (
            ("--train_only_new_params", args.train_only_new_params),
            ("--scorer_learning_rate", args.scorer_learning_rate is not None),
            *((f"--{FLAG_FOR_OPTION.get(option, option)}", True) for option in runtime_options(args)),
        ):
            if given:
                raise RecipeError(
                    f"{flag} needs a patch: pass --scorer {example_scorers()}, or a patched checkpoint as "
                    "--model_name_or_path (with --scorer none)."
                )

    # A quantized base: every weight frozen and the float ones in float32, as PEFT prepares one for training.
    model = bundle.model = qlora.prepare_quantized(model, args)
    if args.train_only_new_params:
        if bundle.from_scratch:
            raise RecipeError(
                "--train_only_new_params freezes pretrained weights, but this model is built from scratch: "
                "pass --model_name_or_path."
            )
        trainable = set(hf_neural_attn.scorer_parameters(model)) | bundle.new_parameters
        for name, parameter in model.named_parameters():
            parameter.requires_grad_(name in trainable)
    # --lora_r: the model trains through PEFT's wrapper (LoRA, the scorers and a new head in full).
    bundle.model = qlora.add_lora(model, args, bundle.new_parameters)
    return bundle


def _load_pretrained(model_class, path: str, config, args: argparse.Namespace):
    """Load pretrained weights into the task's class; returns the model and its freshly initialised names."""
    config.architectures = [model_class.__name__]
    kwargs = {"dtype": torch.float32, "ignore_mismatched_sizes": args.ignore_mismatched_sizes}
    quantization = qlora.quantization_config(args)
    if quantization is not None:
        kwargs["quantization_config"] = quantization
    try:
        if patch_record_of(config, source=path) is not None:
            # A checkpoint of a patched run: reload it with its patch and scorer weights.
            # Run-time options (--impl) are not in the record: they are the run's, given again each time.
            model = hf_neural_attn.from_pretrained(path, config=config, **runtime_options(args), **kwargs)
            saved = _checkpoint_keys(path)
            new = {name for name in model.state_dict() if name not in saved}
        else:
            model, info = model_class.from_pretrained(path, config=config, output_loading_info=True, **kwargs)
            new = set(info.get("missing_keys", ())) | {
                str(key[0]) if isinstance(key, tuple) else str(key) for key in info.get("mismatched_keys", ())
            }
    except RecipeError:
        raise
    except Exception as error:
        raise RecipeError(f"Could not load {model_class.__name__} weights from {path!r}: {error}") from error
    if new:
        logger.info("Newly initialised parameters (not in %s): %s", path, sorted(new))
    return model, new


def _checkpoint_keys(path: str) -> set[str]:
    """Tensor names stored in a checkpoint's safetensors file(s)."""
    import json

    from safetensors import safe_open
    from transformers.utils import cached_file

    index = cached_file(path, "model.safetensors.index.json", _raise_exceptions_for_missing_entries=False)
    if index is not None:
        with open(index) as handle:
            return set(json.load(handle)["weight_map"])
    weights = cached_file(path, "model.safetensors")
    with safe_open(weights, framework="pt") as handle:
        return set(handle.keys())


def count_parameters(model, widened: int = 0) -> dict[str, int]:
    """total, trainable, added_by_patch (the scorers'), added (those and ``widened``: --widen_mlp's)."""

    def numel(parameter) -> int:  # DeepSpeed ZeRO-3 leaves each process an empty placeholder of the whole tensor
        return hf_neural_attn.full_shape(parameter).numel()

    total = sum(numel(p) for p in model.parameters())
    trainable = sum(numel(p) for p in model.parameters() if p.requires_grad)
    added = sum(numel(p) for p in qlora.patch_parameters(model).values())
    return {"total": total, "trainable": trainable, "added_by_patch": added, "added": added + widened}
