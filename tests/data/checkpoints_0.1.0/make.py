"""How the checkpoints beside this file were written, for tests/loading/test_saved_checkpoints.py.

Run from a checkout of commit c10b4f2 (hf_neural_attn 0.1.0, before the loaders moved into hf_neural_attn/loading/):

    git worktree add /tmp/c10b4f2 c10b4f2
    PYTHONPATH=/tmp/c10b4f2 python tests/data/checkpoints_0.1.0/make.py /tmp/c10b4f2 tests/data/checkpoints_0.1.0
"""

import sys

checkout, out = sys.argv[1], sys.argv[2]
sys.path.insert(0, checkout)

import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import hf_neural_attn

assert hf_neural_attn.__file__.startswith(checkout), hf_neural_attn.__file__


def perturb(model) -> None:
    with torch.no_grad():
        for parameter in hf_neural_attn.scorer_parameters(model).values():
            parameter.add_(0.1 * torch.randn_like(parameter))


ids = torch.arange(10).view(1, 10) % 64

torch.manual_seed(0)
gpt2 = GPT2LMHeadModel(
    GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0, eos_token_id=0)
)
hf_neural_attn.patch_model(gpt2, "qana", h=2)
perturb(gpt2)
gpt2.save_pretrained(f"{out}/gpt2_qana_full")
gpt2.eval()
torch.save({"input_ids": ids, "logits": gpt2(ids).logits.detach()}, f"{out}/gpt2_qana_full_expected.pt")

torch.manual_seed(1)
config = LlamaConfig(
    hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
    vocab_size=64, max_position_embeddings=32,
)  # fmt: skip
LlamaForCausalLM(config).save_pretrained(f"{out}/llama_base")
llama = LlamaForCausalLM.from_pretrained(f"{out}/llama_base")
hf_neural_attn.patch_model(llama, "neural", h=2, layers=[1])
perturb(llama)
hf_neural_attn.save_adapter(llama, f"{out}/llama_neural_adapter", base_model_name_or_path="llama_base")
llama.eval()
torch.save({"input_ids": ids, "logits": llama(ids).logits.detach()}, f"{out}/llama_neural_adapter_expected.pt")
