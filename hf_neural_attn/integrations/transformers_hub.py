"""The card ``push_to_hub`` writes for a patched checkpoint: the library's (:mod:`hf_neural_attn.model_cards`), where
transformers would write its generic template.

``PushToHubMixin.push_to_hub`` makes its card with ``transformers.utils.hub.create_and_tag_model_card`` before
``save_pretrained`` and saves it over the folder's README.md after, and it does not know the model, so no hook of the
save can keep the library's card. :func:`install` wraps that function (``transformers.utils.hub``'s, and the name
``transformers.modeling_utils`` imported from it, which ``save_pretrained(push_to_hub=True)`` calls): for a repo that
has no card yet, the returned card's ``save`` writes the library's card instead of transformers' template when the
folder it saves into holds a patched checkpoint (with transformers' tags added). Everything else (unpatched models,
repos with a card) is transformers' own behaviour, unchanged.
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import ModuleType

from ..model_cards import card_of_pushed_folder
from .wrapping import wrap_once

# transformers' generic card for a repo without one says (transformers.utils.hub): how the wrapper tells that template
# from a card the repo already has.
TRANSFORMERS_TEMPLATE_MARK = "This model card has been automatically generated."


def install(*modules: ModuleType) -> None:
    """Wrap ``create_and_tag_model_card`` in each of ``modules`` (once each)."""
    for module in modules:
        wrap_once(module, "create_and_tag_model_card", _library_card_for_patched_folders)


def _library_card_for_patched_folders(original):
    @functools.wraps(original)
    def create_and_tag_model_card(repo_id, tags=None, token=None):
        card = original(repo_id, tags, token=token)
        if TRANSFORMERS_TEMPLATE_MARK not in card.text:
            return card  # the repo's own card: kept, tagged by transformers
        save_template = card.save

        def save(filepath, *args, **kwargs):
            ours = card_of_pushed_folder(Path(filepath).parent, repo_id, card.data.tags or [])
            if ours is None:
                return save_template(filepath, *args, **kwargs)
            Path(filepath).write_text(ours, encoding="utf-8")
            return None

        card.save = save
        return card

    return create_and_tag_model_card
