"""edgert/worker: (map written later)."""
