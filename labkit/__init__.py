"""labkit: the code behind the MindSpore LLM pretraining lab's notebooks and CLI."""
__version__ = "0.1.0"
