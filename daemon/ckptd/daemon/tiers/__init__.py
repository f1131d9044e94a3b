"""Where a step is held besides the root: replicas in peers' memory (the replica tiers), peers' disks, the bulk channel."""
