"""Inference cost of patched models against the unpatched one: the prompt's prefill, and decoding with the KV cache,
eager and compiled.

    python benchmarks/inference.py                          # Llama 4 x 256 (4 query heads, 2 kv heads), prompt 1024
    python benchmarks/inference.py --prompt 512 2048 --decode_steps 64
    python benchmarks/inference.py --preset smollm-135m     # SmolLM-135M's shape: 30 x 576, 9 query heads on 3
    python benchmarks/inference.py --compiled               # adds compiled decoding (static cache, torch.compile)
    python benchmarks/inference.py --preset smollm-135m --device cuda --dtype bf16 --prompt 1024   # on a GPU

A Llama built from its config (``--preset``: the 4 x 256 shape, or SmolLM-135M's, random weights), patched as a user
writes it, ``patch_model(model, scorer, h=4)`` (``--proj_dim`` for Neural Attention's), in eval mode under
``torch.no_grad``, on ``--device`` with its weights in ``--dtype`` (fp32 or bf16; no autocast). On CUDA every time is
taken after ``torch.cuda.synchronize()``, so it holds the GPU's work, not only its launch. One round runs, for each
configuration in turn, the prefill of a ``--prompt``-token prompt (``model(ids, use_cache=True)``, what ``generate``
runs first) and then ``--decode_steps`` greedy steps of one token on that KV cache; every configuration lives in the
one process, so a machine whose speed drifts slows them all alike (interleaved).

``--compiled`` adds a compiled row per configuration, each model compiled the same way, as ``generate`` compiles
decoding: a static cache and the forward under ``torch.compile(fullgraph=True)`` (a ``CompileConfig``; on a CPU
``generate`` compiles only when told to, which the script does). One ``generate`` of ``n + 1`` tokens is timed step
by step: a stopping criterion, which ``generate`` calls once per token as it picks it, stamps the time
(:class:`StepClock`). The prefill is the time to the first token (eager), and the decode time per token the time
from the first token to the last over the ``n`` steps between them: it includes ``generate``'s own per-token work,
as a user's decoding does, and nothing else (a difference of two separately timed calls, as earlier versions took
it, drifts to zero or below on a loaded machine). Compilation happens in a warm-up before the rounds.

Reports the median over ``--rounds`` of the prefill time and of the time per decoded token, both as ratios to the
unpatched model (transformers' SDPA) of the same mode, what the patch adds per layer and token, and (eager rows) the
path the library's rule picked for the prefill's and for a decode step's attention calls. Writes a markdown table
and the numbers as JSON.
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import time
from pathlib import Path

from common import (
    SMOLLM_135M,
    check_device,
    describe_machine,
    device_suffix,
    paths_taken,
    recording_paths,
    scorer_options,
)

# Model shapes (LlamaConfig fields). "llama-4x256": the shape the eager targets were first set on; "smollm-135m":
# HuggingFaceTB/SmolLM-135M's config (common.SMOLLM_135M).
PRESETS = {
    "llama-4x256": {
        "description": "Llama {layers} layers x 256 wide, 4 query heads on 2 kv heads",
        "config": {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "vocab_size": 1000},
        "prompt": [1024],
    },
    "smollm-135m": {
        "description": "SmolLM-135M's shape: Llama {layers} layers x 576 wide, 9 query heads on 3 kv heads, "
                       "vocab 49152",
        "config": SMOLLM_135M,
        "prompt": [512],
    },
}  # fmt: skip


def build(args, scorer: str):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import hf_neural_attn

    torch.manual_seed(0)
    shape = {**PRESETS[args.preset]["config"], "num_hidden_layers": args.layers}
    config = LlamaConfig(**shape, max_position_embeddings=max(args.prompt) + args.decode_steps + 8)
    model = LlamaForCausalLM(config).eval()
    if scorer != "none":
        hf_neural_attn.patch_model(model, scorer, h=args.h, **scorer_options(scorer, args.proj_dim))
    # Patched first, so that the scorers' weights move and convert with the model's.
    return model.to(device=args.device, dtype=getattr(torch, DTYPES[args.dtype]))


# --dtype: the model's weights (and so its computation) in that dtype.
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def synchronizer(device: str):
    """A function that waits for ``device``'s queued work: ``torch.cuda.synchronize`` on CUDA (kernels run
    asynchronously, so a clock read without it times their launch), nothing on a CPU."""
    import torch

    if device.startswith("cuda"):
        return lambda: torch.cuda.synchronize(torch.device(device))
    return lambda: None


def compiled_generation(decode_steps: int, max_cache_len: int):
    """What ``generate`` needs to decode compiled: greedy, ``decode_steps + 1`` new tokens, a static cache of
    ``max_cache_len`` and a ``CompileConfig(fullgraph=True)`` that also compiles on a CPU."""
    from transformers import CompileConfig, GenerationConfig

    compile_config = CompileConfig(fullgraph=True, dynamic=False)
    compile_config._compile_all_devices = True  # generate compiles on accelerators only unless told (a CPU here)
    return GenerationConfig(
        max_new_tokens=decode_steps + 1, min_new_tokens=decode_steps + 1, do_sample=False,
        cache_implementation="static", max_cache_len=max_cache_len, compile_config=compile_config, pad_token_id=0,
        eos_token_id=None,
    )  # fmt: skip


def step_clock(sync):
    """A :class:`~transformers.StoppingCriteria` that never stops ``generate`` and stamps ``time.perf_counter()``
    each time ``generate`` calls it: once per new token, right after the step that picked it (``sync``, called
    first, waits for that step's GPU work). ``stamps[0]`` ends the prefill; ``stamps[i] - stamps[i - 1]`` is decode
    step ``i``."""
    import torch
    from transformers import StoppingCriteria

    class StepClock(StoppingCriteria):
        def __init__(self) -> None:
            self.stamps: list[float] = []

        def __call__(self, input_ids, scores, **kwargs):
            sync()
            self.stamps.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    return StepClock()


def measure(args, prompt: int) -> dict[str, dict]:
    """Per configuration: the median prefill seconds and seconds per decoded token (eager, and compiled as
    ``<name> compiled`` with ``--compiled``), how many decode steps each round timed, and for the patched eager
    rows the paths the rule picked (``paths``: ``prefill`` and ``decode``)."""
    import torch

    models = {scorer: build(args, scorer) for scorer in ["none", *args.scorers]}
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, models["none"].config.vocab_size, (1, prompt), generator=generator).to(args.device)
    sync = synchronizer(args.device)
    names = list(models) + ([f"{name} compiled" for name in models] if args.compiled else [])
    samples = {name: {"prefill_s": [], "decode_s": [], "decode_steps": []} for name in names}

    # transformers 5.24 renamed the KV cache argument and output field from past_key_values to cache; the old name
    # still works there but warns on every call.
    cache_name = "cache" if "cache" in inspect.signature(type(models["none"]).forward).parameters else "past_key_values"

    def one(model) -> tuple[float, float, int]:
        sync()
        started = time.perf_counter()
        out = model(ids, use_cache=True)
        sync()
        prefill = time.perf_counter() - started
        cache, token = out[cache_name], out.logits[:, -1:].argmax(-1)
        started = time.perf_counter()
        for _ in range(args.decode_steps):
            out = model(token, use_cache=True, **{cache_name: cache})
            cache, token = out[cache_name], out.logits[:, -1:].argmax(-1)
        sync()
        return prefill, (time.perf_counter() - started) / args.decode_steps, args.decode_steps

    def chosen_paths(model) -> dict[str, str]:
        """The paths the rule picks for the prompt's prefill and for one decode step after it (recorded outside
        the timed rounds, so the recording costs them nothing)."""
        with recording_paths() as prefill_calls:
            out = model(ids, use_cache=True)
        with recording_paths() as decode_calls:
            model(out.logits[:, -1:].argmax(-1), use_cache=True, **{cache_name: out[cache_name]})
        return {"prefill": paths_taken(prefill_calls), "decode": paths_taken(decode_calls)}

    if args.compiled:
        generation = compiled_generation(args.decode_steps, prompt + args.decode_steps + 1)

    def compiled(model) -> tuple[float, float, int]:
        from transformers import StoppingCriteriaList

        clock = step_clock(sync)
        sync()
        started = time.perf_counter()
        model.generate(ids, generation_config=generation, stopping_criteria=StoppingCriteriaList([clock]))
        steps = len(clock.stamps) - 1
        return clock.stamps[0] - started, (clock.stamps[-1] - clock.stamps[0]) / steps, steps

    runs = [(name, model, one) for name, model in models.items()]
    runs += [(f"{name} compiled", model, compiled) for name, model in models.items()] if args.compiled else []
    with torch.no_grad():
        paths = {name: chosen_paths(model) for name, model in models.items() if name != "none"}
        for _, model, run in runs:
            run(model)  # warm-up (and compilation)
        for _ in range(args.rounds):
            for name, model, run in runs:
                prefill, decode, steps = run(model)
                samples[name]["prefill_s"].append(prefill)
                samples[name]["decode_s"].append(decode)
                samples[name]["decode_steps"].append(steps)
    medians = {name: {key: statistics.median(values) for key, values in by.items()} for name, by in samples.items()}
    return {name: row | ({"paths": paths[name]} if name in paths else {}) for name, row in medians.items()}


def report(results: dict, args) -> str:
    import torch

    shape = PRESETS[args.preset]["description"].format(layers=args.layers)
    compiled = (
        " Compiled rows: generate with a static cache and torch.compile(fullgraph=True), prefill eager; ratios to the "
        "compiled unpatched model."
        if args.compiled
        else ""
    )
    neural = f"proj_dim={args.proj_dim}" if args.proj_dim else "its default options"
    lines = [
        (
            f"{shape}, eval mode, every layer patched with h={args.h} (Neural Attention with {neural}), "
            f"weights in {args.dtype}, batch 1; median of {args.rounds} interleaved rounds, {args.decode_steps} "
            f"decoded tokens each; paths: what the library's rule picked for the prefill's / a decode step's attention "
            f"calls (eager rows); machine: {describe_machine(args.device)}, {torch.get_num_threads()} CPU threads."
            f"{compiled}"
        ),
        "",
        "| prompt | scorer | prefill ms | x unpatched | decode ms/token | x unpatched | added per layer and token "
        "| paths |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for prompt, by_scorer in results.items():
        for name, times in by_scorer.items():
            base = by_scorer["none compiled" if name.endswith(" compiled") else "none"]
            added = (times["decode_s"] - base["decode_s"]) / args.layers * 1e6
            paths = " / ".join(times["paths"].values()) if "paths" in times else ""
            lines.append(
                f"| {prompt} | {name} | {times['prefill_s'] * 1e3:.1f} | {times['prefill_s'] / base['prefill_s']:.2f} "
                f"| {times['decode_s'] * 1e3:.2f} | {times['decode_s'] / base['decode_s']:.2f} | "
                f"{'' if name.startswith('none') else f'{added:.0f} µs'} | {paths} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="llama-4x256", help="the model's shape")
    parser.add_argument("--prompt", type=int, nargs="+", help="prompt lengths (default: the preset's)")
    parser.add_argument("--decode_steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--layers", type=int, help="layers (default: the preset's)")
    parser.add_argument("--compiled", action="store_true", help="add compiled decoding rows (static cache)")
    parser.add_argument("--h", type=int, default=4)
    parser.add_argument("--proj_dim", type=int, default=None, help="Neural Attention's proj_dim (default: none)")
    parser.add_argument("--scorers", nargs="+", default=["qana", "neural"], choices=["qana", "neural"])
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="the model's weights' dtype")
    parser.add_argument("--output_dir", default="benchmarks/results")
    args = parser.parse_args()
    check_device(parser, args.device)
    args.prompt = args.prompt or PRESETS[args.preset]["prompt"]
    args.layers = args.layers or PRESETS[args.preset]["config"]["num_hidden_layers"]
    results = {}
    for prompt in args.prompt:
        results[prompt] = measure(args, prompt)
        print(f"prompt {prompt}: " + json.dumps(results[prompt]), flush=True)
    table = report(results, args)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = "inference" if args.preset == "llama-4x256" else f"inference_{args.preset}"
    stem += device_suffix(args.device, args.dtype)  # on CUDA or in bf16 the names carry both, as train_step.py's do
    (out / f"{stem}.json").write_text(json.dumps({"setup": vars(args), "results": results}, indent=2))
    (out / f"{stem}.md").write_text(table)
    print("\n" + table)


if __name__ == "__main__":
    main()
