"""The image-classification task (``--task image``): CIFAR-10 by default, or folders of images, one per class.

Metric: ``accuracy``, through the local `evaluate` module ``recipes/metrics/accuracy``. Training images get a
random horizontal flip and a padded random crop, drawn per example from (seed, epoch, example index).
"""

from __future__ import annotations

import os
import zlib
from typing import Any

import torch
import torch.nn.functional as F

from recipes.errors import RecipeError
from recipes.tasks.base import (
    DataInfo,
    Task,
    TaskData,
    first_examples,
    load_data,
    load_local_metric,
    progress_bar,
    require_columns,
    split_off_validation,
)

DEFAULT_IMAGE_DATASET = "uoft-cs/cifar10"
IMAGE_DATASET_ALIASES = {"cifar10": "uoft-cs/cifar10", "cifar100": "uoft-cs/cifar100"}
# The embedded model, built when no model flag is given: a small ViT.
EMBEDDED_IMAGE_CONFIG = {
    "image_size": 32,
    "patch_size": 4,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "intermediate_size": 128,
}
EMBEDDED_IMAGE_NAME = "embedded (a small ViT built from a config here)"


class ImageTask(Task):
    kind = "image"
    primary_metric = "accuracy"
    pipeline_tag = "image-classification"
    hub_task_name = "Image Classification"
    dataset_label = "Image classification"
    head_mapping = "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES"
    head_description = "an image-classification head"
    head_hint = "Use a ViT-style image model."
    preprocessor_class = "AutoImageProcessor"
    preprocessor_noun = "processor"

    def check_args(self, args):
        if args.train_file or args.validation_file:
            raise RecipeError(
                "--task image reads images from --train_dir/--validation_dir (or --dataset_name), not files."
            )
        for name in ("train_dir", "validation_dir"):
            path = getattr(args, name)
            if path is not None and not os.path.isdir(path):
                raise RecipeError(f"--{name} {path} is not a folder.")
        if args.validation_dir and not args.train_dir:
            raise RecipeError("--validation_dir needs --train_dir too.")
        super().check_args(args)

    def embedded_config(self, args):
        from transformers import ViTConfig

        return ViTConfig(**EMBEDDED_IMAGE_CONFIG)

    def embedded_source(self, args):
        return EMBEDDED_IMAGE_NAME

    def load_preprocessor(self, args, config):
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

    def configure_model(self, config, processor, args, labels):
        if labels is not None:
            config.num_labels = labels["num_labels"]
            config.id2label = dict(enumerate(labels["names"]))
            config.label2id = {name: index for index, name in enumerate(labels["names"])}

    def load_raw(self, args):
        import datasets

        if args.train_dir:
            files = {"train": os.path.join(args.train_dir, "**")}
            if args.validation_dir:
                files["validation"] = os.path.join(args.validation_dir, "**")
            raw = load_data("imagefolder", data_files=files, what="image folders")
            self.info = DataInfo(
                "local image folders", files=[args.train_dir] + ([args.validation_dir] if args.validation_dir else [])
            )
        else:
            name = args.dataset_name or DEFAULT_IMAGE_DATASET
            name = IMAGE_DATASET_ALIASES.get(name, name)
            loaded = load_data(name, args.dataset_config_name)
            self.info = DataInfo(name, dataset_config=args.dataset_config_name, hub_dataset=True)
            eval_split = args.eval_split or (
                "validation" if "validation" in loaded else "test" if "test" in loaded else None
            )
            if eval_split is not None and eval_split not in loaded:
                raise RecipeError(f"--eval_split {eval_split!r}: {name} has splits {list(loaded)}.")
            raw = datasets.DatasetDict({"train": loaded["train"]})
            if eval_split:
                raw["validation"] = loaded[eval_split]
                self.info.eval_split = eval_split
        if "validation" not in raw:
            percentage = args.validation_split_percentage or 15
            raw, self.info.eval_split = split_off_validation(raw, percentage, args)
        return raw

    def check_raw(self, args, raw):
        import datasets

        features = raw["train"].features
        image = args.image_column_name
        if image is None:
            images = [name for name, feature in features.items() if isinstance(feature, datasets.Image)]
            image = "image" if "image" in features else (images[0] if images else "image")
        label = args.label_column_name
        if label is None:
            classes = [name for name, feature in features.items() if isinstance(feature, datasets.ClassLabel)]
            label = "label" if "label" in features else (classes[0] if classes else "label")
        require_columns(raw, {"image": image, "label": label}, ["train", "validation"])
        self.image_column, self.label_column = image, label
        feature = features[label]
        if isinstance(feature, datasets.ClassLabel):
            names = list(feature.names)
        else:
            values = set(raw["train"][label]) | set(raw["validation"][label])
            if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
                raise RecipeError(f"The label column {label!r} must hold class indices or class names (ClassLabel).")
            names = [str(i) for i in range(max(values) + 1)]
        return {"num_labels": len(names), "names": names, "regression": False, "to_id": None}

    def prepare(self, args, raw, processor, model_config, labels, accelerator):
        image_column, label_column = self.image_column, self.label_column
        size = model_config.image_size
        self.augment_padding = max(size // 8, 1)

        def transform(examples):
            images = [image.convert("RGB") for image in examples[image_column]]
            pixel_values = processor(images, return_tensors="pt")["pixel_values"]
            if pixel_values.shape[-1] != size or pixel_values.shape[-2] != size:
                raise RecipeError(
                    f"The image processor makes {tuple(pixel_values.shape[-2:])} images but the model expects "
                    f"{size}x{size}."
                )
            result = {"pixel_values": pixel_values, "labels": list(examples[label_column])}
            if "example_index" in examples:
                result["example_index"] = list(examples["example_index"])
            return result

        train = first_examples(raw["train"], args.max_train_samples)
        train = train.add_column("example_index", list(range(len(train))))
        train = train.with_transform(transform)
        validation = first_examples(raw["validation"], args.max_eval_samples).with_transform(transform)
        return TaskData(train, {"validation": validation}, collate_images, collate_images, self.info)

    def training_inputs(self, batch, epoch, args):
        """Random horizontal flip and padded random crop, drawn per example from (seed, epoch, example index):
        independent of the global RNG, of resuming and of the number of processes."""
        batch = dict(batch)
        indices = batch.pop("example_index")
        pixels = batch["pixel_values"]
        pad = self.augment_padding
        padded = F.pad(pixels, (pad, pad, pad, pad), mode="reflect")
        out = torch.empty_like(pixels)
        size_h, size_w = pixels.shape[-2:]
        for row, index in enumerate(indices.tolist()):
            generator = torch.Generator().manual_seed(zlib.crc32(f"{args.seed}/{epoch}/{index}".encode()))
            top, left = (int(v) for v in torch.randint(0, 2 * pad + 1, (2,), generator=generator))
            crop = padded[row, :, top : top + size_h, left : left + size_w]
            if torch.rand((), generator=generator) < 0.5:
                crop = crop.flip(-1)
            out[row] = crop
        batch["pixel_values"] = out
        return batch

    def evaluate(self, model, dataloaders, accelerator, args, progress=True):
        model.eval()
        (dataloader,) = dataloaders.values()
        metric = load_local_metric("accuracy")
        with torch.no_grad():
            for batch in progress_bar(dataloader, accelerator, "Evaluating", progress):
                batch = {k: v for k, v in batch.items() if k != "example_index"}
                predictions = model(pixel_values=batch["pixel_values"]).logits.argmax(dim=-1)
                predictions, references = accelerator.gather_for_metrics((predictions, batch["labels"]))
                metric.add_batch(predictions=predictions.cpu().numpy(), references=references.cpu().numpy())
        model.train()
        return metric.compute()


def collate_images(examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    batch = {
        "pixel_values": torch.stack([example["pixel_values"] for example in examples]),
        "labels": torch.tensor([example["labels"] for example in examples], dtype=torch.long),
    }
    if "example_index" in examples[0]:
        batch["example_index"] = torch.tensor([example["example_index"] for example in examples], dtype=torch.long)
    return batch
