"""What serving an fp32 checkpoint at vLLM's default dtype costs a patched model: prompt log-prob error against fp32.

    .venv/vllm/bin/python benchmarks/vllm_bf16_error.py                     # Llama 4 x 256, QANA on every layer
    .venv/vllm/bin/python benchmarks/vllm_bf16_error.py --layers 2 --hidden 128 --head_dim 32   # the tests' shape

Runs in the vLLM environment. A Llama of random weights (seed 0; grouped-query attention, ``--heads`` query heads on
``--kv_heads``) is saved in fp32 unpatched and patched with QANA on every layer, its scorers moved off their
function-preserving init (each new parameter drawn from N(0, ``--std``), as tests/integrations/test_vllm.py does).
Each folder is served by ``LLM(model=PATH)`` twice in this process (engines in-process), with ``dtype="auto"`` (what
docs/serving.md's example gives: on a CPU vLLM picks bfloat16 for an fp32 checkpoint) and ``dtype="float32"``, and
asked the log-probability of every prompt token (``prompt_logprobs=0``) of ``--prompts`` random prompts of
``--prompt`` tokens. Reports, per model, the dtype "auto" chose and the mean and max absolute difference of those
log-probabilities from fp32's. Nothing is timed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # every engine in this process: no child to start
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def save(folder: Path, args, patched: bool) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import hf_neural_attn

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim, max_position_embeddings=args.prompt + 64,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    if patched:
        hf_neural_attn.patch_model(model, "qana")
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for parameter in hf_neural_attn.scorer_parameters(model).values():
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * args.std)
    model.save_pretrained(folder)


def prompt_logprobs(folder: Path, dtype: str, prompts: list[list[int]]) -> tuple[str, list[float]]:
    """The dtype the engine ran in and the log-probability of every prompt token after the first, prompt by prompt."""
    import gc

    from vllm import LLM, SamplingParams

    llm = LLM(model=str(folder), skip_tokenizer_init=True, dtype=dtype, max_model_len=128, seed=0)
    chosen = str(llm.llm_engine.model_config.dtype)
    outputs = llm.generate(
        [{"prompt_token_ids": prompt} for prompt in prompts],
        SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0),
        use_tqdm=False,
    )
    values = [
        step[token].logprob
        for output, prompt in zip(outputs, prompts)
        for step, token in zip(output.prompt_logprobs[1:], prompt[1:])
    ]
    del llm
    gc.collect()
    return chosen, values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv_heads", type=int, default=2)
    parser.add_argument("--head_dim", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--std", type=float, default=0.3)
    args = parser.parse_args()

    import torch

    generator = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, args.vocab, (args.prompts, args.prompt), generator=generator).tolist()
    report = {"shape": vars(args)}
    with tempfile.TemporaryDirectory() as root:
        for name, patched in (("unpatched", False), ("qana", True)):
            folder = Path(root) / name
            save(folder, args, patched)
            _, reference = prompt_logprobs(folder, "float32", prompts)
            chosen, served = prompt_logprobs(folder, "auto", prompts)
            errors = [abs(a - b) for a, b in zip(served, reference)]
            report[name] = {
                "auto_dtype": chosen, "tokens": len(errors), "mean_abs_error": statistics.fmean(errors),
                "max_abs_error": max(errors), "mean_fp32_logprob": statistics.fmean(reference),
            }  # fmt: skip
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
