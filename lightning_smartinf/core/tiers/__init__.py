"""State tiers: shard state in host memory and accelerator memory, beside the storage devices."""
