"""The parallel layer (domain): MindSpore's parallel context, device presets, the memory and step-time model and the
planner, mindformers' parallel YAML, the msrun command line, and the collectives (with their backward) that the
hand-written layouts use. May import base, config and model; not weights or data."""
