"""Compiling a managed model: its blocks, each at its boundary (blocks.py)."""
