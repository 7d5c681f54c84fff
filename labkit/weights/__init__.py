"""The weights layer (domain): HF <-> MindSpore conversion, checkpoint formats, the logits parity check, and the
checks that a checkpoint, a config and a tokenizer belong together. May import base, config and model; not data,
parallel or anything above."""
