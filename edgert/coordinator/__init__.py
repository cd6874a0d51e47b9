"""edgert/coordinator: (map written later)."""
