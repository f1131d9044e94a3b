"""The on-disk format: safetensors headers, the step index and its records, checksum units."""
