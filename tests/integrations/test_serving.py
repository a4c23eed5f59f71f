"""transformers' own server (``transformers serve``) on a patched checkpoint: it answers with the scorers' tokens.

Each test starts a real server in a subprocess on 127.0.0.1 (a free port), talks to it with the ``openai`` client
and with plain HTTP, and stops it. The checkpoint is a tiny patched Llama with live scorers and a word tokenizer; its
greedy completion differs from the unpatched model's, so a server that loaded the base would fail.
"""

from __future__ import annotations

import contextlib
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
from helpers.models import TINY_DECODER, perturb_scorers
from helpers.processes import free_port, healthy
from quantization_helpers import quantizable_sizes
from recipes_helpers import word_tokenizer
from transformers import LlamaConfig, LlamaForCausalLM

import hf_neural_attn

pytestmark = [pytest.mark.spawns, pytest.mark.server]

openai = pytest.importorskip("openai", reason="pip install 'hf-neural-attn[serving]' (transformers serve's extra)")
pytest.importorskip("fastapi", reason="pip install 'hf-neural-attn[serving]' (transformers serve's extra)")

PROMPTS = ["the cat sat on a", "a big tree", "the quick cat likes"]
MAX_TOKENS = 10
STARTUP_SECONDS = 120
BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A patched tiny Llama folder, its tokenizer with a chat template, and the completions greedy ``generate`` gives
    (the patched model's and the unpatched one's, which must differ)."""
    folder = tmp_path_factory.mktemp("served")
    tokenizer = word_tokenizer(pad=False)
    tokenizer.chat_template = "{% for message in messages %}{{ message['content'] }} {% endfor %}"
    torch.manual_seed(0)
    # TINY_DECODER over the tokenizer's words, 64 wide: one test quantizes it with bitsandbytes, which needs that on
    # some CPUs (quantization_helpers.quantizable_sizes). At Llama's init scale (0.02) the tiny model answers every
    # prompt with its end token.
    sizes = {**TINY_DECODER, **quantizable_sizes("llama"), "vocab_size": len(tokenizer)}
    sizes.update(bos_token_id=1, eos_token_id=1)
    config = LlamaConfig(**sizes, initializer_range=0.3)
    model = LlamaForCausalLM(config).eval()
    base = {prompt: complete(model, tokenizer, prompt) for prompt in PROMPTS}
    hf_neural_attn.patch_model(model, "qana", h=4)
    perturb_scorers(model, std=0.1)
    patched = {prompt: complete(model, tokenizer, prompt) for prompt in PROMPTS}
    assert patched != base, "the scorers must change a completion, or these tests could not tell the two apart"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder, patched


def complete(model, tokenizer, prompt: str) -> str:
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    new = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False)[0, ids.shape[1] :]
    return tokenizer.decode(new, skip_special_tokens=True)


@contextlib.contextmanager
def server(command: list[str], folder: Path, *flags: str):
    """A server ``command`` serving ``folder`` on a free port: yields its base URL once /health answers, and stops it.
    A server that exits first fails the test with its output."""
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    log = folder.parent / f"server-{port}.log"
    with log.open("w") as output:
        process = subprocess.Popen(
            [*command, str(folder), "--host", "127.0.0.1", "--port", str(port), "--device", "cpu", *flags],
            stdout=output,
            stderr=subprocess.STDOUT,
            env=env,
        )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + STARTUP_SECONDS
        while not healthy(url):
            if process.poll() is not None:
                pytest.fail(f"the server exited ({process.returncode}) before answering:\n{log.read_text()[-3000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"the server did not answer in {STARTUP_SECONDS} s:\n{log.read_text()[-3000:]}")
            time.sleep(0.3)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def post_completion(url: str, model: str, prompt: str) -> str:
    """A completion by plain HTTP (no client library)."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())["choices"][0]["text"]


def assert_serves_the_scorers(url: str, folder: Path, expected: dict[str, str]) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120)
    model = str(folder)

    def by_completion(prompt: str) -> str:
        answer = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        return answer.choices[0].text

    def by_chat(prompt: str) -> str:
        messages = [{"role": "user", "content": prompt}]
        answer = client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
        return answer.choices[0].message.content

    assert post_completion(url, model, PROMPTS[0]).strip() == expected[PROMPTS[0]].strip()
    # Several requests at once: under continuous batching they share steps.
    with ThreadPoolExecutor(max_workers=2 * len(PROMPTS)) as pool:
        completions = list(pool.map(by_completion, PROMPTS))
        chats = list(pool.map(by_chat, PROMPTS))
    for prompt, completion, chat in zip(PROMPTS, completions, chats, strict=True):
        assert completion.strip() == expected[prompt].strip(), prompt
        # The chat template writes the message then a space, which the word tokenizer drops: the same tokens.
        assert chat.strip() == expected[prompt].strip(), prompt


LIBRARY_SERVE = [sys.executable, "-m", "hf_neural_attn.serve"]
TRANSFORMERS_SERVE = [str(BIN / "transformers"), "serve"]


@pytest.mark.parametrize("flags", [(), ("--continuous-batching",)], ids=["generate", "continuous-batching"])
def test_the_library_command_serves_the_scorers(checkpoint, flags):
    folder, expected = checkpoint
    with server(LIBRARY_SERVE, folder, *flags) as url:
        assert_serves_the_scorers(url, folder, expected)


@pytest.mark.parametrize("flags", [(), ("--continuous-batching",)], ids=["generate", "continuous-batching"])
def test_transformers_serve_trusting_the_loader_file_serves_the_scorers(checkpoint, flags):
    """Plain ``transformers serve``: the process never imports the library itself. The checkpoint's loader file
    (remote code) does, and the class the server takes from config.architectures then loads it patched."""
    folder, expected = checkpoint
    with server(TRANSFORMERS_SERVE, folder, "--trust-remote-code", *flags) as url:
        assert_serves_the_scorers(url, folder, expected)


def test_transformers_serve_without_trust_refuses_the_checkpoint(checkpoint):
    """Without --trust-remote-code nothing of the library runs in the server: transformers refuses the checkpoint
    (its custom loader file) at startup rather than serve the base model."""
    folder, _ = checkpoint
    port = free_port()
    result = subprocess.run(
        [*TRANSFORMERS_SERVE, str(folder), "--host", "127.0.0.1", "--port", str(port), "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=STARTUP_SECONDS,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        check=False,
    )
    assert result.returncode != 0
    assert "trust_remote_code=True" in result.stdout + result.stderr


def test_the_library_command_serves_the_scorers_on_a_base_it_quantizes_to_4_bit(checkpoint):
    """``--quantization bnb-4bit``: the server loads the float patched checkpoint with bitsandbytes' 4-bit config; the
    base is quantized, the scorers stay float with their saved weights, and the answers are those of the same model
    loaded so in this process (which differ from the quantized base's without the scorers)."""
    pytest.importorskip("bitsandbytes", reason="pip install 'hf-neural-attn[quantization]'")
    from transformers import AutoTokenizer, BitsAndBytesConfig

    folder, _ = checkpoint
    tokenizer = AutoTokenizer.from_pretrained(folder)
    # What transformers serve's --quantization bnb-4bit asks for (its model manager's BitsAndBytesConfig).
    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)
    model = hf_neural_attn.from_pretrained(folder, quantization_config=config).eval()
    expected = {prompt: complete(model, tokenizer, prompt) for prompt in PROMPTS}
    hf_neural_attn.unpatch_model(model)
    assert expected != {prompt: complete(model, tokenizer, prompt) for prompt in PROMPTS}, (
        "the scorers must change a completion on the 4-bit base, or this test could not tell a served base apart"
    )
    with server(LIBRARY_SERVE, folder, "--quantization", "bnb-4bit") as url:
        assert_serves_the_scorers(url, folder, expected)
