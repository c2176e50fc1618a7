"""What a run reads: prompt files (``datasets``: JSONL, Parquet, verl's Parquet; validated row by
row), where the policy, tokenizer and solver models are (``model_paths``: local Hugging Face
directories, checked on disk) and the one prompt encoding (``prompts``)."""
