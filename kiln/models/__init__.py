"""Language-model architectures and checkpoints (config, Transformer, KV cache, HF / GGUF / compressed readers); may import kiln.core, kernels, compress and quality."""
