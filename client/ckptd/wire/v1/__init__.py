"""Generated from protos/ckptd/v1 by tools/gen_protos.py; do not edit."""
