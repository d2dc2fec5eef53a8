"""Partitioned parameter manager: shards, their residency, and the hooks that move them."""
