"""A one-minute tour of hf_neural_attn on a tiny model, fully offline.

    python recipes/demo.py

Builds a small Llama (grouped-query attention, RoPE) from a config, trains it briefly as a byte-level
language model on Python's own documentation (``pydoc_data``), then, for each scorer:
  1. patches every layer and checks the logits did not move (function preservation),
  2. trains only the new parameters for a few dozen steps and reports the loss,
  3. saves the patched model and reloads it with ``hf_neural_attn.from_pretrained``.
"""

from __future__ import annotations

import argparse
import copy
import tempfile
import time
from pydoc_data.topics import topics

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hf_neural_attn
from hf_neural_attn.scorers import NeuralAttentionConfig, QanaConfig


def byte_batches(seq_len: int, batch_size: int, seed: int):
    """Endless batches of byte ids (vocab 256) cut from the pydoc topics text."""
    data = torch.tensor(list("\n".join(topics[k] for k in sorted(topics)).encode("utf-8")), dtype=torch.long)
    generator = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, len(data) - seq_len, (batch_size,), generator=generator)
        yield torch.stack([data[s : s + seq_len] for s in starts.tolist()])


def train(model, parameters, batches, steps: int, lr: float) -> list[float]:
    optimizer = torch.optim.AdamW(parameters, lr=lr)
    model.train()
    losses = []
    for _ in range(steps):
        ids = next(batches)
        loss = model(ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    model.eval()
    return losses


@torch.no_grad()
def eval_loss(model, ids) -> float:
    return model(ids, labels=ids).loss.item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pretrain_steps", type=int, default=150)
    parser.add_argument("--patch_steps", type=int, default=100)
    parser.add_argument("--patch_lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    started = time.time()

    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    base = LlamaForCausalLM(config)
    batches = byte_batches(seq_len=96, batch_size=8, seed=args.seed)
    held_out = next(byte_batches(seq_len=96, batch_size=16, seed=args.seed + 1))
    print(f"Pretraining a {sum(p.numel() for p in base.parameters()) / 1e3:.0f}k-parameter Llama on pydoc text...")
    train(base, base.parameters(), batches, args.pretrain_steps, lr=3e-3)
    base_loss = eval_loss(base, held_out)
    base_logits = base(held_out).logits
    print(f"  held-out loss {base_loss:.4f}\n")

    rows = []
    for config in (QanaConfig(h=4), NeuralAttentionConfig(h=4, proj_dim=4)):
        scorer = config.scorer_name
        model = hf_neural_attn.patch_model(copy.deepcopy(base), config)
        new = hf_neural_attn.scorer_parameters(model)
        with torch.no_grad():
            drift = (model(held_out).logits - base_logits).abs().max().item()
        print(
            f"{scorer}: patched {len(hf_neural_attn.patch_record(model).layers)} layers, "
            f"+{sum(p.numel() for p in new.values())} parameters, max |logit change| at init = {drift:.1e}"
        )
        for name, parameter in model.named_parameters():
            parameter.requires_grad_(name in new)
        losses = train(model, list(new.values()), batches, args.patch_steps, lr=args.patch_lr)
        patched_loss = eval_loss(model, held_out)
        first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
        print(
            f"  trained only the new parameters for {args.patch_steps} steps: train loss (10-step mean) "
            f"{first:.4f} -> {last:.4f}, held-out {base_loss:.4f} -> {patched_loss:.4f}"
        )
        with tempfile.TemporaryDirectory() as folder:
            model.save_pretrained(folder)
            reloaded = hf_neural_attn.from_pretrained(folder)
            with torch.no_grad():
                reload_error = (reloaded(held_out).logits - model(held_out).logits).abs().max().item()
        print(f"  save_pretrained -> from_pretrained: max |logit change| = {reload_error:.1e}\n")
        rows.append((scorer, drift, base_loss, patched_loss, reload_error))

    print("| scorer | logit change at init | held-out loss before | after training new params | reload error |")
    print("|---|---|---|---|---|")
    for scorer, drift, before, after, reload_error in rows:
        print(f"| {scorer} | {drift:.1e} | {before:.4f} | {after:.4f} | {reload_error:.1e} |")
    print(f"\nDone in {time.time() - started:.0f} s.")


if __name__ == "__main__":
    main()
