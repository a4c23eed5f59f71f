"""Training-step cost of patched models against the unpatched one, measured in the same run.

    python benchmarks/train_step.py                                 # GPT-2 4 x 256 x 4, batch 1, 256 ... 2048 tokens
    python benchmarks/train_step.py --family bert --batch 4 --seq 1024 --padded     # the padded encoder rows
    python benchmarks/train_step.py --batch 32 --seq 128                            # short sequences (GLUE-like)
    python benchmarks/train_step.py --device cuda --dtype bf16 --preset gpt2-small \
        --seq 1024 2048 4096 8192 --impls triton chunked auto     # GPU: GPT-2 small, 12 x 768 x 12 heads
    python benchmarks/train_step.py --compiled --preset gpt2-small --layers 2 --seq 512 1024 2048 \
        --impls auto chunked --dropouts config --interleave        # compiled step and compile time
    python benchmarks/train_step.py --family llama --device cuda --dtype bf16 --seq 1024 --dropouts config \
        --quick                                        # SmolLM-135M's shape: 30 x 576, 9 query heads on 3 kv heads

One forward + backward of a model built from its family's default config (GPT-2's, BERT's or Llama's, at the
preset's size; ``--vocab`` random tokens: 1000 by default for GPT-2 and BERT, GPT-2's real vocabulary is 50257,
and Llama's default is SmolLM-135M's 49152), every layer patched as a user writes it,
``patch_model(model, scorer, h=4)`` with every other option at its default. Each model runs in train mode with its
config's attention dropout (0.1 for GPT-2 and BERT; Llama's config has 0, so for Llama ``config`` and ``zero`` are
the same) and again with attention dropout 0 (``--dropouts``): the first is what fine-tuning runs, the second the
linear-memory class that FlashAttention keeps on a GPU whatever the dropout. Each configuration runs in its own
process so peak memory (resident set size on CPU, the allocator's peak on CUDA) belongs to it alone. Reports the
median step time, peak memory, and both as ratios to the unpatched model (transformers' SDPA, or ``--base eager``)
with the same dropout,
and memory also against the unpatched model with no attention dropout; writes a markdown table and, with matplotlib
installed, a plot of how each grows with n. ``--interleave`` takes the step times from one more process per length
and dropout that runs a step of every configuration in turn, so that a machine whose speed drifts (a shared VM)
slows them all alike; peak memory still comes from the separate processes. ``--padded`` pads every row but the
first from the middle of the sequence (an encoder batch of unequal lengths; ``--padding_side left``: a decoder batch
padded for generation, whose leading pad rows see no key). ``--dtype bf16``/``fp16`` runs the step
under autocast (fp32 weights, half-precision matmuls), as mixed-precision training does. ``default``/``auto`` rows
also say which path the rule chose for the model's attention calls (recorded from an eager forward of the model,
compiled or not: the rule picks the same paths while ``torch.compile`` traces). ``--dry_run`` prints the child
commands without running them. A configuration that fails in the interleaved process (a kernel that does not
compile, memory) is reported as an error row; the others are still timed.

``--compiled`` runs every model, the unpatched one included, as ``torch.compile(model, fullgraph=True)`` (inductor,
with its caches off so that every configuration compiles from scratch) and adds the compile time: the first step's
time (tracing, compiling forward and backward, running) less the median step's, and its ratio to the unpatched
model's; with ``--interleave`` both come from the interleaved process. ``--quick`` skips the processes per
configuration (no memory columns) and times in the interleaved process alone: the smallest run, for a check.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
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

VOCAB = 1000  # GPT-2's and BERT's default --vocab; Llama's is SmolLM-135M's
# Attention dropout settings: "config" keeps the family's config default, "zero" sets attention dropout to 0
# (residual and embedding dropout keep their defaults in both). Llama's config default is 0: the two are the same.
DROPOUTS = ("config", "zero")
ATTENTION_DROPOUT_FIELD = {"gpt2": "attn_pdrop", "bert": "attention_probs_dropout_prob", "llama": "attention_dropout"}


def build_model(args, dropout: str):
    """The family's model at the preset's size, from its default config, with attention dropout as ``dropout`` says;
    and the batch a step trains on."""
    import torch
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
    )

    device = torch.device(args.device)
    torch.manual_seed(0)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), device=device)
    if args.family == "gpt2":
        config = GPT2Config(
            vocab_size=args.vocab, n_embd=args.width, n_layer=args.layers, n_head=args.heads, n_positions=args.seq
        )
        model_class, batch = GPT2LMHeadModel, {"input_ids": ids, "labels": ids}
    elif args.family == "llama":
        config = LlamaConfig(**llama_shape(args), max_position_embeddings=args.seq)
        model_class, batch = LlamaForCausalLM, {"input_ids": ids, "labels": ids}
    else:
        config = BertConfig(
            vocab_size=args.vocab, hidden_size=args.width, num_hidden_layers=args.layers,
            num_attention_heads=args.heads, intermediate_size=4 * args.width, max_position_embeddings=args.seq,
        )  # fmt: skip
        labels = torch.zeros(args.batch, dtype=torch.long, device=device)
        model_class, batch = BertForSequenceClassification, {"input_ids": ids, "labels": labels}
    if dropout == "zero":
        setattr(config, ATTENTION_DROPOUT_FIELD[args.family], 0.0)
    config._attn_implementation = args.base
    if args.padded:
        mask = torch.ones(args.batch, args.seq, dtype=torch.long, device=device)
        # Every row but the first padded from the middle: on the right (an encoder batch), or on the left (a decoder
        # batch as tokenizers pad for generation, whose leading pad rows see no key).
        pads = slice(args.seq // 2, None) if args.padding_side == "right" else slice(None, args.seq // 2)
        mask[1:, pads] = 0
        batch["attention_mask"] = mask
    return model_class(config).to(device), batch


def llama_shape(args) -> dict:
    """SmolLM-135M's LlamaConfig fields with the run's layers, width, heads, kv heads and vocabulary; the MLP
    keeps SmolLM's ratio to the width (1536 / 576)."""
    return {
        **SMOLLM_135M, "vocab_size": args.vocab, "hidden_size": args.width, "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads, "num_key_value_heads": args.kv_heads,
        "intermediate_size": SMOLLM_135M["intermediate_size"] * args.width // SMOLLM_135M["hidden_size"],
    }  # fmt: skip


def build(args, dropout: str, scorer_name: str, impl: str):
    """One configuration, patched as asked: (a function running one training step, the path the ``default``/
    ``auto`` rule resolves to, or ``impl``)."""
    import torch

    import hf_neural_attn

    device = torch.device(args.device)
    model, batch = build_model(args, dropout)
    if scorer_name != "none":
        options = scorer_options(scorer_name, args.proj_dim)
        if impl != "default":  # "default": what patch_model(model, scorer, h=4) gives, no impl named
            options["impl"] = impl
        hf_neural_attn.patch_model(model, scorer_name, h=args.h, **options)
    model.train()
    dtype = getattr(torch, AUTOCAST_DTYPES[args.dtype]) if AUTOCAST_DTYPES[args.dtype] else None
    resolved = impl
    if scorer_name != "none" and impl in ("auto", "default"):
        resolved = chosen_paths(model, batch, device, dtype)

    forward = model
    if args.compiled:
        # transformers looks the loss function up on every call and logs a warning for a model without a known
        # loss_type (GPT-2 here), which would break the graph: looked up once, here.
        model.loss_function = model.loss_function
        forward = torch.compile(model, fullgraph=True)

    def step():
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            loss = forward(**batch).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()

    return step, resolved


def chosen_paths(model, batch: dict, device, dtype) -> str:
    """The path(s) the ``auto`` rule picks for ``model``'s attention calls, from one eager forward in train mode
    under the step's autocast; a compiled model runs the same (see common.recording_paths for why its forward is
    not recorded itself). Without grad, which the rule does not read: the activations a forward keeps for backward
    would count in a CPU run's peak memory (the process's resident set keeps its maximum)."""
    import torch

    with (
        recording_paths() as calls,
        torch.no_grad(),
        torch.autocast(device.type, dtype=dtype, enabled=dtype is not None),
    ):
        model(**batch)
    return paths_taken(calls)


def measure(args) -> dict:
    """Run in a child process: build, patch, warm up, time ``--steps`` training steps; peak memory."""
    import torch

    device = torch.device(args.device)
    step, resolved = build(args, args.dropout, args.scorer, args.impl)
    warm_up_compiler(args)
    first_step_s = timed(step)  # warm-up (compiled: the compile)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    median = statistics.median(timed(step) for _ in range(args.steps))
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    result = {"time_s": median, "peak_bytes": peak, "resolved_impl": resolved}
    return result | ({"compile_s": first_step_s - median} if args.compiled else {})


def measure_interleaved(args, runs: list[tuple[str, str]]) -> dict[str, dict]:
    """Run in a child process: every configuration's model, one step each in turn for ``--steps`` rounds, so
    that the machine's drifts in speed hit all of them alike; per configuration the median step time
    (``time_s``), the path the rule chose (``resolved_impl``) and, compiled, the compile time (``compile_s``), or
    ``error`` for a configuration that failed to build or to run its first step (the others are timed still)."""
    warm_up_compiler(args)
    built, failed, first_steps = {}, {}, {}
    for scorer, impl in runs:
        name = f"{scorer}/{impl}"
        try:
            built[name] = build(args, args.dropout, scorer, impl)
            # The warm-up step (compiled: the compile, from scratch: caches are off).
            first_steps[name] = timed(built[name][0])
        except Exception as error:  # one failing configuration must not take the others' numbers with it
            built.pop(name, None)
            failed[name] = {"error": f"{type(error).__name__}: {error}".splitlines()[0][:300]}
            print(f"{name}: {failed[name]['error']}", file=sys.stderr)
        if name in failed:  # out of the except block, whose exception still holds the model's frames
            free_device_memory(args)
    times = {name: [] for name in built}
    for _ in range(args.steps):
        for name, (step, _) in built.items():
            times[name].append(timed(step))
    results = {}
    for name, (_, resolved) in built.items():
        median = statistics.median(times[name])
        results[name] = {"time_s": median, "resolved_impl": resolved}
        if args.compiled:
            results[name]["compile_s"] = first_steps[name] - median
    return results | failed


def free_device_memory(args) -> None:
    """After a failed configuration: give its CUDA memory back, so the next one is not short of it."""
    if args.device.startswith("cuda"):
        import gc

        import torch

        gc.collect()
        torch.cuda.empty_cache()


def warm_up_compiler(args) -> None:
    """Compiled: compile and run a training step of one linear layer, so that what a process pays once (inductor's
    imports, its checks of the C++ toolchain) falls on no configuration's compile time, the first one's least of
    all."""
    if not args.compiled:
        return
    import torch

    layer = torch.nn.Linear(8, 8, device=args.device)
    torch.compile(layer, fullgraph=True)(torch.ones(2, 8, device=args.device)).sum().backward()


def timed(step) -> float:
    """The seconds one call of ``step`` takes."""
    started = time.perf_counter()
    step()
    return time.perf_counter() - started


AUTOCAST_DTYPES = {"fp32": None, "bf16": "bfloat16", "fp16": "float16"}
# "default" names no impl (what a user gets from patch_model(model, scorer)); "auto" names the same rule.
IMPLS = ("default", "reference", "chunked", "triton", "auto")
# Model shapes: (layers, width, heads, kv heads). cpu-small is the shape of the CPU targets, gpt2-small the
# GPU targets' GPT-2 small, smollm-135m SmolLM-135M's (Llama only: grouped-query attention).
PRESETS = {
    "cpu-small": (4, 256, 4, 4),
    "gpt2-small": (12, 768, 12, 12),
    "smollm-135m": tuple(
        SMOLLM_135M[field]
        for field in ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads")
    ),
}


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The options that say which models a step trains: family, shape, batch, attention, scorers and paths."""
    parser.add_argument(
        "--family",
        choices=sorted(ATTENTION_DROPOUT_FIELD),
        default="gpt2",
        help="llama: LlamaForCausalLM (SmolLM-135M's config fields; its attention dropout is 0)",
    )
    parser.add_argument(
        "--seq", type=int, nargs="+", default=None, help="default: 256 ... 2048 on CPU, 1024 ... 8192 on CUDA"
    )
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--padded", action="store_true", help="pad every row but the first from the middle")
    parser.add_argument("--padding_side", choices=["right", "left"], default="right", help="where --padded pads")
    parser.add_argument(
        "--base", choices=["sdpa", "eager"], default="sdpa", help="the model's attn_implementation (the patch's base)"
    )
    parser.add_argument(
        "--dropouts",
        nargs="+",
        choices=DROPOUTS,
        default=list(DROPOUTS),
        help="config: the config's attention dropout (0.1 for gpt2 and bert, 0 for llama); zero: attention dropout 0",
    )
    parser.add_argument("--scorers", nargs="+", default=["qana", "neural"], choices=["qana", "neural"])
    parser.add_argument(
        "--impls",
        nargs="+",
        default=None,
        choices=IMPLS,
        help="default: default (the path the rule picks) on CPU, default triton chunked on CUDA",
    )
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default=None,
        help="model shape; default smollm-135m for llama, else cpu-small on CPU and gpt2-small on CUDA",
    )
    parser.add_argument("--layers", type=int, default=None, help="overrides the preset")
    parser.add_argument("--width", type=int, default=None, help="overrides the preset")
    parser.add_argument("--heads", type=int, default=None, help="overrides the preset")
    parser.add_argument(
        "--kv_heads", type=int, default=None, help="key/value heads, llama only (default: the preset's, or --heads)"
    )
    parser.add_argument(
        "--vocab",
        type=int,
        default=None,
        help=f"vocabulary size (default {VOCAB}; llama: SmolLM-135M's 49152); GPT-2's real vocabulary is 50257",
    )
    parser.add_argument("--h", type=int, default=4)
    parser.add_argument("--proj_dim", type=int, default=None, help="Neural Attention's proj_dim (default: none)")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--steps", type=int, default=None, help="timed steps; default 3 on CPU, 10 on CUDA")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument(
        "--dtype",
        choices=sorted(AUTOCAST_DTYPES),
        default="fp32",
        help="bf16/fp16: the step runs under autocast in that dtype",
    )
    parser.add_argument("--output_dir", default="benchmarks/results")
    parser.add_argument("--name", default=None, help="the output files' stem (default: from family and device)")
    parser.add_argument(
        "--interleave",
        action="store_true",
        help="time every configuration of a length and dropout in one process, a step of each in turn (memory "
        "still comes from one process per configuration): ratios that hold on a machine whose speed drifts",
    )
    parser.add_argument(
        "--compiled",
        action="store_true",
        help="torch.compile(model, fullgraph=True) every model, the unpatched one too, and report the compile time",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="time in the interleaved process only (implies --interleave; no processes per configuration, no "
        "memory columns): the smallest run",
    )
    parser.add_argument("--dry_run", action="store_true", help="print the child commands, run nothing")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dropout", default="config", help=argparse.SUPPRESS)
    parser.add_argument("--scorer", default="none", help=argparse.SUPPRESS)
    parser.add_argument("--impl", default="reference", help=argparse.SUPPRESS)
    parser.add_argument("--runs", default=None, help=argparse.SUPPRESS)  # interleaved child: scorer/impl,...
    args = parser.parse_args(argv)

    # The parent checks that torch sees the GPU (its children, started only then, need not; a dry run needs none).
    check_device(parser, args.device, present=not (args.child or args.dry_run))
    cuda = args.device.startswith("cuda")
    resolve_shape(parser, args, cuda)
    if args.padded and args.batch < 2:
        parser.error("--padded pads every row but the first: give --batch 2 or more")
    args.seq = args.seq or ([1024, 2048, 4096, 8192] if cuda else [256, 512, 1024, 2048])
    args.impls = args.impls or (["default", "triton", "chunked"] if cuda else ["default"])
    args.steps = args.steps or (10 if cuda else 3)
    args.interleave = args.interleave or args.quick
    if not cuda and "triton" in args.impls and not args.child:
        print("note: impl=triton runs on CUDA only; on CPU its rows will report the error", file=sys.stderr)
    return args


def resolve_shape(parser: argparse.ArgumentParser, args: argparse.Namespace, cuda: bool) -> None:
    """Fill layers, width, heads, kv heads and vocabulary from the preset where not given, and check they fit."""
    default_preset = "smollm-135m" if args.family == "llama" else "gpt2-small" if cuda else "cpu-small"
    args.preset = args.preset or default_preset
    layers, width, heads, kv_heads = PRESETS[args.preset]
    args.layers = args.layers or layers
    args.width = args.width or width
    args.heads = args.heads or heads
    # A preset's kv heads hold for its own head count; with --heads overridden the default is plain multi-head.
    args.kv_heads = args.kv_heads or (kv_heads if args.heads == heads else args.heads)
    args.vocab = args.vocab or (SMOLLM_135M["vocab_size"] if args.family == "llama" else VOCAB)
    if args.width % args.heads:
        parser.error(f"--width {args.width} is not a multiple of --heads {args.heads}")
    if args.family != "llama" and args.kv_heads != args.heads:
        parser.error(
            f"--family {args.family} has no grouped-query attention: {args.kv_heads} kv heads for {args.heads} "
            f"heads (--preset {args.preset}); use --family llama, or a preset or --kv_heads with kv heads = heads"
        )
    if args.heads % args.kv_heads:
        parser.error(f"--heads {args.heads} is not a multiple of --kv_heads {args.kv_heads}")


def interleave(args, seq: int, dropout: str, runs, shared: list[str], results: list[dict]) -> None:
    """Replace the step times (and compile times) of length ``seq`` and ``dropout`` in ``results`` by those of one
    interleaved child; with ``--quick`` there are no rows yet, and the child's make them."""
    listed = ",".join(f"{scorer}/{impl}" for scorer, impl in runs)
    command = [sys.executable, __file__, "--child", f"--seq={seq}", f"--dropout={dropout}", f"--runs={listed}", *shared]
    if args.dry_run:
        print(" ".join(command))
        return
    finished = subprocess.run(command, check=False, capture_output=True, text=True, env=child_env(args))
    if finished.returncode == 0:
        measured = json.loads(finished.stdout.strip().splitlines()[-1])
    else:  # the whole process failed (killed, out of memory): every configuration of this length says so
        lines = finished.stderr.strip().splitlines() or [f"exit status {finished.returncode}"]
        print(f"n={seq} {dropout}: the interleaved timing failed: {finished.stderr.strip()[-2000:]}", file=sys.stderr)
        measured = {f"{scorer}/{impl}": {"error": f"interleaved process: {lines[-1]}"} for scorer, impl in runs}
    if args.quick:
        for scorer, impl in runs:
            results.append({"seq": seq, "dropout": dropout, "scorer": scorer, "impl": impl})
    for result in results:
        if result["seq"] == seq and result["dropout"] == dropout and "error" not in result:
            entry = measured[f"{result['scorer']}/{result['impl']}"]
            if "error" in entry and not args.quick:  # its time stays the one its own process measured
                result["interleaved_error"] = entry["error"]
            else:
                result.update(entry, **({} if "error" in entry else {"timed": "interleaved"}))
    times = ", ".join(
        f"{name} {row['time_s'] * 1e3:.1f} ms" if "time_s" in row else f"{name} {row['error']}"
        for name, row in measured.items()
    )
    print(f"n={seq:5d} {dropout} interleaved times: {times}", flush=True)


def child_env(args) -> dict[str, str]:
    """A child's environment: compiled, with inductor's caches off, so that each configuration's compile time is
    a compile from scratch (not the kernels an earlier run or configuration left in the cache)."""
    return {**os.environ, "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1"} if args.compiled else dict(os.environ)


def main() -> None:
    args = parse_args()
    if args.child:
        args.seq = args.seq[0]
        if args.runs:
            runs = [tuple(run.split("/")) for run in args.runs.split(",")]
            print(json.dumps(measure_interleaved(args, runs)))
        else:
            print(json.dumps(measure(args)))
        return
    runs = [("none", args.base)] + [(scorer, impl) for scorer in args.scorers for impl in args.impls]
    keys = ("family", "batch", "layers", "width", "heads", "kv_heads", "vocab", "h", "steps", "device", "dtype")
    shared = [f"--{k}={getattr(args, k)}" for k in keys] + (["--compiled"] if args.compiled else [])
    shared += [f"--proj_dim={args.proj_dim}"] if args.proj_dim else []
    shared += ["--padded", f"--padding_side={args.padding_side}"] if args.padded else []
    shared += [f"--base={args.base}"]
    results = []
    for seq in args.seq:
        for dropout in args.dropouts:
            for scorer, impl in runs if not args.quick else ():
                command = [sys.executable, __file__, "--child", f"--seq={seq}", f"--dropout={dropout}"]
                command += [f"--scorer={scorer}", f"--impl={impl}"]
                row = {"seq": seq, "dropout": dropout, "scorer": scorer, "impl": impl}
                if args.dry_run:
                    print(" ".join(command + shared))
                    continue
                finished = subprocess.run(
                    command + shared, check=False, capture_output=True, text=True, env=child_env(args)
                )
                if finished.returncode != 0:
                    error = finished.stderr.strip().splitlines()[-1] if finished.stderr.strip() else "failed"
                    print(f"n={seq} {dropout} {scorer}/{impl}: {error}", file=sys.stderr)
                    results.append({**row, "error": error})
                    continue
                result = json.loads(finished.stdout.strip().splitlines()[-1])
                results.append({**row, **result})
                print(
                    f"n={seq:5d} {dropout:>6} {scorer:>6}/{label(results[-1]):<22} {result['time_s'] * 1e3:9.1f} ms  "
                    f"{result['peak_bytes'] / 2**20:8.0f} MiB",
                    flush=True,
                )
            if args.interleave:
                interleave(args, seq, dropout, runs, shared, results)
    if args.dry_run:
        return

    table = report(results, args)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = args.name or f"train_step_{args.family}{device_suffix(args.device, args.dtype)}"
    (out / f"{stem}.json").write_text(json.dumps({"setup": vars(args), "results": results}, indent=2, default=str))
    (out / f"{stem}.md").write_text(table)
    plot(results, out / f"{stem}.png")
    print("\n" + table)


def label(result: dict) -> str:
    """The impl, with the path ``default``/``auto`` chose."""
    resolved = result.get("resolved_impl")
    chosen = result["impl"] in ("auto", "default") and resolved
    return f"{result['impl']} -> {resolved}" if chosen else result["impl"]


def report(results, args) -> str:
    baseline = {(r["seq"], r["dropout"]): r for r in results if r["scorer"] == "none" and "error" not in r}
    machine = describe_machine(args.device)
    precision = "fp32" if args.dtype == "fp32" else f"{args.dtype} autocast"
    timing = (
        ", timed interleaved (per length and dropout, one process running a step of each configuration in turn)"
        if args.interleave
        else ""
    )
    compiled = (
        "; every model (the unpatched one too) as torch.compile(model, fullgraph=True), inductor with its caches off; "
        "compile s = the first step's time less the median step's"
        if args.compiled
        else ""
    )
    shape = {"gpt2": "GPT-2", "bert": "BERT (sequence classification)", "llama": "Llama (causal LM)"}[args.family]
    heads = f"{args.heads} heads" + (f" on {args.kv_heads} kv heads" if args.kv_heads != args.heads else "")
    padding = f", rows 2 and on padded from the middle on the {args.padding_side}" if args.padded else ""
    neural = f"neural proj_dim={args.proj_dim}" if args.proj_dim else "neural with its default options"
    config_dropout = " (0: Llama's config has none, so config = zero)" if args.family == "llama" else " (0.1)"
    setup = (
        f"{shape} from its default config, {args.layers} layers x {args.width} wide x {heads}, vocabulary "
        f"{args.vocab}, batch {args.batch}{padding}, train mode, all layers patched with h={args.h}, {neural}, "
        f"{precision}; dropout: config = the config's attention dropout{config_dropout}, zero = attention dropout 0; "
        f"median of {args.steps} steps{timing}{compiled}; machine: {machine}."
    )
    header = ["n", "dropout", "scorer", "impl", "step ms", "x unpatched"]
    header += ["compile s", "x unpatched"] if args.compiled else []
    header += [] if args.quick else ["peak MiB", "x unpatched", "x unpatched, zero"]
    lines = [setup, "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in results:
        cells = [str(r["seq"]), r["dropout"], r["scorer"], label(r)]
        if "error" in r:
            error = r["error"].replace("|", "/")  # a | would split the table's cell
            lines.append("| " + " | ".join(cells + [error] + [""] * (len(header) - 5)) + " |")
            continue
        base = baseline.get((r["seq"], r["dropout"]))
        cells += [f"{r['time_s'] * 1e3:.1f}", ratio(r, base, "time_s")]
        if args.compiled:
            cells += [f"{r['compile_s']:.1f}", ratio(r, base, "compile_s")]
        if not args.quick:
            base_zero = baseline.get((r["seq"], "zero"))
            cells += [f"{r['peak_bytes'] / 2**20:.0f}", ratio(r, base, "peak_bytes"), ratio(r, base_zero, "peak_bytes")]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        f"\nn={r['seq']} {r['dropout']} {r['scorer']}/{r['impl']}: the interleaved timing failed "
        f"({r['interleaved_error']}); its step time comes from its own process."
        for r in results
        if "interleaved_error" in r
    ]
    return "\n".join(lines) + "\n"


def ratio(result: dict, base: dict | None, key: str) -> str:
    """``result[key]`` over the unpatched row's, or n/a without one."""
    return f"{result[key] / base[key]:.2f}" if base else "n/a"


def plot(results, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return
    panels = [("time_s", 1e3, "step time (ms)")]
    panels += [("compile_s", 1, "compile time (s)")] if any("compile_s" in r for r in results) else []
    panels += [("peak_bytes", 2**-20, "peak memory (MiB)")] if any("peak_bytes" in r for r in results) else []
    figure, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for key in sorted({(r["dropout"], r["scorer"], r["impl"]) for r in results}):
        points = [r for r in results if (r["dropout"], r["scorer"], r["impl"]) == key and "error" not in r]
        name = f"unpatched ({key[2]})" if key[1] == "none" else f"{key[1]} / {key[2]}"
        label_text = f"{name}, dropout {key[0]}"
        for axis, (field, scale, _) in zip(axes[0], panels, strict=True):
            axis.plot([p["seq"] for p in points], [p[field] * scale for p in points], marker="o", label=label_text)
    for axis, (_, _, title) in zip(axes[0], panels, strict=True):
        axis.set_xlabel("sequence length n")
        axis.set_title(title)
        axis.set_xscale("log", base=2)
        axis.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
