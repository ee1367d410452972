"""Data: records → token rows (dataset), tokenizers (tokenizer), the built-in dataset (datagen)."""
