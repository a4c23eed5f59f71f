"""torch.compile with its default backend (inductor, C++ code on the CPU) trains the eager model: the same logits and
gradients at the same seed, attention dropout on, for QANA and Neural Attention, on the reference path (compiled)
and the blockwise path (which runs eagerly inside the compiled model, see hf_neural_attn.ops.PATHS).

Each case runs in its own process with its own thread count, as ``accelerate launch`` runs one thread per process:
a crash (an earlier dropout hash relied on int32 wrap-around, which compiled C++ treats as undefined and which
crashed one-thread processes) fails the test instead of the suite. The model is a one-layer GPT-2 with attention
dropout 0.1 and its residual and embedding dropout off (inductor draws those from its own generator, unpatched or
not). Tolerance 1e-5 on logits and on gradients (times the largest gradient): compiled kernels reorder sums.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import sys
import torch
import transformers as tf
import hf_neural_attn
from hf_neural_attn import ops

scorer, lengths = sys.argv[1], [int(n) for n in sys.argv[2].split(",")]
for n in lengths:
    torch.manual_seed(0)
    config = tf.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=4, n_positions=n, attn_pdrop=0.1,
                           resid_pdrop=0.0, embd_pdrop=0.0)
    model = tf.GPT2LMHeadModel(config).train()
    hf_neural_attn.patch_model(model, scorer, h=4)
    with torch.no_grad():  # live scorers: move every new parameter off its init
        for parameter in hf_neural_attn.scorer_parameters(model).values():
            parameter.normal_(0, 0.3)
    scorer_module = model.transformer.h[0].attn.attn_scorer
    path = ops.resolve_impl("auto", scorer_module, device="cpu", dtype=torch.float32, q_len=n, kv_len=n,
                            head_dim=8, is_causal=True, batch=2, heads=4, dropout_active=True)
    ids = torch.randint(0, 64, (2, n), generator=torch.Generator().manual_seed(1))

    def step(module):
        model.zero_grad()
        torch.manual_seed(3)
        out = module(input_ids=ids, labels=ids)
        out.loss.backward()
        return out.logits.detach(), {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}

    eager_logits, eager_grads = step(model)
    compiled_logits, compiled_grads = step(torch.compile(model, dynamic=False))
    torch.testing.assert_close(compiled_logits, eager_logits, rtol=0, atol=1e-5)
    scale = max(grad.abs().max().item() for grad in eager_grads.values())
    assert compiled_grads.keys() == eager_grads.keys()
    for name, grad in eager_grads.items():
        torch.testing.assert_close(compiled_grads[name], grad, rtol=0, atol=1e-5 * scale, msg=name)
    # The dropout really ran: another seed gives other logits.
    torch.manual_seed(4)
    assert not torch.allclose(model(input_ids=ids).logits, eager_logits, atol=1e-3)
    print(f"{scorer} n={n} path={path}: compiled = eager")
"""


@pytest.mark.parametrize(
    "threads,scorer,lengths,paths",
    [(1, "qana", "16,512", ["reference", "blockwise"]), (2, "neural", "8,512", ["reference", "blockwise"])],
)
def test_compiled_training_with_attention_dropout_is_the_eager_model(threads, scorer, lengths, paths):
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, scorer, lengths],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert result.returncode == 0, f"rc {result.returncode}\n{result.stdout}\n{result.stderr[-4000:]}"
    ran = [line.split("path=")[1].split(":")[0] for line in result.stdout.splitlines() if "path=" in line]
    assert ran == paths, result.stdout
