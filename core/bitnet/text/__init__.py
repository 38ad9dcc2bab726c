"""Text: the tokenizer read from GGUF metadata and its special tokens."""
