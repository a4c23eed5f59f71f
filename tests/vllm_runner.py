"""Runs vLLM jobs the way a user's script would, without importing hf_neural_attn: the plugin must come in through
its ``vllm.general_plugins`` entry point. tests/integrations/test_vllm.py starts it as ``python vllm_runner.py
JOBS.json OUT.json``.

Each job: ``{"model": folder, "engine": {LLM keyword arguments}, "batches": [[{"prompt_token_ids": [...],
"max_tokens": n}, ...], ...]}``. Each batch is one ``LLM.generate`` call (its requests run concurrently), greedy, with
the chosen tokens' log-probabilities, not stopping at the end-of-text token. The output has, per job, either ``{"error": message}`` (the engine refused the
model) or ``{"batches": [[{"token_ids", "logprobs", "num_cached_tokens"}, ...], ...]}``, and whether the process had
hf_neural_attn imported by the end (by the plugin).
"""

from __future__ import annotations

import gc
import json
import sys


def run_job(job: dict) -> dict:
    from vllm import LLM, SamplingParams

    try:
        llm = LLM(model=job["model"], **job["engine"])
    except Exception as error:  # noqa: BLE001 - the refusal is the result
        return {"error": f"{type(error).__name__}: {error}"}
    batches = []
    for batch in job["batches"]:
        prompts = [{"prompt_token_ids": request["prompt_token_ids"]} for request in batch]
        params = [
            SamplingParams(max_tokens=request["max_tokens"], temperature=0, logprobs=0, ignore_eos=True)
            for request in batch
        ]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        batches.append(
            [
                {
                    "token_ids": list(output.outputs[0].token_ids),
                    "logprobs": [
                        step[token].logprob
                        for step, token in zip(output.outputs[0].logprobs, output.outputs[0].token_ids)
                    ],
                    "num_cached_tokens": output.num_cached_tokens or 0,
                }
                for output in outputs
            ]
        )
    del llm
    gc.collect()
    return {"batches": batches}


def main() -> None:
    jobs_path, out_path = sys.argv[1:3]
    with open(jobs_path) as handle:
        jobs = json.load(handle)
    results = [run_job(job) for job in jobs]
    with open(out_path, "w") as handle:
        json.dump({"results": results, "library_loaded": "hf_neural_attn" in sys.modules}, handle)


if __name__ == "__main__":
    main()
