"""Where materialising the scores stops paying: one attention call, reference against chunked path.

    python benchmarks/auto_threshold.py                       # 4 heads of 64, h = 4, n = 128 ... 512
    python benchmarks/auto_threshold.py --seq 64 128 256 --batch 32 --dropout 0.1
    python benchmarks/auto_threshold.py --family llama                            # RoPE: Neural's relative input

Times forward + backward of one causal attention call of a patched GPT-2 (or Llama) layer (QANA, and Neural
Attention with its default options) in training mode with attention dropout ``--dropout`` (0 by default), on each
path, interleaved so that drifts in machine speed hit both alike, and prints the median per path, their ratio and
the score-tensor size ``batch x heads x n x n x h`` that ``impl="auto"`` compares with each scorer's
``reference_max_scores``. The crossover sets that threshold (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import hf_neural_attn
from hf_neural_attn.ops.dispatch import scored_attention


def patched_scorer(family: str, scorer_name: str, n: int, heads: int, head_dim: int, h: int):
    """The scorer of a one-layer model of ``family`` patched with ``scorer_name``: on GPT-2 Neural Attention scores the
    concatenated pair, on Llama (RoPE) its relative input, which runs QANA's blockwise term."""
    width = heads * head_dim
    if family == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=width, n_layer=1, n_head=heads, n_positions=n))
        attention = model.transformer.h[0].attn
    else:
        config = LlamaConfig(
            vocab_size=64, hidden_size=width, intermediate_size=2 * width, num_hidden_layers=1,
            num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=n,
        )  # fmt: skip
        model = LlamaForCausalLM(config)
        attention = model.model.layers[0].self_attn
    hf_neural_attn.patch_model(model, scorer_name, h=h)
    return attention.attn_scorer


def attention_call(
    family: str, scorer_name: str, n: int, batch: int, heads: int, head_dim: int, h: int, dropout: float
):
    """A patched layer's scorer and the inputs of one call; returns the scorer and a function running forward +
    backward on the path an ``impl`` names."""
    scorer = patched_scorer(family, scorer_name, n, heads, head_dim, h)
    generator = torch.Generator().manual_seed(0)

    def leaf(*shape):
        return torch.randn(*shape, generator=generator).requires_grad_()

    hidden = leaf(batch, n, heads * head_dim)
    query, key, value = (leaf(batch, heads, n, head_dim) for _ in range(3))

    def run(impl: str) -> None:
        scorer.config.impl = impl
        extras = scorer.query_extras(hidden, None) if scorer.needs_hidden_states else None
        output, _ = scored_attention(
            scorer, query, key, value, None, scaling=head_dim**-0.5, extras=extras, is_causal=True,
            dropout=dropout, training=True,
        )  # fmt: skip
        output.sum().backward()

    return scorer, run


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=["gpt2", "llama"], default="gpt2")
    parser.add_argument("--seq", type=int, nargs="+", default=[128, 192, 256, 320, 384, 448, 512])
    parser.add_argument("--scorers", nargs="+", default=["qana", "neural"], choices=["qana", "neural"])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head_dim", type=int, default=64)
    parser.add_argument("--h", type=int, default=4)
    parser.add_argument("--dropout", type=float, default=0.0, help="attention dropout, training mode")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)

    print(
        f"# {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}"
    )
    print(
        f"# {args.family}, batch {args.batch}, {args.heads} heads of {args.head_dim}, h = {args.h}, "
        f"attention dropout {args.dropout}; "
        "(auto: reference) marks the calls impl='auto' materialises"
    )
    print("| scorer | n | scores (batch x heads x n x n x h) | reference ms | chunked ms | chunked / reference |")
    print("|---|---|---|---|---|---|")
    for scorer_name in args.scorers:
        for n in args.seq:
            scorer, run = attention_call(
                args.family, scorer_name, n, args.batch, args.heads, args.head_dim, args.h, args.dropout
            )
            times = {"reference": [], "chunked": []}
            for impl in times:
                run(impl)  # warm-up
            for _ in range(args.repeats):
                for impl, samples in times.items():
                    started = time.perf_counter()
                    run(impl)
                    samples.append(time.perf_counter() - started)
            reference, chunked = (statistics.median(times[impl]) * 1000 for impl in ("reference", "chunked"))
            size = args.batch * args.heads * n * n * args.h
            marker = " (auto: reference)" if size <= scorer.reference_max_scores else ""
            print(
                f"| {scorer_name} | {n} | {size:,}{marker} | {reference:.1f} | {chunked:.1f} | {chunked / reference:.2f} |"
            )


if __name__ == "__main__":
    main()
