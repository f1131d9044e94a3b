"""Where a step is held besides the root: replicas in peers' memory (tier 0b), peers' disks, the bulk channel."""
