"""tiny-shakespeare at the character level, as nanoGPT's ``shakespeare_char`` example prepares it (``--dataset_name
tinyshakespeare``, task clm): the public reference the recipes reproduce (docs/experiments.md).

* The text: ``recipes/data/tinyshakespeare.txt``, karpathy/char-rnn's ``input.txt`` (1,115,394 characters; its
  provenance and checksum in ``recipes/data/README.md``), shipped here so that nothing is downloaded.
* The split: the first 90 % of the characters train, the last 10 % validate, in file order (nanoGPT's
  ``prepare.py``: ``n = len(data); data[:int(n*0.9)]``).
* The vocabulary: the sorted set of the file's characters (65 of them), one token each, no special tokens. The
  tokenizer is a ``PreTrainedTokenizerFast`` (a ``tokenizer.json``), so a trained checkpoint's tokenizer reloads
  with ``AutoTokenizer`` anywhere.
"""

from __future__ import annotations

import hashlib
from functools import cache
from pathlib import Path

CORPUS_NAME = "tinyshakespeare"
CORPUS_PATH = Path(__file__).resolve().parent.parent / "data" / "tinyshakespeare.txt"
CORPUS_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
TRAIN_FRACTION = 0.9
CORPUS_USE = f"--dataset_name {CORPUS_NAME} (nanoGPT's shakespeare_char, shipped) is for --task clm, alone."


@cache
def corpus_text() -> str:
    """The whole file, checked against its checksum (an edited copy would silently change every number)."""
    data = CORPUS_PATH.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest != CORPUS_SHA256:
        raise ValueError(f"{CORPUS_PATH} has sha256 {digest}, not {CORPUS_SHA256}: restore it from git.")
    return data.decode("utf-8")


def split_text() -> dict[str, str]:
    """nanoGPT's split: ``{"train": first 90 % of the characters, "validation": the rest}``."""
    text = corpus_text()
    cut = int(len(text) * TRAIN_FRACTION)
    return {"train": text[:cut], "validation": text[cut:]}


def corpus():
    """The split as a ``datasets.DatasetDict`` of one ``text`` row per split (the clm task concatenates rows)."""
    import datasets

    return datasets.DatasetDict(
        {name: datasets.Dataset.from_dict({"text": [text]}) for name, text in split_text().items()}
    )


def vocabulary() -> list[str]:
    """The sorted set of the file's characters (nanoGPT's ``chars = sorted(list(set(data)))``)."""
    return sorted(set(corpus_text()))


def character_tokenizer():
    """One token per character of :func:`vocabulary`, ids in its order (nanoGPT's ``stoi``), nothing added or
    normalised, decoding the inverse. Unknown characters are an error (no ``unk`` token), as in nanoGPT."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    model = models.WordLevel(vocab={char: index for index, char in enumerate(vocabulary())})
    backend = Tokenizer(model)
    # Every character its own piece ([\s\S]: any character, newlines included).
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    # No pad token of its own: evaluation windows are padded with id 0 and masked (WindowCollator).
    return PreTrainedTokenizerFast(tokenizer_object=backend, clean_up_tokenization_spaces=False)
