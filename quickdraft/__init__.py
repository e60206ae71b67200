"""quickdraft: an LLM inference engine and OpenAI-compatible server built around speculative
decoding. See README.md for the pipeline; each module's docstring names its stage."""

__version__ = "0.1.0"
