"""vLLM serving throughput of patched checkpoints against the unpatched one: tokens/s with concurrent requests.

    .venv/vllm/bin/python benchmarks/vllm_throughput.py                  # the 135M Llama shape, 8 requests, QANA and Neural
    .venv/vllm/bin/python benchmarks/vllm_throughput.py --layers 4 --rounds 1 --new_tokens 16   # quick
    .venv/vllm/bin/python benchmarks/vllm_throughput.py --profile        # adds where a patched run's time goes

Runs in the vLLM environment (``make test-vllm`` builds it). SmolLM-135M's shape (30 layers x 576, 9 query heads on
3 key/value heads of 64; random weights, the Hub is not reachable here) is saved unpatched and patched as a user writes
it (``patch_model(model, scorer, h=4)``, scorers moved off their init). Each configuration is served by its own
``LLM`` (vLLM's own Llama for the unpatched folder, the plugin's Transformers backend for the patched ones), in a
child process of its own per round, in turn (interleaved: a machine whose speed drifts slows them all alike). A
round sends ``--requests`` prompts of ``--prompt`` random tokens at once, each asking ``--new_tokens`` greedy tokens
(``ignore_eos``), after a warm-up of the same shape; throughput is generated tokens over the wall time of the
``generate`` call. Every model runs as vLLM runs it by default, compiled (the patched ones too: their scored
attention is one opaque operator in vLLM's graph); ``--unpatched_eager`` adds the unpatched model eager,
``--unpatched_transformers`` adds it in vLLM's Transformers modeling backend, eager, which is the plugin's machinery
without the scorers, and ``--patched_eager`` adds the patched ones eager (``enforce_eager=True``).

Reports the median tokens/s of each configuration over ``--rounds`` and its ratio to the unpatched model's.
``--profile`` runs one more patched round, eager (a compiled graph hides the Python functions), under cProfile and
reports the share of the ``generate`` call spent in the scored layers' cache writes and reads, their scoring and
QANA's query network.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

SMOLLM_135M = {
    "hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152,
    "tie_word_embeddings": True, "rope_theta": 10000.0, "bos_token_id": 1, "eos_token_id": 2,
}  # fmt: skip
# The functions whose cumulative time --profile reports, by what they do: (name, where). A name that several
# functions of that file bear (the two ``read`` methods) adds their times; "model forward" takes the outermost.
PROFILED = {
    "scored layers' attention (all of it)": ("paged_scored_attention", "hf_neural_attn/paged_attention.py"),
    "cache write": ("write_tokens", "hf_neural_attn/paged_attention.py"),
    "cache read (keys gathered back)": ("read", "hf_neural_attn/paged_attention.py"),
    "decoding requests' scoring (one padded batch)": ("decoding_attention", "hf_neural_attn/attention.py"),
    "prefill scoring (packed path)": ("attention_with_keys", "hf_neural_attn/attention.py"),
    "query network (QANA's widened query)": ("query_extras", "hf_neural_attn/scorers/qana.py"),
    "model forward": ("forward", "transformers/models/llama/modeling_llama.py"),
}


def save_checkpoints(args, root: Path) -> dict[str, Path]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import hf_neural_attn

    folders = {}
    for scorer in ["none", *args.scorers]:
        torch.manual_seed(0)
        config = LlamaConfig(
            **SMOLLM_135M, num_hidden_layers=args.layers, max_position_embeddings=args.prompt + args.new_tokens + 64
        )
        model = LlamaForCausalLM(config).eval()
        if scorer != "none":
            hf_neural_attn.patch_model(model, scorer, h=args.h)
            generator = torch.Generator().manual_seed(1)
            with torch.no_grad():
                for parameter in hf_neural_attn.scorer_parameters(model).values():
                    parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.02)
        folders[scorer] = root / scorer
        model.save_pretrained(folders[scorer])
    return folders


def serve_once(folder: Path, args, eager: bool, implementation: str, profile: bool) -> dict:
    """One round in a fresh process: build the engine, warm up, time one generate of the requests."""
    spec = {
        "folder": str(folder), "requests": args.requests, "prompt": args.prompt, "new_tokens": args.new_tokens, "eager": eager,
        "implementation": implementation, "profile": profile, "functions": PROFILED,
    }  # fmt: skip
    environment = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "2"}
    done = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(spec)],
        env=environment,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-4000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def child(spec: dict) -> None:
    """The child process: no import of hf_neural_attn (the plugin comes through its entry point)."""
    import cProfile
    import pstats
    import random
    import time

    from vllm import LLM, SamplingParams

    llm = LLM(
        model=spec["folder"], dtype="float32", max_model_len=spec["prompt"] + spec["new_tokens"] + 16,
        max_num_seqs=spec["requests"], enforce_eager=spec["eager"], skip_tokenizer_init=True, seed=0,
        model_impl=spec["implementation"],
    )  # fmt: skip
    rng = random.Random(0)
    prompts = [
        {"prompt_token_ids": [rng.randrange(3, 49152) for _ in range(spec["prompt"])]} for _ in range(spec["requests"])
    ]
    params = SamplingParams(max_tokens=spec["new_tokens"], temperature=0, ignore_eos=True)
    warm = [{"prompt_token_ids": [rng.randrange(3, 49152) for _ in range(spec["prompt"])]} for _ in prompts]
    llm.generate(warm, params, use_tqdm=False)
    profiler = cProfile.Profile() if spec["profile"] else None
    start = time.perf_counter()
    if profiler is not None:
        profiler.enable()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    if profiler is not None:
        profiler.disable()
    seconds = time.perf_counter() - start
    tokens = sum(len(output.outputs[0].token_ids) for output in outputs)
    result = {"tokens": tokens, "seconds": seconds}
    if profiler is not None:
        stats = pstats.Stats(profiler).stats
        total = sum(entry[2] for entry in stats.values())  # own time of every function: the profiled wall
        shares = {}
        for label, (function, where) in spec["functions"].items():
            times = [entry[3] for (path, _, name), entry in stats.items() if name == function and path.endswith(where)]
            seconds = (max(times) if function == "forward" else sum(times)) if times else 0.0
            shares[label] = seconds / total
        result["shares"] = shares
    print(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new_tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--h", type=int, default=4)
    parser.add_argument("--scorers", nargs="+", default=["qana", "neural"])
    parser.add_argument("--unpatched_eager", action="store_true", help="also time the unpatched model eager")
    parser.add_argument(
        "--unpatched_transformers", action="store_true",
        help="also time the unpatched model in vLLM's Transformers backend, eager: the plugin's machinery without scorers",
    )  # fmt: skip
    parser.add_argument("--patched_eager", action="store_true", help="also time the patched models eager")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/vllm_throughput.json"))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(json.loads(args.child))
    with tempfile.TemporaryDirectory() as root:
        folders = save_checkpoints(args, Path(root))
        rows = {"unpatched": (folders["none"], False, "auto")}
        if args.unpatched_eager:
            rows["unpatched, eager"] = (folders["none"], True, "auto")
        if args.unpatched_transformers:
            rows["unpatched, Transformers backend, eager"] = (folders["none"], True, "transformers")
        rows.update({scorer: (folders[scorer], False, "auto") for scorer in args.scorers})
        if args.patched_eager:
            rows.update({f"{scorer}, eager": (folders[scorer], True, "auto") for scorer in args.scorers})
        rates = {name: [] for name in rows}
        for round_index in range(args.rounds):
            for name, (folder, eager, implementation) in rows.items():
                result = serve_once(folder, args, eager, implementation, profile=False)
                rates[name].append(result["tokens"] / result["seconds"])
                print(f"round {round_index + 1} {name}: {rates[name][-1]:.1f} tokens/s", flush=True)
        # Profiled eager: cProfile sees the Python functions a compiled graph would hide.
        profiled = serve_once(folders[args.scorers[0]], args, True, "auto", profile=True) if args.profile else None
        shares = profiled["shares"] if profiled else None
    baseline = statistics.median(rates["unpatched"])
    print(f"\n{args.requests} concurrent requests, prompt {args.prompt}, {args.new_tokens} new tokens each; "
          f"Llama {args.layers} x 576 (SmolLM-135M's shape), fp32; {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs; median of {args.rounds} rounds\n")  # fmt: skip
    print("| configuration | tokens/s | ratio to unpatched |\n|---|---|---|")
    for name, values in rates.items():
        print(f"| {name} | {statistics.median(values):.1f} | {statistics.median(values) / baseline:.2f} |")
    if shares:
        print(f"\nWhere a patched ({args.scorers[0]}) generate's time goes (cProfile, cumulative share):")
        for label, share in shares.items():
            print(f"- {label}: {share:.0%}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rates": rates,
                                    "shares": shares}, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
