"""The hand-off from ranks: shared-memory arenas and their budget, GPU IPC staging, the daemon's transports."""
