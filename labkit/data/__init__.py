"""The data layer (domain): corpus, tokenizer, MindRecord datasets, the loader's order contract, data quality.
May import base and config; it builds no model and trains nothing; not weights or parallel."""
