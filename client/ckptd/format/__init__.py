"""The on-disk format (docs/architecture.md §7), pure: safetensors headers, the step index and
its records, step directory names (`index`), checksum names and units (`units`). The daemon
writes it; the client's offline reader, the integrations and the daemon's tools read it."""
