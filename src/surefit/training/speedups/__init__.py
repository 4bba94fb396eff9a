"""Optional speed work: the same numbers, computed faster. Skippable on a first read.

- ``lora_fast``: LoRA layers' forward with the adapters summed in fp32, cheaper dropout, a fused SwiGLU MLP, and
  activations saved in bf16 (``SavedActivationsIn``).
- ``prefixes``: rows of a micro-batch that begin with the same prompt tokens compute that prefix once.
- ``fused_head``: the LM head and the cross-entropy in chunks, gradients computed in the forward pass.

Each is tested against the plain computation (same loss and gradients); see docs/performance.md.
"""
