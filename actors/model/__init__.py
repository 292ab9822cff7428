"""The torch model a worker runs: config, weights loading (safetensors / GGUF), tokenizer."""
