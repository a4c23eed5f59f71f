"""Written with hf_neural_attn 0.1.0 at commit c10b4f2 (before the loading/ package): tiny checkpoints for
tests/test_saved_checkpoints.py."""
import json, sys, torch
sys.path.insert(0, "/tmp/base")
import hf_neural_attn
assert hf_neural_attn.__file__.startswith("/tmp/base"), hf_neural_attn.__file__
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
out = sys.argv[1]
torch.manual_seed(0)
gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=64, n_positions=32,
                                   bos_token_id=0, eos_token_id=0))
hf_neural_attn.patch_model(gpt2, "qana", h=2)
with torch.no_grad():
    for n, p in hf_neural_attn.scorer_parameters(gpt2).items():
        p.add_(0.1 * torch.randn_like(p))
gpt2.save_pretrained(f"{out}/gpt2_qana_full")
ids = torch.arange(10).view(1, 10) % 64
gpt2.eval()
torch.save({"input_ids": ids, "logits": gpt2(ids).logits.detach()}, f"{out}/gpt2_qana_full_expected.pt")
torch.manual_seed(1)
llama_cfg = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                        num_key_value_heads=1, vocab_size=64, max_position_embeddings=32)
base = LlamaForCausalLM(llama_cfg)
base.save_pretrained(f"{out}/llama_base")
base = LlamaForCausalLM.from_pretrained(f"{out}/llama_base")
hf_neural_attn.patch_model(base, "neural", h=2, layers=[1])
with torch.no_grad():
    for n, p in hf_neural_attn.scorer_parameters(base).items():
        p.add_(0.1 * torch.randn_like(p))
hf_neural_attn.save_adapter(base, f"{out}/llama_neural_adapter", base_model_name_or_path="llama_base")
base.eval()
torch.save({"input_ids": ids, "logits": base(ids).logits.detach()}, f"{out}/llama_neural_adapter_expected.pt")
print(hf_neural_attn.__version__, hf_neural_attn.__file__)
