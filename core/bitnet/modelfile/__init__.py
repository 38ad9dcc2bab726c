"""The model file: GGUF loading and validation, weight formats, the synthetic writer, the built-in model."""
