"""stepscope instrumentation (arrives with its issue)."""
