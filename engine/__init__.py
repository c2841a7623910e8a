"""stepscope engine: a Llama-style serving engine with paged KV cache and continuous batching."""
