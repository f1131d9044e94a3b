"""The daemon's engine: saves, commits, loads and housekeeping, wire-free (service.py is its facade)."""
