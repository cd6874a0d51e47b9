"""edgert/security: (map written later)."""
