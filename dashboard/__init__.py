"""stepscope dashboard (arrives with its issue)."""
