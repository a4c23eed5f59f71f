"""QLoRA with the scorers against QLoRA without them: a training step and a decoded token on a 4-bit base, measured in
the same run.

    python benchmarks/qlora.py                                  # GPT-2 small and the 135M Llama shape, batch 4 x 256
    python benchmarks/qlora.py --presets llama-135m --batch 8 --seq 128
    python benchmarks/qlora.py --quick                          # tiny sizes, one step: checks that it runs

Each preset's model is built from its config (random weights: speed and memory do not depend on their values), saved,
and loaded back as a user loads a base for QLoRA: bitsandbytes 4-bit NF4 (``--compute_dtype`` for its matmuls,
float32 by default as on a CPU), ``prepare_model_for_kbit_training``, then (for the patched rows)
``patch_model(model, scorer, h=4)`` on every layer, then LoRA of rank ``--lora_r`` on every linear layer with the
scorers as ``modules_to_save``. Dropout is the family's default (GPT-2: 0.1 on attention; Llama: none). A training
step is forward, backward and an AdamW step on random tokens; a decoded token is one forward of one token against the
KV cache after a ``--prompt``-token prefill, timed on its own (never as the difference of two timed runs), the LoRA
adapters active.

Each configuration runs in its own process, so that its peak memory (resident set size) is its own; the step and
token times come from one more process per preset that runs every configuration in turn (``--rounds`` times), so
that a machine whose speed drifts slows them all alike. The table gives medians and ratios to the unpatched QLoRA
model, and the floor the scorers cannot go below: their parameters in float32 trained by AdamW, 20 bytes each (the
copy PEFT trains, its gradient, two moments, and the frozen original PEFT keeps for the adapters' off switch).
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PRESETS = {
    # GPT-2 small: 12 layers, 768 wide, 12 heads; its own vocabulary.
    "gpt2-small": ("gpt2", {"n_embd": 768, "n_layer": 12, "n_head": 12, "vocab_size": 50257, "n_positions": 1024}),
    # The shape of SmolLM-135M, a 135M Llama: 30 layers, 576 wide, 9 heads sharing 3 key/value heads.
    "llama-135m": (
        "llama",
        {
            "hidden_size": 576,
            "intermediate_size": 1536,
            "num_hidden_layers": 30,
            "num_attention_heads": 9,
            "num_key_value_heads": 3,
            "vocab_size": 49152,
            "max_position_embeddings": 2048,
            "tie_word_embeddings": True,
        },
    ),
    "tiny": (
        "llama",
        {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 256,
        },
    ),
}
VARIANTS = ("none", "qana", "neural")  # none: QLoRA of the unpatched model
FLOOR_BYTES_PER_PARAMETER = 20


def save_base(preset: str, folder: Path) -> None:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    family, sizes = PRESETS[preset]
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(**sizes)) if family == "gpt2" else LlamaForCausalLM(LlamaConfig(**sizes))
    model.save_pretrained(folder)


def qlora_model(folder: str, variant: str, args):
    """The base in 4-bit NF4, prepared for k-bit training, patched (unless ``variant`` is none), LoRA on top."""
    import torch
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    import hf_neural_attn

    quantization = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=getattr(torch, args.compute_dtype)
    )
    model = AutoModelForCausalLM.from_pretrained(folder, quantization_config=quantization, dtype=torch.float32)
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    to_save = None
    if variant != "none":
        torch.manual_seed(1)
        hf_neural_attn.patch_model(model, variant, h=4)
        to_save = hf_neural_attn.peft_modules_to_save(model)
    config = LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, target_modules="all-linear", modules_to_save=to_save)
    return get_peft_model(model, config)


class Measured:
    """One configuration's model, its optimizer and its inputs; times a training step and a decoded token."""

    def __init__(self, folder: str, variant: str, args):
        import torch

        self.model = qlora_model(folder, variant, args)
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(trainable, lr=1e-4)
        vocab = self.model.config.vocab_size
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (args.batch, args.seq), generator=generator)
        self.prompt = torch.randint(0, vocab, (1, args.prompt), generator=generator)
        self.scorer_parameters = sum(
            p.numel() for n, p in self.model.named_parameters() if p.requires_grad and ".attn_scorer." in n
        )

    def train_step(self) -> float:
        self.model.train()
        started = time.perf_counter()
        self.model(input_ids=self.ids, labels=self.ids).loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - started

    def decode_tokens(self, count: int) -> list[float]:
        """Each of ``count`` decoded tokens timed alone, after a prefill of the prompt (not timed)."""
        import torch

        self.model.eval()
        times = []
        with torch.no_grad():
            output = self.model(input_ids=self.prompt, use_cache=True)
            for _ in range(count):
                token = output.logits[:, -1:].argmax(-1)
                started = time.perf_counter()
                output = self.model(input_ids=token, past_key_values=output.past_key_values, use_cache=True)
                times.append(time.perf_counter() - started)
        return times


def child(args) -> None:
    """One process: ``--child VARIANT`` measures that configuration alone (its peak memory is the process's);
    ``--child all`` runs every configuration in turn, ``--rounds`` times, for the time ratios."""
    import torch

    torch.set_num_threads(args.threads)
    variants = VARIANTS if args.child == "all" else (args.child,)
    measured = {variant: Measured(args.folder, variant, args) for variant in variants}
    for item in measured.values():  # warm-up: first-call costs (allocations, lazy imports) out of the timings
        item.train_step()
        item.decode_tokens(1)
    steps = {variant: [] for variant in variants}
    tokens = {variant: [] for variant in variants}
    for _ in range(args.rounds):
        for variant, item in measured.items():
            steps[variant].append(item.train_step())
            tokens[variant] += item.decode_tokens(args.decode)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({
        variant: {
            "step_s": statistics.median(steps[variant]),
            "token_ms": 1000 * statistics.median(tokens[variant]),
            "scorer_parameters": measured[variant].scorer_parameters,
            "peak_mb": peak_mb,
        }
        for variant in variants
    }))  # fmt: skip


def run_child(args, folder: Path, which: str) -> dict:
    command = [sys.executable, __file__, "--child", which, "--folder", str(folder), *child_flags(args)]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def child_flags(args) -> list[str]:
    return [
        *("--batch", str(args.batch), "--seq", str(args.seq), "--prompt", str(args.prompt)),
        *("--decode", str(args.decode), "--rounds", str(args.rounds), "--lora_r", str(args.lora_r)),
        *("--compute_dtype", args.compute_dtype, "--threads", str(args.threads)),
    ]


def measure_preset(args, preset: str) -> list[dict]:
    with tempfile.TemporaryDirectory() as folder:
        save_base(preset, Path(folder))
        alone = {variant: run_child(args, Path(folder), variant)[variant] for variant in VARIANTS}
        interleaved = run_child(args, Path(folder), "all")
    rows = []
    for variant in VARIANTS:
        time_row, base_time = interleaved[variant], interleaved["none"]
        floor_mb = alone[variant]["scorer_parameters"] * FLOOR_BYTES_PER_PARAMETER / 2**20
        rows.append({
            "preset": preset,
            "variant": variant,
            "step_s": time_row["step_s"],
            "step_ratio": time_row["step_s"] / base_time["step_s"],
            "token_ms": time_row["token_ms"],
            "token_ratio": time_row["token_ms"] / base_time["token_ms"],
            "peak_mb": alone[variant]["peak_mb"],
            "peak_ratio": alone[variant]["peak_mb"] / alone["none"]["peak_mb"],
            "peak_over_mb": alone[variant]["peak_mb"] - alone["none"]["peak_mb"],
            "scorer_parameters": alone[variant]["scorer_parameters"],
            "floor_mb": floor_mb,
        })  # fmt: skip
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        "| model | scorer | train step (s) | × unpatched | decoded token (ms) | × unpatched | peak RSS (MB) | "
        "× unpatched | + MB | scorer params | floor (MB) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['preset']} | {r['variant']} | {r['step_s']:.3f} | {r['step_ratio']:.2f} | {r['token_ms']:.1f} | "
            f"{r['token_ratio']:.2f} | {r['peak_mb']:.0f} | {r['peak_ratio']:.2f} | {r['peak_over_mb']:+.0f} | "
            f"{r['scorer_parameters']:,} | {r['floor_mb']:.1f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", nargs="+", default=["gpt2-small", "llama-135m"], choices=tuple(PRESETS))
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=128, help="prefill length before the decoded tokens")
    parser.add_argument("--decode", type=int, default=16, help="decoded tokens timed per round")
    parser.add_argument("--rounds", type=int, default=3, help="training steps (and decode runs) per configuration")
    parser.add_argument("--lora_r", type=int, default=16)
    parser.add_argument("--compute_dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="the tiny preset, batch 1 x 16, one round")
    parser.add_argument("--json", type=str, default=None, help="also write the rows to this file")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--folder", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args)
    if args.quick:
        args.presets, args.batch, args.seq, args.prompt, args.decode, args.rounds = ["tiny"], 1, 16, 8, 2, 1
    import torch

    print(f"machine: {platform.processor() or platform.machine()}, {args.threads} threads, torch {torch.__version__}")
    print(f"batch {args.batch} x {args.seq} tokens; prompt {args.prompt}; LoRA r={args.lora_r}; 4-bit NF4 base\n")
    rows = [row for preset in args.presets for row in measure_preset(args, preset)]
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
