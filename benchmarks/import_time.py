"""What importing the library and starting a recipe cost, in fresh processes, interleaved.

    python benchmarks/import_time.py                 # 7 rounds
    python benchmarks/import_time.py --rounds 15 --json out.json

Each round starts one process per command, in turn, so a machine whose speed drifts slows them all alike:

* ``import torch, transformers`` (the floor every user of the library pays anyway);
* the same, then ``import hf_neural_attn`` (what the library adds: the target is at most 0.5 s over the floor);
* the same, then ``from transformers import LlamaForCausalLM`` (transformers' modeling stack, which the library sets
  up its loading hooks in once it is imported);
* ``python -m recipes.finetune --help``, ``recipes.compare --help``, ``recipes.sweep --help`` (the target is 4 s).

Reports each command's median wall time and the library's median cost over the floor, measured within each round.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FLOOR = "import torch, transformers"
IMPORTS = {
    "torch + transformers": FLOOR,
    "+ hf_neural_attn": f"{FLOOR}; import hf_neural_attn",
    "+ hf_neural_attn + a model class": f"{FLOOR}; import hf_neural_attn; from transformers import LlamaForCausalLM",
}
HELPS = {f"recipes.{name} --help": ["-m", f"recipes.{name}", "--help"] for name in ("finetune", "compare", "sweep")}


def seconds(arguments: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, *arguments], cwd=ROOT, check=True, capture_output=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--no_recipes", action="store_true", help="time the imports only")
    parser.add_argument("--json", type=Path, help="also write the times here")
    args = parser.parse_args()
    commands = {name: ["-c", code] for name, code in IMPORTS.items()}
    if not args.no_recipes:
        commands.update(HELPS)
    times: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(args.rounds):
        for name, arguments in commands.items():
            times[name].append(seconds(arguments))
    over_floor = [lib - floor for lib, floor in zip(times["+ hf_neural_attn"], times["torch + transformers"])]
    print(f"{platform.processor() or platform.machine()}, Python {platform.python_version()}, {args.rounds} rounds")
    print("| command | median s | min s |\n|---|---|---|")
    for name, values in times.items():
        print(f"| `{name}` | {statistics.median(values):.2f} | {min(values):.2f} |")
    print(
        f"\nimport hf_neural_attn over the floor: median {statistics.median(over_floor):.2f} s (target: at most 0.5 s)"
    )
    if args.json:
        args.json.write_text(json.dumps({"times": times, "library_over_floor": over_floor}, indent=2))


if __name__ == "__main__":
    main()
