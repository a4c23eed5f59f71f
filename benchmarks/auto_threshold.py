"""Where materialising the scores stops paying: one attention call, reference against chunked path.

    python benchmarks/auto_threshold.py                       # 4 heads of 64, h = 4, n = 128 ... 512
    python benchmarks/auto_threshold.py --seq 64 128 256 --batch 32 --dropout 0.1

Times forward + backward of one causal attention call of a patched GPT-2 layer (QANA, and Neural Attention with
its default options) in training mode with attention dropout ``--dropout`` (0 by default), on each path,
interleaved so that drifts in machine speed hit both alike, and prints the median per path, their ratio and the
score-tensor size ``batch x heads x n x n x h`` that ``impl="auto"`` compares with ``ops.REFERENCE_MAX_SCORES``.
The crossover sets that threshold (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import hf_neural_attn
from hf_neural_attn.ops import REFERENCE_MAX_SCORES, scored_attention


def attention_call(scorer_name: str, n: int, batch: int, heads: int, head_dim: int, h: int, dropout: float):
    """A patched layer's scorer and the inputs of one call; returns a function running forward + backward."""
    config = GPT2Config(vocab_size=64, n_embd=heads * head_dim, n_layer=1, n_head=heads, n_positions=n)
    model = GPT2LMHeadModel(config)
    hf_neural_attn.patch_model(model, scorer_name, h=h)
    scorer = model.transformer.h[0].attn.attn_scorer
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

    return run


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
        f"# batch {args.batch}, {args.heads} heads of {args.head_dim}, h = {args.h}, attention dropout {args.dropout}; "
        f"REFERENCE_MAX_SCORES = {REFERENCE_MAX_SCORES:,}"
    )
    print("| scorer | n | scores (batch x heads x n x n x h) | reference ms | chunked ms | chunked / reference |")
    print("|---|---|---|---|---|---|")
    for scorer_name in args.scorers:
        for n in args.seq:
            run = attention_call(scorer_name, n, args.batch, args.heads, args.head_dim, args.h, args.dropout)
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
            marker = " (auto: reference)" if size <= REFERENCE_MAX_SCORES else ""
            print(
                f"| {scorer_name} | {n} | {size:,}{marker} | {reference:.1f} | {chunked:.1f} | {chunked / reference:.2f} |"
            )


if __name__ == "__main__":
    main()
