#!/usr/bin/env python
"""Draw the example pictures of ``docs/plots.md``: a tiny GPT-2-shaped model, QANA in both layers, 80 steps.

    python recipes/plot_example.py                 # writes docs/img/example_attention_maps.png and
                                                   #        docs/img/example_scorer_history.png

The model is built from a config (2 layers, 4 heads, d_model 64; random init), reads bytes (ByT5Tokenizer) and
trains for 80 steps on the Python documentation that ships with the interpreter: a few seconds on a CPU and
nothing downloaded. The pictures show what the plots look like, not what QANA learns on a real model.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from pydoc_data.topics import topics

import torch
from transformers import ByT5Tokenizer, GPT2Config, GPT2LMHeadModel

import hf_neural_attn
from hf_neural_attn import plotting
from hf_neural_attn.scorers import QanaConfig

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output_dir", default=str(ROOT / "docs" / "img"))
    parser.add_argument("--steps", type=int, default=80)
    args = parser.parse_args()
    output = Path(args.output_dir)
    output.mkdir(parents=True, exist_ok=True)

    torch.manual_seed(0)
    tokenizer = ByT5Tokenizer()
    # The ids of the special tokens are given when the config is built: GPT-2's defaults lie outside this vocabulary.
    config = GPT2Config(
        vocab_size=len(tokenizer), n_layer=2, n_head=4, n_embd=64, n_positions=64, bos_token_id=1, eos_token_id=1
    )
    config.update({"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0})
    model = hf_neural_attn.patch_model(GPT2LMHeadModel(config), QanaConfig(h=4))

    text = "\n\n".join(topics[name] for name in sorted(topics))
    ids = torch.tensor(tokenizer(text[:200_000])["input_ids"][:-1])
    blocks = ids[: len(ids) // 64 * 64].view(-1, 64)
    sentence = tokenizer(["The quick brown fox jumps over the lazy dog."], return_tensors="pt")
    probe = {"input_ids": sentence["input_ids"]}

    tracker = plotting.ScorerTracker(probe=probe)
    tracker.record(model, 0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    model.train()
    for step in range(1, args.steps + 1):
        batch = blocks[torch.randint(len(blocks), (16,), generator=generator)]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % 5 == 0:
            tracker.record(model, step)
    print(f"loss after {args.steps} steps: {loss.item():.3f}")

    title = f"tiny random GPT-2 (2 layers, d_model 64), QANA h=4, {args.steps} training steps"
    history_path = tracker.plot(output / "example_scorer_history.png", title=title)
    maps = plotting.plot_attention_maps(
        model, probe, output / "example_attention_maps.png", layer=0, tokenizer=tokenizer, title=title
    )
    print(f"wrote {history_path} and {maps.path} ({maps.size_px[0]}x{maps.size_px[1]} px)")
    print(f"layer 0: mean total-variation distance, patched vs unpatched = {maps.total_variation():.4f}")


if __name__ == "__main__":
    main()
