"""Prompt sources: rows of JSONL/JSON/parquet/HF datasets read as Prompts, and what the model sees of them."""
