"""The tiered KV store below the device pool: host DRAM (L2), compressed local disk (L3), Redis (remote)."""
