"""Transfers: what moves bytes between the tiers and the ranks, below the parameter
runtime (offload/partition) that drives them. The copy streams and gradients going
down (device_copies.py) through their pinned ring (staging_ring.py); the parameter
partitions' NVMe homes (nvme_home.py); collectives over ranks (collectives.py),
gradient buckets (grad_buckets.py) and all-gathers ahead (gather_ahead.py). None of
them imports the runtime above or calls up into it: shards are handed to them, and
the plan of each backward (BackwardPlan) is handed down by the step."""
