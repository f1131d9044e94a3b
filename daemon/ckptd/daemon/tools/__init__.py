"""Operator tools over committed steps: ls/gc/rm (ops), verify, export, inspect."""
