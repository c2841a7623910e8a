"""stepscope: per-step tracing and root-cause diagnosis for LLM serving."""

__version__ = "0.1.0"
