"""ckptd daemon: serves checkpoints for the ranks of its node (docs/architecture.md)."""
