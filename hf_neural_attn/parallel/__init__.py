"""Scale-out of a patched model, one module per kind of parallelism:

* :mod:`.tensor`: transformers' tensor parallelism: the scorers sharded with the attention heads (their plan entries
  from each scorer's ``head_layout``, the library's two parallel styles, the shards read as local tensors), and the
  whole tensors a checkpoint writes and reads;
* :mod:`.context`: torch's context parallelism: whether a block is open, and what the scorers refuse under one (the
  compute, every process's keys gathered, is ``hf_neural_attn.ops.context_parallel``);
* :mod:`.sequence`: DeepSpeed's Ulysses, refused.

Nothing here changes another library: what is registered in or wrapped around transformers and DeepSpeed for it is
a row of ``hf_neural_attn.integrations.installer.INTEGRATIONS``. This file imports nothing, so that importing one
kind loads that kind alone.
"""
