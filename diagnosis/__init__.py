"""stepscope diagnosis (arrives with its issue)."""
