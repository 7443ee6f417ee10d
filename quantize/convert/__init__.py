"""`quantize convert`: model-format conversions (GGUF <-> HF safetensors, FP8-block -> bf16,
AutoAWQ/AutoGPTQ -> compressed-tensors, compressed-tensors -> bf16), streamed shard by shard,
each checked for what it must preserve (docs/convert.md)."""
