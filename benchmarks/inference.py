"""Inference cost of patched models against the unpatched one: the prompt's prefill, and decoding with the KV cache.

    python benchmarks/inference.py                     # Llama 4 x 256 (4 query heads, 2 kv heads), prompt 1024
    python benchmarks/inference.py --prompt 512 2048 --decode_steps 64

A Llama built from its config (the issue's pinned shape), patched as a user writes it, ``patch_model(model, scorer,
h=4)``, in eval mode under ``torch.no_grad``. One round runs, for each configuration in turn, the prefill of a
``--prompt``-token prompt (``model(ids, use_cache=True)``, what ``generate`` runs first) and then ``--decode_steps``
greedy steps of one token on that KV cache; every configuration lives in the one process, so a machine whose speed
drifts slows them all alike (interleaved). Reports the median over ``--rounds`` of the prefill time and of the time
per decoded token, both as ratios to the unpatched model (transformers' SDPA), and what the patch adds per layer
and token. Writes a markdown table and the numbers as JSON.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import statistics
import time
from pathlib import Path


def build(args, scorer: str):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import hf_neural_attn

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=256, intermediate_size=512, num_hidden_layers=args.layers, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=1000, max_position_embeddings=max(args.prompt) + args.decode_steps + 8,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    if scorer != "none":
        hf_neural_attn.patch_model(model, scorer, h=args.h)
    return model


def measure(args, prompt: int) -> dict[str, dict[str, float]]:
    """Per configuration: the median prefill seconds and seconds per decoded token."""
    import torch

    models = {scorer: build(args, scorer) for scorer in ["none", *args.scorers]}
    ids = torch.randint(0, 1000, (1, prompt), generator=torch.Generator().manual_seed(1))
    samples = {name: {"prefill_s": [], "decode_s": []} for name in models}

    # transformers 5.24 renamed the KV cache argument and output field from past_key_values to cache; the old name
    # still works there but warns on every call.
    cache_name = "cache" if "cache" in inspect.signature(type(models["none"]).forward).parameters else "past_key_values"

    def one(model) -> tuple[float, float]:
        started = time.perf_counter()
        out = model(ids, use_cache=True)
        prefill = time.perf_counter() - started
        cache, token = out[cache_name], out.logits[:, -1:].argmax(-1)
        started = time.perf_counter()
        for _ in range(args.decode_steps):
            out = model(token, use_cache=True, **{cache_name: cache})
            cache, token = out[cache_name], out.logits[:, -1:].argmax(-1)
        return prefill, (time.perf_counter() - started) / args.decode_steps

    with torch.no_grad():
        for model in models.values():
            one(model)  # warm-up
        for _ in range(args.rounds):
            for name, model in models.items():
                prefill, decode = one(model)
                samples[name]["prefill_s"].append(prefill)
                samples[name]["decode_s"].append(decode)
    return {name: {key: statistics.median(values) for key, values in by.items()} for name, by in samples.items()}


def report(results: dict, args) -> str:
    import torch

    cpu = platform.machine()
    try:
        with open("/proc/cpuinfo") as handle:
            cpu = next(line.split(":", 1)[1].strip() for line in handle if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    lines = [
        (
            f"Llama {args.layers} layers x 256 wide, 4 query heads on 2 kv heads, eval mode, every layer patched with "
            f"h={args.h} (Neural Attention with its default options), fp32, batch 1; median of {args.rounds} "
            f"interleaved rounds, {args.decode_steps} decoded tokens each; machine: {cpu}, {os.cpu_count()} cores, "
            f"{torch.get_num_threads()} threads, torch {torch.__version__} (CPU)."
        ),
        "",
        "| prompt | scorer | prefill ms | x unpatched | decode ms/token | x unpatched | added per layer and token |",
        "|---|---|---|---|---|---|---|",
    ]
    for prompt, by_scorer in results.items():
        base = by_scorer["none"]
        for name, times in by_scorer.items():
            added = (times["decode_s"] - base["decode_s"]) / args.layers * 1e6
            lines.append(
                f"| {prompt} | {name} | {times['prefill_s'] * 1e3:.1f} | {times['prefill_s'] / base['prefill_s']:.2f} "
                f"| {times['decode_s'] * 1e3:.2f} | {times['decode_s'] / base['decode_s']:.2f} | "
                f"{'' if name == 'none' else f'{added:.0f} µs'} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", type=int, nargs="+", default=[1024])
    parser.add_argument("--decode_steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--h", type=int, default=4)
    parser.add_argument("--scorers", nargs="+", default=["qana", "neural"], choices=["qana", "neural"])
    parser.add_argument("--output_dir", default="benchmarks/results")
    args = parser.parse_args()
    results = {}
    for prompt in args.prompt:
        results[prompt] = measure(args, prompt)
        print(f"prompt {prompt}: " + json.dumps(results[prompt]), flush=True)
    table = report(results, args)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "inference.json").write_text(json.dumps({"setup": vars(args), "results": results}, indent=2))
    (out / "inference.md").write_text(table)
    print("\n" + table)


if __name__ == "__main__":
    main()
