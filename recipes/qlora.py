"""A quantized base and LoRA for the recipes: QLoRA with the scorers.

The flags are those of Hugging Face's scripts (TRL's ``ModelConfig``): ``--load_in_4bit`` / ``--load_in_8bit`` with
``--bnb_4bit_quant_type``, ``--bnb_4bit_use_double_quant`` and ``--bnb_4bit_compute_dtype`` for bitsandbytes,
``--torchao`` for torchao's weight-only and dynamic schemes, and ``--lora_r`` (LoRA on, its rank), ``--lora_alpha``,
``--lora_dropout``, ``--lora_target_modules``. How a run uses them:

1. the pretrained base loads quantized (:func:`quantization_config`);
2. the task's head and the patch go on as for any run;
3. a quantized base is prepared as PEFT prepares one for k-bit training (``prepare_model_for_kbit_training``: every
   weight frozen, float parameters in float32);
4. with ``--lora_r``, LoRA wraps the projections and the scorers (and a newly initialised head) train in full as
   PEFT's ``modules_to_save`` (:func:`add_lora`); without it, ``--train_only_new_params`` trains the scorers alone.

A quantized base cannot be fine-tuned in full (its integer weights take no gradient): such a run needs ``--lora_r``
or ``--train_only_new_params``, which :func:`check_args` says before anything loads. The output of a LoRA run is
PEFT's adapter (the LoRA matrices and the trained scorers); its card says how to load it onto the patched base.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

import hf_neural_attn
from recipes import quiet
from recipes.errors import RecipeError

INSTALL = "pip install 'hf-neural-attn[quantization]'"
BNB_4BIT_QUANT_TYPES = ("nf4", "fp4")
COMPUTE_DTYPES = ("float32", "bfloat16", "float16")
# --torchao: the scheme's name -> (torchao config class, its options). int4 weight-only is torchao's Intx config,
# which runs on the CPU as on CUDA (its Int4WeightOnlyConfig packs for CUDA kernels only).
TORCHAO_SCHEMES: dict[str, tuple[str, dict[str, Any]]] = {
    "int8_weight_only": ("Int8WeightOnlyConfig", {}),
    "int4_weight_only": ("IntxWeightOnlyConfig", {"weight_dtype": torch.int4}),
    "int8_dynamic": ("Int8DynamicActivationInt8WeightConfig", {}),
}
# Schemes that quantize the activations too: their layers pass no gradient to their input, so nothing before them
# trains (check_args refuses them; the library loads, patches and serves them).
INFERENCE_ONLY_SCHEMES = ("int8_dynamic",)
DEFAULT_LORA_TARGETS = "all-linear"
# The defaults of the 4-bit and LoRA options, declared once: the flags take them, and check_args reads a value other
# than these as the option asked for.
BNB_4BIT_DEFAULTS: dict[str, Any] = {
    "bnb_4bit_quant_type": "nf4",
    "bnb_4bit_use_double_quant": False,
    "bnb_4bit_compute_dtype": "float32",
}
LORA_DEFAULTS: dict[str, Any] = {"lora_alpha": None, "lora_dropout": 0.05, "lora_target_modules": DEFAULT_LORA_TARGETS}
QUANTIZERS = ("bitsandbytes", "torchao")  # the packages whose tensor classes hold a quantized base's weights
# A training-state checkpoint's torchao-quantized weights, beside accelerate's model.safetensors
# (set_aside_torchao_weights).
TORCHAO_WEIGHTS_STEM = "torchao_weights"
TORCHAO_WEIGHTS = f"{TORCHAO_WEIGHTS_STEM}.safetensors"
# The settings that shape the base and what trains: a resumed run must share them (recipes.training.resume_settings).
QLORA_SETTINGS = (
    "load_in_4bit",
    "load_in_8bit",
    "bnb_4bit_quant_type",
    "bnb_4bit_use_double_quant",
    "bnb_4bit_compute_dtype",
    "torchao",
    "lora_r",
    "lora_alpha",
    "lora_dropout",
    "lora_target_modules",
)


@dataclass(frozen=True)
class Quantization:
    """How the pretrained base loads quantized: read once from the flags (or a run's recorded settings) by
    :meth:`of`, which every question about it then asks (which library, which flag asked, the loading config, the
    words for logs and cards, whether it can train)."""

    library: str  # "bitsandbytes" or "torchao"
    scheme: str  # "4bit" or "8bit" (bitsandbytes), or a TORCHAO_SCHEMES name
    quant_type: str = BNB_4BIT_DEFAULTS["bnb_4bit_quant_type"]  # 4-bit only, as the three below
    double_quant: bool = BNB_4BIT_DEFAULTS["bnb_4bit_use_double_quant"]
    compute_dtype: str = BNB_4BIT_DEFAULTS["bnb_4bit_compute_dtype"]

    @classmethod
    def of(cls, settings: argparse.Namespace | Mapping[str, Any]) -> Quantization | None:
        """The quantization ``settings`` ask for (parsed flags, or a run's settings dict), or None for a full
        precision base. Two at once is a RecipeError."""
        values = vars(settings) if isinstance(settings, argparse.Namespace) else settings
        four_bit, eight_bit, torchao = (values.get(k) for k in ("load_in_4bit", "load_in_8bit", "torchao"))
        if four_bit and eight_bit:
            raise RecipeError("Give --load_in_4bit or --load_in_8bit, not both.")
        if torchao and (four_bit or eight_bit):
            raise RecipeError("Quantize with bitsandbytes (--load_in_4bit/--load_in_8bit) or --torchao, not both.")
        if torchao:
            return cls("torchao", torchao)
        if eight_bit:
            return cls("bitsandbytes", "8bit")
        if four_bit:
            options = {key: values.get(key, default) for key, default in BNB_4BIT_DEFAULTS.items()}
            return cls("bitsandbytes", "4bit", *options.values())
        return None

    @property
    def flag(self) -> str:
        """The flag that asked for it, for messages: ``load_in_4bit``, ``torchao int8_dynamic``."""
        return f"torchao {self.scheme}" if self.library == "torchao" else f"load_in_{self.scheme}"

    @property
    def trains(self) -> bool:
        """Whether gradients pass its layers (torchao's dynamic schemes quantize the activations too)."""
        return self.scheme not in INFERENCE_ONLY_SCHEMES

    def loading_config(self):
        """The ``quantization_config`` of ``from_pretrained``. A missing library is a RecipeError with the install
        command."""
        try:
            __import__(self.library)
        except ImportError:
            raise RecipeError(f"--{self.flag} needs {self.library}: {INSTALL}") from None
        if self.library == "torchao":
            import torchao.quantization
            from transformers import TorchAoConfig

            name, options = TORCHAO_SCHEMES[self.scheme]
            return TorchAoConfig(getattr(torchao.quantization, name)(**options))
        from transformers import BitsAndBytesConfig

        if self.scheme == "8bit":
            return BitsAndBytesConfig(load_in_8bit=True)
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=self.quant_type,
            bnb_4bit_use_double_quant=self.double_quant,
            bnb_4bit_compute_dtype=getattr(torch, self.compute_dtype),
        )

    @property
    def hub_tags(self) -> list[str]:
        """The Hub's tags for a base quantized so (the ones it shows for such repos)."""
        return ["torchao"] if self.library == "torchao" else ["bitsandbytes", self.scheme.replace("bit", "-bit")]

    def loading_snippet(self) -> tuple[list[str], list[str], str]:
        """What loads a base quantized so, for a model card's loading code: the import lines beside transformers',
        the names imported from transformers, and the ``quantization_config`` expression."""
        if self.library == "torchao":
            name, options = TORCHAO_SCHEMES[self.scheme]
            arguments = ", ".join(f"{key}={_code(value)}" for key, value in options.items())
            imports = [f"from torchao.quantization import {name}"] + (["import torch"] if "torch." in arguments else [])
            return imports, ["TorchAoConfig"], f"TorchAoConfig({name}({arguments}))"
        if self.scheme == "8bit":
            return [], ["BitsAndBytesConfig"], "BitsAndBytesConfig(load_in_8bit=True)"
        arguments = (
            f'load_in_4bit=True, bnb_4bit_quant_type="{self.quant_type}", '
            f"bnb_4bit_use_double_quant={bool(self.double_quant)}, bnb_4bit_compute_dtype=torch.{self.compute_dtype}"
        )
        return ["import torch"], ["BitsAndBytesConfig"], f"BitsAndBytesConfig({arguments})"

    def describe(self) -> str:
        """In words, for logs and the model card."""
        if self.library == "torchao":
            return f"torchao {self.scheme.replace('_', '-')}"
        if self.scheme == "8bit":
            return "bitsandbytes 8-bit (LLM.int8)"
        double = ", double quantization" if self.double_quant else ""
        return f"bitsandbytes 4-bit {str(self.quant_type).upper()}{double}, matmuls in {self.compute_dtype}"


def declare_flags(add: Callable[..., Any]) -> None:
    """The quantization and LoRA flags (``add`` is argparse's ``add_argument`` of the flag group)."""
    add("--load_in_4bit", action="store_true", help="Load the pretrained base in 4-bit with bitsandbytes (QLoRA).")
    add("--load_in_8bit", action="store_true", help="Load the pretrained base in 8-bit with bitsandbytes (LLM.int8).")
    add(
        "--bnb_4bit_quant_type",
        type=str,
        default=BNB_4BIT_DEFAULTS["bnb_4bit_quant_type"],
        choices=BNB_4BIT_QUANT_TYPES,
        help="4-bit data type.",
    )
    add(
        "--bnb_4bit_use_double_quant",
        action="store_true",
        help="4-bit: quantize the quantization constants too (about 0.4 bits per weight less).",
    )
    add(
        "--bnb_4bit_compute_dtype",
        type=str,
        default=BNB_4BIT_DEFAULTS["bnb_4bit_compute_dtype"],
        choices=COMPUTE_DTYPES,
        help="4-bit: the dtype its matmuls run in (the activations and the scorers keep the model's float32).",
    )
    add(
        "--torchao",
        type=str,
        default=None,
        choices=tuple(TORCHAO_SCHEMES),
        help="Load the pretrained base quantized by torchao with this scheme (its nn.Linear layers). int8_dynamic "
        "quantizes the activations too, which passes no gradient: refused for training (an inference scheme).",
    )
    add("--lora_r", type=int, default=None, help="Train LoRA adapters of this rank beside the scorers (QLoRA).")
    add(
        "--lora_alpha",
        type=int,
        default=LORA_DEFAULTS["lora_alpha"],
        help="LoRA scaling alpha (default: 2 x --lora_r).",
    )
    add(
        "--lora_dropout", type=float, default=LORA_DEFAULTS["lora_dropout"], help="Dropout on the LoRA adapters' input."
    )
    add(
        "--lora_target_modules",
        type=str,
        default=LORA_DEFAULTS["lora_target_modules"],
        help='The layers LoRA adapts: "all-linear" (default: every linear layer but the output head), or '
        'comma-separated module names such as "q_proj,v_proj" (GPT-2: "c_attn").',
    )


def quantizes(args: argparse.Namespace) -> bool:
    return Quantization.of(args) is not None


def check_args(args: argparse.Namespace) -> None:
    """The quantization and LoRA flags fit each other and the run (no model or data needed)."""
    quantization = Quantization.of(args)
    four_bit_options = [flag for flag, default in BNB_4BIT_DEFAULTS.items() if getattr(args, flag) != default]
    if four_bit_options and (quantization is None or quantization.scheme != "4bit"):
        raise RecipeError(f"--{four_bit_options[0]} sets up 4-bit loading: add --load_in_4bit.")
    if args.lora_r is None:
        lora_options = [flag for flag, default in LORA_DEFAULTS.items() if getattr(args, flag) != default]
        if lora_options:
            raise RecipeError(f"--{lora_options[0]} sets up LoRA: add --lora_r (the adapters' rank, e.g. 16).")
    else:
        if args.lora_r < 1 or (args.lora_alpha is not None and args.lora_alpha < 1):
            raise RecipeError("--lora_r and --lora_alpha must be at least 1.")
        if not 0 <= args.lora_dropout < 1:
            raise RecipeError(f"--lora_dropout must be in [0, 1), got {args.lora_dropout}.")
        if args.train_only_new_params:
            raise RecipeError(
                "--lora_r trains LoRA adapters beside the scorers, --train_only_new_params the scorers alone: give one."
            )
    if quantization is not None and not quantization.trains:
        raise RecipeError(
            f"--{quantization.flag} cannot train: torchao quantizes the activations of its layers at every call, "
            "and that quantization passes no gradient back, so nothing before a quantized layer learns (the scorers "
            "and the LoRA adapters of earlier layers get none; --train_only_new_params fails at the first step). "
            "Train with --torchao int8_weight_only or int4_weight_only; int8 dynamic quantization is for inference "
            "(docs/qlora.md)."
        )
    if quantization is not None:
        if not args.model_name_or_path:
            raise RecipeError(
                f"--{quantization.flag} quantizes a pretrained base: pass --model_name_or_path (a model built "
                "from scratch trains in full precision)."
            )
        if args.lora_r is None and not args.train_only_new_params:
            raise RecipeError(
                f"A base loaded with --{quantization.flag} cannot be fine-tuned in full (its quantized weights "
                "take no gradient): add --lora_r 16 (QLoRA: LoRA adapters and the scorers train) or "
                "--train_only_new_params (the scorers train)."
            )


def check_baseline(flags: dict[str, Any]) -> None:
    """The unpatched baseline of a run with ``flags`` (``recipes.compare``'s, a sweep's ``baseline: true``) has
    something to train: a scorer-only run on a quantized base trains the scorers alone, and without them the quantized
    base has nothing that takes a gradient."""
    quantization = Quantization.of(flags)
    if quantization is not None and flags.get("train_only_new_params") and flags.get("lora_r") is None:
        flag = quantization.flag
        raise RecipeError(
            f"--{flag} --train_only_new_params trains the scorers alone, and its unpatched baseline (--scorer none) "
            "would have nothing to train: no scorers, and quantized weights that take no gradient. Compare QLoRA runs "
            f"instead, --{flag} --lora_r 16 in place of --train_only_new_params (LoRA trains in both runs, the "
            f"scorers too in the patched one), or scorer-only runs on the full-precision base (drop --{flag.split()[0]})."
        )


def quantization_flag(args: argparse.Namespace) -> str:
    """The flag that asked for quantization, for messages."""
    return Quantization.of(args).flag


def quantization_config(args: argparse.Namespace):
    """The ``quantization_config`` the base loads with, or None (:meth:`Quantization.loading_config`)."""
    quantization = Quantization.of(args)
    return quantization.loading_config() if quantization is not None else None


def describe_quantization(settings: dict[str, Any]) -> str | None:
    """The base's quantization in words, from a run's settings (logs, the model card), or None."""
    quantization = Quantization.of(settings)
    return quantization.describe() if quantization is not None else None


def describe_lora(settings: dict[str, Any]) -> str | None:
    """The LoRA adapters in words, from a run's settings, or None."""
    if settings.get("lora_r") is None:
        return None
    alpha = settings.get("lora_alpha") or 2 * settings["lora_r"]
    return (
        f"r={settings['lora_r']}, alpha={alpha}, dropout={settings.get('lora_dropout')}, "
        f"on {settings.get('lora_target_modules')}"
    )


def check_quantized(model, args: argparse.Namespace) -> None:
    """A base loaded with quantization flags has quantized layers: torchao quantizes ``nn.Linear`` layers only, and
    some models have none where it matters (GPT-2's projections are ``Conv1D``): a run that silently trained a float
    model would mislead."""
    if not quantizes(args):
        return
    quantized = [name for name, module in model.named_modules() if _has_quantized_weight(module)]
    if not quantized:
        raise RecipeError(
            f"--{quantization_flag(args)} quantized no layer of {type(model).__name__}: torchao quantizes nn.Linear "
            "layers, and this model's projections are of another kind (GPT-2's are Conv1D). Use --load_in_4bit or "
            "--load_in_8bit (bitsandbytes converts them), or drop the flag."
        )


def keep_4bit_trainable(model, args: argparse.Namespace) -> None:
    """Turn bitsandbytes' CPU kernel off on a 4-bit base, right after it loads (``hf_neural_attn.keep_4bit_trainable``).

    On a CPU with AVX512-BF16 it would repack the 4-bit layers at the run's first evaluation (the scorer statistics
    at the start, --eval_steps): no gradient would pass them from then on, and a checkpoint after it would change the
    base (docs/qlora.md, "Known problems"). Off for every 4-bit run, patched or not; before the patch, which would do
    it too and say so."""
    quantization = Quantization.of(args)
    if quantization is not None and quantization.scheme == "4bit":
        hf_neural_attn.keep_4bit_trainable(model)


def _has_quantized_weight(module) -> bool:
    weight = getattr(module, "weight", None)
    return isinstance(weight, torch.Tensor) and (_quantizer(weight) is not None or not weight.is_floating_point())


def _quantizer(tensor) -> str | None:
    """``"bitsandbytes"`` or ``"torchao"`` for a tensor one of them quantized, by the package of its class (as the
    library's own check, which is not public API, reads it); None for anything else."""
    package = type(tensor).__module__.split(".", 1)[0] if isinstance(tensor, torch.Tensor) else None
    return package if package in QUANTIZERS else None


def prepare_quantized(model, args: argparse.Namespace):
    """PEFT's preparation of a quantized base for training (every weight frozen, float parameters in float32);
    gradient checkpointing is the recipe's own (non-reentrant), so not turned on here."""
    if not quantizes(args):
        return model
    from peft import prepare_model_for_kbit_training

    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)


def resume_load_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """How a resumed run loads a checkpoint's model weights (``accelerator.load_state``'s keywords). Over a quantized
    base, not strictly: bitsandbytes saves each 4-bit weight's quantization state beside it (``absmax``, ``quant_map``,
    ...), keys no parameter takes back. The base is frozen, and the resumed run loads it again from
    ``--model_name_or_path`` quantized the same way, so what it restores is unchanged; what trained (LoRA, the scorers)
    loads as usual."""
    return {"strict": False} if quantizes(args) else {}


def set_aside_torchao_weights(models: list, weights: list[dict[str, Any]], output_dir: str) -> None:
    """``accelerator.save_state`` pre-hook: move the torchao-quantized weights out of each model's state dict into
    :data:`TORCHAO_WEIGHTS` (``model_1`` and on: ``torchao_weights_1.safetensors``) in ``output_dir``, in torchao's own
    safetensors layout, the one transformers' ``save_pretrained`` writes for a torchao model: each weight's plain
    tensors (``<module>._weight_qdata``, ``..._scale``) and, in the file's metadata, what rebuilds it
    (``torchao.prototype.safetensors.unflatten_tensor_state_dict``).

    A torchao weight is a tensor subclass without a storage of its own, and Accelerate's safetensors writer asks every
    tensor for its storage to find shared ones ("Attempted to access the data pointer on an invalid python storage"),
    so the model's weights file holds everything else (:func:`safetensors_checkpoints`). A resumed run loads the frozen
    base quantized again from ``--model_name_or_path`` and restores what trained (:func:`resume_load_kwargs`); this
    file keeps the checkpoint a whole model."""
    from accelerate import PartialState

    for index, state in enumerate(weights):
        quantized = {name: tensor for name, tensor in state.items() if _quantizer(tensor) == "torchao"}
        if not quantized:
            continue
        for name in quantized:
            del state[name]
        if PartialState().is_main_process:
            from safetensors.torch import save_file
            from torchao.prototype.safetensors.safetensors_support import flatten_tensor_state_dict

            tensors, metadata = flatten_tensor_state_dict(quantized)
            suffix = f"_{index}" if index else ""
            save_file(tensors, os.path.join(output_dir, f"{TORCHAO_WEIGHTS_STEM}{suffix}.safetensors"), metadata)


def read_torchao_weights(checkpoint: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The torchao-quantized weights :func:`set_aside_torchao_weights` wrote into ``checkpoint`` (its model's, by the
    names of the model's state dict), rebuilt as the tensor subclasses they were; empty when it holds none. Anything
    in the file that torchao's layout does not account for comes back as it is, under its own name, not dropped."""
    path = os.path.join(checkpoint, TORCHAO_WEIGHTS)
    if not os.path.isfile(path):
        return {}
    from safetensors import safe_open
    from safetensors.torch import load_file
    from torchao.prototype.safetensors.safetensors_support import unflatten_tensor_state_dict

    with safe_open(path, "pt") as handle:
        metadata = handle.metadata()
    weights, left = unflatten_tensor_state_dict(load_file(path), metadata)
    return {**left, **weights}


def safetensors_checkpoints(args: argparse.Namespace) -> bool:
    """Whether a run's checkpoints hold the model's weights in ``model.safetensors`` (else ``pytorch_model.bin``): not
    over a torchao base. safetensors' loader, which ``accelerator.load_state`` reads that file with, looks for shared
    storage among the model's own tensors, and a torchao weight has no storage to look at; torch's loader does not
    look. The torchao weights themselves go to :data:`TORCHAO_WEIGHTS` either way (:func:`set_aside_torchao_weights`)."""
    quantization = Quantization.of(args)
    return quantization is None or quantization.library != "torchao"


def add_lora(model, args: argparse.Namespace, new_parameters: set[str]):
    """``model`` wrapped by PEFT with LoRA adapters (``--lora_r``), its scorers and the modules holding
    ``new_parameters`` (a newly initialised head) trained in full as ``modules_to_save``; ``model`` when no LoRA is
    asked for."""
    if args.lora_r is None:
        return model
    return wrap_with_lora(model, args, {name.rpartition(".")[0] for name in new_parameters if "." in name})


def wrap_with_lora(model, args: argparse.Namespace, new_modules: set[str]):
    """``model`` wrapped by PEFT as :func:`add_lora` wraps it, with ``new_modules`` (names of modules in ``model``)
    beside the scorers in ``modules_to_save``. ``args``: the ``--lora_*`` flags (``recipes.export`` rebuilds them from
    a checkpoint's settings)."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise RecipeError("--lora_r needs peft: pip install 'hf-neural-attn[peft]'") from None
    to_save = []
    if hf_neural_attn.is_patched(model):
        with quiet.filtered((quiet.UNPATCHED_BASE_MESSAGE,)):  # the card loads the adapter as the warning asks
            to_save = hf_neural_attn.peft_modules_to_save(model)
    to_save += sorted(new_modules - set(to_save))
    targets = args.lora_target_modules
    config = LoraConfig(
        r=args.lora_r,
        lora_alpha=args.lora_alpha or 2 * args.lora_r,
        lora_dropout=args.lora_dropout,
        target_modules=targets if targets == DEFAULT_LORA_TARGETS else [t.strip() for t in targets.split(",")],
        modules_to_save=to_save or None,
    )
    try:
        with quiet.filtered(quiet.PEFT_MESSAGES):
            return get_peft_model(model, config)
    except ValueError as error:  # no module matched the targets, say
        raise RecipeError(f"LoRA cannot wrap {type(model).__name__}: {error}") from error


def patch_parameters(model) -> dict[str, torch.nn.Parameter]:
    """The parameters the patch added, each once: under PEFT's ``modules_to_save`` a scorer is held twice, the copy
    that trains and the frozen original kept for the adapters' off switch; the originals are left out."""
    return {
        name: parameter
        for name, parameter in hf_neural_attn.scorer_parameters(model).items()
        if ".original_module." not in f".{name}"
    }


def hub_tags(settings: dict[str, Any]) -> list[str]:
    """The Hub's tags for a run's quantization and adapters (the ones it shows for such repos)."""
    quantization = Quantization.of(settings)
    return (["lora"] if settings.get("lora_r") is not None else []) + (quantization.hub_tags if quantization else [])


def quantization_snippet(settings: dict[str, Any]) -> tuple[list[str], list[str], str | None]:
    """What loads a base quantized as the run loaded it, for the model card's loading code
    (:meth:`Quantization.loading_snippet`; nothing, and a ``None`` expression, when the run did not quantize)."""
    quantization = Quantization.of(settings)
    return quantization.loading_snippet() if quantization is not None else ([], [], None)


def kernel_snippet(settings: dict[str, Any], variable: str) -> list[str]:
    """The card's line that runs a 4-bit base, the model in ``variable``, on the kernel the run ran it on
    (:func:`keep_4bit_trainable`); none for another run. On a CPU with AVX512-BF16 the loaded model would otherwise
    repack its layers for bitsandbytes' CPU kernel at its first evaluation: other outputs than the run's, and a model
    that no longer trains."""
    quantization = Quantization.of(settings)
    if quantization is None or quantization.scheme != "4bit":
        return []
    return [f"hf_neural_attn.keep_4bit_trainable({variable})  # bitsandbytes' CPU kernel off, as in the run"]


def _code(value: Any) -> str:
    return f"torch.{str(value).removeprefix('torch.')}" if isinstance(value, torch.dtype) else repr(value)


def transformers_model(model):
    """The transformers model inside PEFT's wrapper (or ``model`` itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model
