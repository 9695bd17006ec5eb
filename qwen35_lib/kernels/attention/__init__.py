"""The `attention` slot: paged attention and the KV-cache write (`xla`: the reference twin; `pallas`: the TPU's)."""
