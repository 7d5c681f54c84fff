"""The model layer: mindformers' Llama built with the flags each device needs (llama), the same decoder written
out from MindSpore primitives for the parallel layouts (scratch), shapes and parameter counts (shapes), and the
C++ CPU operators (kernels). May import the base modules and config only."""
