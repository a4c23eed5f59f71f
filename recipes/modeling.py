"""Building the model, its tokenizer or image processor, and the attention patch.

Where the model comes from:

* ``--model_name_or_path``: a pretrained model (Hub id or folder). A folder written by a patched run
  (``hf_neural_attn`` record in its config) is reloaded with its patch and scorer weights.
* ``--config_name`` / ``--model_type`` (+ ``--config_overrides``): a model built from scratch.
* none of them: the *embedded* model, a small GPT-2-shaped (text) or ViT (image) config built here, with
  the byte-level ``ByT5Tokenizer`` for text: nothing is downloaded.
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

from .args import GLUE_TASKS, RecipeError, scorer_options

logger = logging.getLogger(__name__)

# The embedded defaults: small enough to train on two CPU cores in a minute or two.
EMBEDDED_TEXT_CONFIG = {
    "n_layer": 4,
    "n_head": 4,
    "n_embd": 128,
    "resid_pdrop": 0.1,
    "embd_pdrop": 0.1,
    "attn_pdrop": 0.1,
}
EMBEDDED_BLOCK_SIZE = 128
EMBEDDED_IMAGE_CONFIG = {
    "image_size": 32,
    "patch_size": 4,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "intermediate_size": 128,
}
EMBEDDED_NAME = "embedded (built from a config here, byte-level ByT5Tokenizer)"
EMBEDDED_IMAGE_NAME = "embedded (a small ViT built from a config here)"


@dataclass
class ModelBundle:
    model: Any
    source: str = EMBEDDED_NAME  # where the weights came from, for logs and the model card
    base_model: str | None = None  # Hub id of the pretrained model, for the model card
    from_scratch: bool = True
    new_parameters: set[str] = field(default_factory=set)  # names of parameters initialised in this run
    patch: hf_neural_attn.PatchRecord | None = None  # the model's patch (hf_neural_attn.patch_record), None: baseline


def task_head(task: str) -> tuple[dict[str, str], str]:
    """The transformers model-type -> class mapping a task needs, and its name for messages."""
    from transformers.models.auto import modeling_auto

    if task == "clm":
        return modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, "a causal language-modeling head"
    if task in GLUE_TASKS:
        return modeling_auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES, "a sequence-classification head"
    return modeling_auto.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES, "an image-classification head"


def load_config(args: argparse.Namespace):
    """The model config, checked against the task, before any weights or data are loaded."""
    from transformers import CONFIG_MAPPING, AutoConfig, GPT2Config, ViTConfig

    is_image = args.task == "image"
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
    elif is_image:
        config = ViTConfig(**EMBEDDED_IMAGE_CONFIG)
    else:
        config = GPT2Config(**EMBEDDED_TEXT_CONFIG, n_positions=args.block_size or EMBEDDED_BLOCK_SIZE)
    if args.config_overrides:
        apply_config_overrides(config, args.config_overrides)

    mapping, head = task_head(args.task)
    if config.model_type not in mapping:
        raise RecipeError(
            f"The model ({config.model_type}, from {describe_source(args)}) cannot take --task {args.task}: "
            f"transformers has no {head} for model type {config.model_type!r}. "
            + ("Use a ViT-style image model." if is_image else "Use a decoder such as gpt2 or llama.")
        )
    if args.config_overrides:  # the model's own checks of the overridden values, before any data or weights load
        build_skeleton(copy.deepcopy(config), args.task, f"with --config_overrides {args.config_overrides!r}")
    record = patch_record_of(config)
    if record is not None and args.scorer != "none":
        raise RecipeError(
            f"{args.model_name_or_path} is already patched (scorer {record.scorer!r}, layers {list(record.layers)}). "
            "Pass --scorer none to keep training it with its patch."
        )
    return config


def apply_config_overrides(config, overrides: str) -> None:
    """``--config_overrides "n_layer=8,attn_pdrop=0.1"`` onto ``config``: an item that is not key=value, a key the
    config does not have, a value of the wrong type, and a dropout probability (a numeric key with ``drop`` in its
    name: attn_pdrop, hidden_dropout_prob, layerdrop, drop_path_rate, ...) outside [0, 1] are RecipeErrors."""
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


def build_skeleton(config, task: str, what: str):
    """The task's model built from ``config`` on the meta device (no weights, no memory); a config the model refuses
    (a width its head count does not divide, an unknown activation, ...) is a RecipeError naming ``what``."""
    import transformers

    mapping, _ = task_head(task)
    model_class = getattr(transformers, mapping[config.model_type])
    try:
        with torch.device("meta"):
            return model_class(config)
    except Exception as error:  # the model classes raise ValueError, KeyError, RuntimeError, ... on a bad config
        raise RecipeError(
            f"{model_class.__name__} cannot be built {what}: {type(error).__name__}: {error} Change those values."
        ) from None


def patch_record_of(config) -> hf_neural_attn.PatchRecord | None:
    """The patch record a checkpoint's config carries (it was saved by a patched run), or None."""
    try:
        return hf_neural_attn.PatchRecord.of(config)
    except ValueError as error:
        raise RecipeError(str(error)) from error


def describe_source(args: argparse.Namespace) -> str:
    if args.model_name_or_path:
        return args.model_name_or_path
    if args.config_name:
        return f"config {args.config_name} (from scratch)"
    if args.model_type:
        return f"model type {args.model_type} (from scratch)"
    if args.task == "image":
        return EMBEDDED_IMAGE_NAME
    if args.tokenizer_name:
        return f"embedded (built from a config here, tokenizer {args.tokenizer_name})"
    return EMBEDDED_NAME


def load_tokenizer(args: argparse.Namespace):
    """The tokenizer: --tokenizer_name, the model's, or the byte-level ByT5Tokenizer (no download)."""
    from transformers import AutoTokenizer, ByT5Tokenizer

    name = args.tokenizer_name or args.model_name_or_path
    if name is None:
        if args.model_type or args.config_name:
            built = f"--model_type {args.model_type}" if args.model_type else f"--config_name {args.config_name}"
            why = f"the model is built from scratch ({built}) without a tokenizer of its own"
        else:
            why = "the model is the embedded one"
        logger.info(
            "Tokenizer: the byte-level ByT5Tokenizer, as --tokenizer_name is not given and %s; pass "
            "--tokenizer_name (e.g. gpt2) for another.",
            why,
        )
        return ByT5Tokenizer()
    try:
        tokenizer = AutoTokenizer.from_pretrained(name)
    except Exception as error:
        raise RecipeError(f"Could not load a tokenizer from {name!r}: {error}") from error
    logger.info(
        "Tokenizer: %s from %s (%s)",
        type(tokenizer).__name__,
        name,
        "--tokenizer_name" if args.tokenizer_name else "the model's own, --model_name_or_path",
    )
    if tokenizer.pad_token is None:
        # The standard Hugging Face way for decoders without a pad token (GPT-2, Llama).
        if tokenizer.eos_token is None:
            raise RecipeError(f"The tokenizer of {name!r} has neither a pad nor an eos token to pad with.")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_image_processor(args: argparse.Namespace, config):
    """The image processor: --image_processor_name, the model's, or a ViT processor at the config's size."""
    import transformers

    name = args.image_processor_name or args.model_name_or_path
    if name is not None:
        try:
            return transformers.AutoImageProcessor.from_pretrained(name)
        except Exception as error:
            raise RecipeError(f"Could not load an image processor from {name!r}: {error}") from error
    size = {"height": config.image_size, "width": config.image_size}
    try:
        import torchvision  # noqa: F401

        return transformers.ViTImageProcessor(size=size)
    except ImportError:
        return transformers.ViTImageProcessorPil(size=size)


def prepare_text_config(config, tokenizer, args: argparse.Namespace, labels: dict[str, Any] | None) -> None:
    """Fit the config to the tokenizer (from-scratch models) and to the task's labels (GLUE)."""
    from_scratch = args.model_name_or_path is None
    if from_scratch:
        overridden = set(_override_keys(args.config_overrides))
        if "vocab_size" not in overridden:
            config.vocab_size = len(tokenizer)
        eos = tokenizer.eos_token_id
        for name, value in (("bos_token_id", tokenizer.bos_token_id or eos), ("eos_token_id", eos)):
            if name not in overridden and hasattr(config, name):
                setattr(config, name, value)
    if labels is not None:
        config.num_labels = labels["num_labels"]
        config.problem_type = "regression" if labels["regression"] else "single_label_classification"
        if not labels["regression"]:
            config.id2label = dict(enumerate(labels["names"]))
            config.label2id = {name: index for index, name in enumerate(labels["names"])}
        config.pad_token_id = tokenizer.pad_token_id


def _override_keys(overrides: str | None) -> list[str]:
    return [item.split("=", 1)[0].strip() for item in (overrides or "").split(",") if "=" in item]


def check_patch(args: argparse.Namespace) -> None:
    """Whether the run's config (its ``--config_overrides``) and patch fit its model (a ``key_dim`` on a family
    without it, an out-of-range layer), found before anything trains: the model's skeleton is built from its config
    on the meta device (no weights, no memory) and patched there. A sweep checks every run this way before the first
    one starts."""
    config = load_config(args)
    if args.scorer == "none":
        return
    skeleton = build_skeleton(config, args.task, f"from {describe_source(args)}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the run itself shows the patch's warnings
            hf_neural_attn.patch_model(skeleton, args.scorer, layers=args.layers, **scorer_options(args))
    except (TypeError, ValueError) as error:
        raise RecipeError(f"Cannot patch {type(skeleton).__name__} with --scorer {args.scorer}: {error}") from error


def build_model(args: argparse.Namespace, config, preprocessor, labels: dict[str, Any] | None) -> ModelBundle:
    """Build or load the model for the task, patch it, and freeze what --train_only_new_params keeps."""
    import transformers

    mapping, _ = task_head(args.task)
    model_class = getattr(transformers, mapping[config.model_type])
    is_image = args.task == "image"
    if is_image:
        if labels is not None:
            config.num_labels = labels["num_labels"]
            config.id2label = dict(enumerate(labels["names"]))
            config.label2id = {name: index for index, name in enumerate(labels["names"])}
    else:
        prepare_text_config(config, preprocessor, args, labels if args.task != "clm" else None)

    bundle = ModelBundle(model=None, source=describe_source(args))
    path = args.model_name_or_path
    if path is None:
        torch.manual_seed(args.seed)  # the from-scratch init depends on the seed only
        bundle.model = model_class(config)
        bundle.new_parameters = {name for name, _ in bundle.model.named_parameters()}
    else:
        bundle.from_scratch = False
        bundle.base_model = None if os.path.isdir(path) else path
        bundle.model, bundle.new_parameters = _load_pretrained(model_class, path, config, args)

    model = bundle.model
    if not is_image:
        embeddings = model.get_input_embeddings().weight.shape[0]
        if len(preprocessor) > embeddings:
            model.resize_token_embeddings(len(preprocessor))
            # The resized matrices have new rows to learn: they stay trainable under --train_only_new_params.
            resized = [model.get_input_embeddings(), model.get_output_embeddings()]
            resized_weights = {id(module.weight) for module in resized if module is not None}
            bundle.new_parameters |= {name for name, p in model.named_parameters() if id(p) in resized_weights}

    if args.scorer != "none":
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
        ):
            if given:
                raise RecipeError(
                    f"{flag} needs a patch: pass --scorer qana or neural, or a patched checkpoint as "
                    "--model_name_or_path (with --scorer none)."
                )

    if args.train_only_new_params:
        if bundle.from_scratch:
            raise RecipeError(
                "--train_only_new_params freezes pretrained weights, but this model is built from scratch: "
                "pass --model_name_or_path."
            )
        trainable = set(hf_neural_attn.scorer_parameters(model)) | bundle.new_parameters
        for name, parameter in model.named_parameters():
            parameter.requires_grad_(name in trainable)
    return bundle


def _load_pretrained(model_class, path: str, config, args: argparse.Namespace):
    """Load pretrained weights into the task's class; returns the model and its freshly initialised names."""
    config.architectures = [model_class.__name__]
    kwargs = {"dtype": torch.float32, "ignore_mismatched_sizes": args.ignore_mismatched_sizes}
    try:
        if patch_record_of(config) is not None:
            # A checkpoint of a patched run: reload it with its patch and scorer weights.
            model = hf_neural_attn.from_pretrained(path, config=config, **kwargs)
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


def count_parameters(model) -> dict[str, int]:
    def numel(parameter) -> int:  # DeepSpeed ZeRO-3 leaves each process an empty placeholder of the whole tensor
        return getattr(parameter, "ds_numel", parameter.numel())

    total = sum(numel(p) for p in model.parameters())
    trainable = sum(numel(p) for p in model.parameters() if p.requires_grad)
    added = sum(numel(p) for p in hf_neural_attn.scorer_parameters(model).values())
    return {"total": total, "trainable": trainable, "added_by_patch": added}
