"""Writing a node's files: the writer, its arena source, reuse of unchanged bytes."""
