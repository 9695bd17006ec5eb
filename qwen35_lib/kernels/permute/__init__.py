"""The `permute` slot: token copies sorted by expert and the weighted un-sort (`xla`: the twin; `pallas`)."""
