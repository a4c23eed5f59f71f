"""Compiled decoding: a patched model in eval mode compiles whole (``fullgraph=True``, no graph break) and gives the
eager model's logits, and ``generate`` with a static cache and a ``CompileConfig`` gives the eager tokens.

QANA and Neural Attention with live scorers, on Llama (grouped-query attention, RoPE) and GPT-2. Tolerance 1e-5 on
logits and on every step's scores (compiled kernels reorder sums). The cases run in a process of their own: compiling
loads inductor, whose state the rest of the suite should not share (tests/ops/test_compile.py does the same); both
families share one process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.spawns, pytest.mark.compiles]

TESTS = Path(__file__).resolve().parents[1]  # the script imports the test helpers

SCRIPT = r"""
import sys
import torch
from helpers.models import perturb_scorers, tiny_gpt2, tiny_llama
from helpers.scorers import FUSED_SCORERS
from transformers import CompileConfig, GenerationConfig
import hf_neural_attn

builders = {"llama": tiny_llama, "gpt2": lambda: tiny_gpt2(initializer_range=0.4)}
ids = torch.tensor([[5, 9, 12, 3, 7, 8, 2]])
compile_config = CompileConfig(fullgraph=True, dynamic=False)
compile_config._compile_all_devices = True  # generate compiles on accelerators only unless told (a CPU here)


def generation(**settings):
    return GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0,
                            output_scores=True, return_dict_in_generate=True, **settings)


for family, scorer in [(family, scorer) for family in sys.argv[1:] for scorer in FUSED_SCORERS]:
    torch._dynamo.reset()
    model = builders[family]()
    hf_neural_attn.patch_model(model, scorer, **({"h": 4} if scorer == "qana" else {}))
    perturb_scorers(model)
    with torch.no_grad():
        eager = model(ids).logits
        compiled = torch.compile(model, fullgraph=True)(ids).logits  # a graph break would raise here
    torch.testing.assert_close(compiled, eager, rtol=0, atol=1e-5)

    expected = model.generate(ids, generation_config=generation())
    compiled_generation = generation(cache_implementation="static", compile_config=compile_config)
    served = model.generate(ids, generation_config=compiled_generation)
    assert getattr(model, "_compiled_call", None) is not None, "generate did not compile the forward"
    assert served.sequences.tolist() == expected.sequences.tolist(), (served.sequences, expected.sequences)
    for step, (ours, theirs) in enumerate(zip(served.scores, expected.scores, strict=True)):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5, msg=f"step {step}")
    print(f"{family} {scorer}: compiled = eager, tokens {expected.sequences[0, ids.shape[1]:].tolist()}")
"""


@pytest.fixture(scope="module")
def compiled_decoding(tmp_path_factory) -> str:
    """What the script printed for both families, run in one process (one start of Python and inductor)."""
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, "llama", "gpt2"],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
        cwd=tmp_path_factory.mktemp("compiled_decoding"),
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))},
    )
    assert result.returncode == 0, f"rc {result.returncode}\n{result.stdout}\n{result.stderr[-4000:]}"
    return result.stdout


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_compiled_decoding_is_the_eager_model(family, compiled_decoding):
    assert [
        line.split(":")[0]
        for line in compiled_decoding.splitlines()
        if "compiled = eager" in line and line.startswith(f"{family} ")
    ] == [f"{family} qana", f"{family} neural"]
