"""edgert/bench: (map written later)."""
