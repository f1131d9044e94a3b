"""Wire code generated from protos/ (tools/gen_protos.py). Shared by the client and the daemon."""
