"""Data: records → token rows (dataset, sources, mix), the tokenised cache (cache), tokenizers
(tokenizer), validation batches (val), preference pairs (preference), the built-in dataset (datagen)."""
