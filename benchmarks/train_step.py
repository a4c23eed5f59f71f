"""Training-step cost of patched models against the unpatched one, measured in the same run.

    python benchmarks/train_step.py                       # CPU defaults: 4 layers x 256 wide x 4 heads
    python benchmarks/train_step.py --seq 256 512 1024 2048 --scorers qana neural --impls reference chunked

One forward + backward of a GPT-2-shaped model on random tokens, batch 1, every layer patched. Each
configuration runs in its own process so peak memory (resident set size on CPU, the allocator's peak
on CUDA) belongs to it alone. Reports the median step time, peak memory, and both as ratios to the
unpatched model (transformers' SDPA) at the same sequence length; writes a markdown table and, with
matplotlib installed, a plot of how each grows with n.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path


def measure(args) -> dict:
    """Run in a child process: build, patch, warm up, time ``--steps`` training steps."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    import hf_neural_attn

    device = torch.device(args.device)
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=512, n_embd=args.width, n_layer=args.layers, n_head=args.heads, n_positions=args.seq,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    model = GPT2LMHeadModel(config).to(device)
    if args.scorer != "none":
        options = {"proj_dim": args.proj_dim} if args.scorer == "neural" else {}
        hf_neural_attn.patch_model(model, args.scorer, h=args.h, impl=args.impl, **options)
    model.train()
    ids = torch.randint(0, 512, (1, args.seq), device=device)
    dtype = torch.bfloat16 if args.bf16 else None

    def step():
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            loss = model(ids, labels=ids).loss
        loss.backward()
        model.zero_grad(set_to_none=True)

    step()  # warm-up
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.steps):
        started = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    return {"time_s": statistics.median(times), "peak_bytes": peak}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, nargs="+", default=[256, 512, 1024, 2048])
    parser.add_argument("--scorers", nargs="+", default=["qana", "neural"])
    parser.add_argument("--impls", nargs="+", default=["reference", "chunked"])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--h", type=int, default=4)
    parser.add_argument("--proj_dim", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--output_dir", default="benchmarks/results")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--scorer", default="none", help=argparse.SUPPRESS)
    parser.add_argument("--impl", default="reference", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child:
        args.seq = args.seq[0]
        print(json.dumps(measure(args)))
        return

    runs = [("none", "sdpa")] + [(scorer, impl) for scorer in args.scorers for impl in args.impls]
    shared = [f"--{k}={getattr(args, k)}" for k in ("layers", "width", "heads", "h", "proj_dim", "steps", "device")]
    shared += ["--bf16"] * args.bf16
    results = []
    for seq in args.seq:
        for scorer, impl in runs:
            command = [sys.executable, __file__, "--child", f"--seq={seq}", f"--scorer={scorer}", f"--impl={impl}"]
            finished = subprocess.run(command + shared, capture_output=True, text=True)
            if finished.returncode != 0:
                error = finished.stderr.strip().splitlines()[-1] if finished.stderr.strip() else "failed"
                print(f"n={seq} {scorer}/{impl}: {error}", file=sys.stderr)
                results.append({"seq": seq, "scorer": scorer, "impl": impl, "error": error})
                continue
            result = json.loads(finished.stdout.strip().splitlines()[-1])
            results.append({"seq": seq, "scorer": scorer, "impl": impl, **result})
            print(f"n={seq:5d} {scorer:>6}/{impl:<9} {result['time_s'] * 1e3:9.1f} ms  "
                  f"{result['peak_bytes'] / 2**20:8.0f} MiB", flush=True)

    table = report(results, args)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "train_step.json").write_text(json.dumps(results, indent=2))
    (out / "train_step.md").write_text(table)
    plot(results, out / "train_step.png")
    print("\n" + table)


def report(results, args) -> str:
    baseline = {r["seq"]: r for r in results if r["scorer"] == "none" and "error" not in r}
    machine = describe_machine(args.device)
    lines = [
        f"GPT-2 shape {args.layers} layers x {args.width} wide x {args.heads} heads, batch 1, all layers patched, "
        f"h={args.h}, neural proj_dim={args.proj_dim}, {'bf16 autocast' if args.bf16 else 'fp32'}; "
        f"median of {args.steps} steps; machine: {machine}.",
        "",
        "| n | scorer | impl | step ms | x unpatched | peak MiB | x unpatched |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['seq']} | {r['scorer']} | {r['impl']} | {r['error']} | | | |")
            continue
        base = baseline.get(r["seq"])
        time_ratio = f"{r['time_s'] / base['time_s']:.2f}" if base else "n/a"
        memory_ratio = f"{r['peak_bytes'] / base['peak_bytes']:.2f}" if base else "n/a"
        lines.append(
            f"| {r['seq']} | {r['scorer']} | {r['impl']} | {r['time_s'] * 1e3:.1f} | {time_ratio} | "
            f"{r['peak_bytes'] / 2**20:.0f} | {memory_ratio} |"
        )
    return "\n".join(lines) + "\n"


def describe_machine(device: str) -> str:
    import torch

    if device.startswith("cuda"):
        return f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as handle:
            cpu = next(line.split(":", 1)[1].strip() for line in handle if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__} (CPU)"


def plot(results, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return
    figure, (time_axis, memory_axis) = plt.subplots(1, 2, figsize=(10, 4))
    for key in sorted({(r["scorer"], r["impl"]) for r in results}):
        points = [r for r in results if (r["scorer"], r["impl"]) == key and "error" not in r]
        label = "unpatched (SDPA)" if key[0] == "none" else f"{key[0]} / {key[1]}"
        time_axis.plot([p["seq"] for p in points], [p["time_s"] * 1e3 for p in points], marker="o", label=label)
        memory_axis.plot([p["seq"] for p in points], [p["peak_bytes"] / 2**20 for p in points], marker="o", label=label)
    for axis, title in ((time_axis, "step time (ms)"), (memory_axis, "peak memory (MiB)")):
        axis.set_xlabel("sequence length n")
        axis.set_title(title)
        axis.set_xscale("log", base=2)
        axis.grid(alpha=0.3)
    time_axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
