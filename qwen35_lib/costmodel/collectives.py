"""Collective costs on a system's topology: latency + bytes / bandwidth, per link type.

Topology (see `Specs`): `chips` chips in a bidirectional ring (or behind a switch), each with
`devices_per_chip` cores joined by a core-to-core link. A collective over all devices runs as one flat ring
through every device (cores of a chip adjacent), so each ring step waits for its slowest link.
All byte counts are per device; times in seconds. Every function returns a `Comm(seconds, bytes_on_wire)`.

Ring formulas (n devices, `B` = one device's shard, bidirectional: half of the data goes each way):
- all-gather of a shard B: every device receives (n - 1) B, (n - 1) B / 2 per direction of its link;
  time = launch + (n - 1) hop + (n - 1) B / (2 bw);
- reduce-scatter of an input X (output X / n): the all-gather of shards X / n, run backwards;
- all-reduce of X: reduce-scatter + all-gather;
- all-to-all of X per device (X / n to each device): a message to a device d hops away loads d links; on a
  bidirectional ring each directed link carries X * sum(min(d, n - d)) / (2 n); time = launch + n/2 hops + that /
  bw. Behind a switch every device injects (n - 1) / n X at its own link bandwidth.
Hierarchical reduce-scatter (chips x 2 cores, tpu-inference's hierrs): phase 1 reduces between the two cores of
a chip over the core link (each core sends X / 2); phase 2 reduce-scatters X / 2 per core over the chip ring, the
two cores of a chip sharing its ring links. With m micro-batches the phases overlap: max + min / m.
"""

from __future__ import annotations

import dataclasses

from qwen35_lib.costmodel.specs import Specs
from qwen35_lib.plan import micro_batches


@dataclasses.dataclass(frozen=True)
class Comm:
    seconds: float
    wire_bytes: float  # bytes one device sends


NONE = Comm(0.0, 0.0)


def _flat_link_bw(s: Specs) -> float:
    """The slowest link of a flat ring through all devices, one direction, with the ICI efficiency."""
    links = [s.ring_link_bytes_per_s] if s.chips > 1 else []
    if s.devices_per_chip > 1 and s.core_link_bytes_per_s:
        links.append(s.core_link_bytes_per_s)
    return min(links) * s.eff_ici


def all_gather(s: Specs, shard_bytes: float, n: int | None = None) -> Comm:
    """Every device ends with all n shards of `shard_bytes`."""
    n = n or s.devices
    if n <= 1 or shard_bytes <= 0:
        return NONE
    if s.ring == "switch":
        t = (n - 1) * shard_bytes / (s.ici_link_bytes_per_s * s.eff_ici) + s.hop_latency_s
    else:
        t = (n - 1) * shard_bytes / (2 * _flat_link_bw(s)) + (n - 1) * s.hop_latency_s
    return Comm(s.collective_launch_s + t, (n - 1) * shard_bytes)


def reduce_scatter(s: Specs, input_bytes: float, n: int | None = None) -> Comm:
    """Sum over devices of an `input_bytes` array; each device keeps 1/n of the sum."""
    n = n or s.devices
    return all_gather(s, input_bytes / n, n) if n > 1 else NONE


def all_reduce(s: Specs, input_bytes: float, n: int | None = None) -> Comm:
    """Sum over devices, every device keeps all of it: reduce-scatter + all-gather."""
    n = n or s.devices
    if n <= 1:
        return NONE
    rs, ag = reduce_scatter(s, input_bytes, n), all_gather(s, input_bytes / n, n)
    return Comm(rs.seconds + ag.seconds, rs.wire_bytes + ag.wire_bytes)


def ring_hops_sum(n: int) -> int:
    """Sum over the other devices of the shortest distance on a bidirectional ring of n."""
    return sum(min(d, n - d) for d in range(1, n))


def all_to_all(s: Specs, send_bytes: float, n: int | None = None) -> Comm:
    """Each device sends `send_bytes`, spread evenly over the n devices (its own share stays home)."""
    n = n or s.devices
    if n <= 1 or send_bytes <= 0:
        return NONE
    wire = send_bytes * (n - 1) / n
    if s.ring == "switch":
        t = wire / (s.ici_link_bytes_per_s * s.eff_ici) + s.hop_latency_s
    else:
        per_link = send_bytes * ring_hops_sum(n) / (2 * n)
        t = per_link / _flat_link_bw(s) + (n // 2) * s.hop_latency_s
    return Comm(s.collective_launch_s + t, wire)


def hierarchical_reduce_scatter(s: Specs, input_bytes: float, micro_batches: int = 1,
                                overlap: bool = True) -> Comm:
    """Reduce-scatter over (chip, core) in two phases: core-to-core, then around the chip ring.

    1. phase 1 (cores of a chip): each core sends the half its sibling owns, X / 2, over the core link;
    2. phase 2 (chips): each core reduce-scatters its X / 2 over the c chips; a chip's cores share its ring
       links, so each directed ring link carries 2 * (c - 1) * (X / 2 / c) / 2 bytes;
    3. with `overlap` and m micro-batches phase 1 of batch i+1 runs during phase 2 of batch i:
       max(t1, t2) + min(t1, t2) / m; without, t1 + t2.
    Needs 2 cores per chip (as tpu-inference's kernel asserts); otherwise it is the flat reduce-scatter.
    """
    cores, c = s.devices_per_chip, s.chips
    if cores != 2 or not s.core_link_bytes_per_s:
        return reduce_scatter(s, input_bytes)
    X = input_bytes
    t1 = (X / 2) / (s.core_link_bytes_per_s * s.eff_ici) + s.hop_latency_s
    if c > 1:
        per_link = 2 * (c - 1) * (X / 2 / c) / 2
        t2 = per_link / (s.ring_link_bytes_per_s * s.eff_ici) + (c - 1) * s.hop_latency_s
    else:
        t2 = 0.0
    m = max(1, micro_batches)
    t = max(t1, t2) + min(t1, t2) / m if overlap else t1 + t2
    wire = X / 2 + (c - 1) * X / (2 * c)
    return Comm(s.collective_launch_s + t, wire)


hierrs_micro_batches = micro_batches  # tpu-inference's rule (`plan.micro_batches`); a plan's count: rs_slices


def within_chip(s: Specs) -> Specs:
    """The system as a collective over the cores of one chip sees it: the core-to-core link alone (a `traffic.Op`
    over "core": `dp_tp2_ep`'s head all-reduces); unchanged where a chip has one core."""
    return s.replace(chips=1) if s.devices_per_chip > 1 and s.core_link_bytes_per_s else s


def steps_latency(s: Specs, n: int) -> float:
    """Latency part of one flat ring collective over n devices (no bytes)."""
    return s.collective_launch_s + (n - 1) * s.hop_latency_s if n > 1 else 0.0


__all__ = ["Comm", "all_gather", "all_reduce", "all_to_all", "hierarchical_reduce_scatter", "hierrs_micro_batches",
           "reduce_scatter", "ring_hops_sum", "steps_latency", "within_chip"]
