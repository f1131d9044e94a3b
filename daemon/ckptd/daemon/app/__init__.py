"""The daemon process: the server's lifecycle, the command line, test-only fault hooks."""
