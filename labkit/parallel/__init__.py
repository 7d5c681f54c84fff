"""The planner and the framework's parallel configuration (domain layer): MindSpore's parallel context, device
presets, the memory and step-time model and the planner, the state census, mindformers' parallel YAML, the msrun
command line. Parallelism written by hand on CPU workers is labkit.byhand. May import base, config and model; not
weights or data."""
