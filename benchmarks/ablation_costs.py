"""What QANA's ablation options cost or save, measured against the unpatched model in the same run.

    python benchmarks/ablation_costs.py                    # both tables, a Llama layer of 8 heads x 64
    python benchmarks/ablation_costs.py --part kv_cache --new_tokens 256

Two tables (docs/experiments.md):

* ``kv_cache``: the bytes of the KV cache after ``generate()`` on a Llama built from a config, unpatched and
  patched with QANA's ``key_dim`` at 1.0, 0.75, 0.5 and 0.25 of the head dimension (keys narrower, values kept),
  read from the cache object ``generate`` returns.
* ``u_rank``: forward + backward of one causal attention call of a patched Llama layer (the scorer's
  ``query_extras`` and the attention path, what ``impl="auto"`` picks), full QANA against ``u_rank`` r, timed
  interleaved with the unpatched SDPA call so that drifts in machine speed hit every row alike; plus each form's
  extra query rows per head.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
import warnings

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

import hf_neural_attn
from hf_neural_attn.ops.dispatch import scored_attention


def llama_config(args, layers: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=256,
        hidden_size=args.heads * args.head_dim,
        intermediate_size=2 * args.heads * args.head_dim,
        num_hidden_layers=layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        head_dim=args.head_dim,
        max_position_embeddings=4096,
    )


def cache_bytes(cache) -> int:
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


@torch.no_grad()
def kv_cache_table(args) -> None:
    prompt = torch.randint(0, 256, (1, args.prompt_tokens), generator=torch.Generator().manual_seed(0))
    print(f"\n# KV cache after generate(): {args.layers} layers, {args.heads} heads of {args.head_dim}, ", end="")
    print(f"{args.prompt_tokens} prompt + {args.new_tokens} new tokens, fp32")
    print("| model | key width | KV cache bytes | / unpatched |")
    print("|---|---|---|---|")
    baseline = None
    for fraction in (None, 1.0, 0.75, 0.5, 0.25):
        torch.manual_seed(0)
        model = LlamaForCausalLM(llama_config(args, args.layers)).eval()
        width = args.head_dim
        if fraction is not None:
            key_dim = int(args.head_dim * fraction)
            options = {"key_dim": key_dim} if key_dim < args.head_dim else {}
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                hf_neural_attn.patch_model(model, "qana", h=args.h, **options)
            width = key_dim
        out = model.generate(
            prompt, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
            return_dict_in_generate=True, pad_token_id=0,
        )  # fmt: skip
        # transformers 5.24 names the output field cache (past_key_values before it, still readable with a warning)
        size = cache_bytes(next(out[name] for name in ("cache", "past_key_values") if name in out))
        baseline = baseline or size
        label = (
            "unpatched"
            if fraction is None
            else f"QANA h={args.h}" + (f", key_dim={width}" if width < args.head_dim else "")
        )
        print(f"| {label} | {width} | {size:,} | {size / baseline:.3f} |")


def attention_call(args, n: int, u_rank: int | None):
    """forward + backward of one patched layer's attention call (None: unpatched SDPA)."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config(args, 1))
    generator = torch.Generator().manual_seed(0)

    def leaf(*shape):
        return torch.randn(*shape, generator=generator).requires_grad_()

    hidden = leaf(args.batch, n, args.heads * args.head_dim)
    query, key, value = (leaf(args.batch, args.heads, n, args.head_dim) for _ in range(3))
    if u_rank == 0:
        return lambda: F.scaled_dot_product_attention(query, key, value, is_causal=True).sum().backward()
    hf_neural_attn.patch_model(model, "qana", h=args.h, **({"u_rank": u_rank} if u_rank else {}))
    scorer = model.model.layers[0].self_attn.attn_scorer
    rows = scorer.rows_per_head - 2 * args.h - 1

    def run() -> None:
        output, _ = scored_attention(
            scorer, query, key, value, None, scaling=args.head_dim**-0.5,
            extras=scorer.query_extras(hidden, None), is_causal=True,
        )  # fmt: skip
        output.sum().backward()

    run.rows = rows
    return run


def u_rank_table(args) -> None:
    print(
        f"\n# u_rank: one causal attention call, forward + backward, batch {args.batch}, {args.heads} heads of ", end=""
    )
    print(f"{args.head_dim}, h = {args.h}; median of {args.repeats} interleaved rounds")
    print("| n | form | extra U rows per head | ms | / unpatched SDPA | / full QANA |")
    print("|---|---|---|---|---|---|")
    forms = {"unpatched SDPA": 0, "QANA (full U)": None, **{f"QANA u_rank={r}": r for r in args.ranks}}
    for n in args.seq:
        runs = {label: attention_call(args, n, rank) for label, rank in forms.items()}
        times = {label: [] for label in runs}
        for run in runs.values():
            run()  # warm-up
        for _ in range(args.repeats):
            for label, run in runs.items():
                started = time.perf_counter()
                run()
                times[label].append(time.perf_counter() - started)
        median = {label: statistics.median(samples) * 1000 for label, samples in times.items()}
        for label, run in runs.items():
            rows = getattr(run, "rows", "-")
            print(
                f"| {n} | {label} | {rows} | {median[label]:.1f} | {median[label] / median['unpatched SDPA']:.2f} | "
                f"{median[label] / median['QANA (full U)']:.2f} |"
            )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=["kv_cache", "u_rank", "both"], default="both")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head_dim", type=int, default=64)
    parser.add_argument("--h", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--prompt_tokens", type=int, default=64)
    parser.add_argument("--new_tokens", type=int, default=192)
    parser.add_argument("--seq", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    print(
        f"# {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}"
    )
    if args.part in ("kv_cache", "both"):
        kv_cache_table(args)
    if args.part in ("u_rank", "both"):
        u_rank_table(args)


if __name__ == "__main__":
    main()
