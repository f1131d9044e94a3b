"""ckptd client."""
