"""ckptd daemon: serves checkpoints for the ranks of its node (DESIGN.md)."""
