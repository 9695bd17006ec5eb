"""The `gdn` slot: the gated delta rule (`xla`: the reference twin; `pallas`: the TPU's; `native`: the CPU's C++)."""
