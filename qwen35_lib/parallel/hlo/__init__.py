"""Reading compiled programs' HLO text: the collectives (`collectives`: which, how many, how many bytes, in which
computation; `step_counts`: what one run executes per device) and the HBM bytes op by op (`hbm`: `op_rows`,
`op_bytes`), over a shared grammar (`text`)."""

from qwen35_lib.parallel.hlo.collectives import (
                                                 KINDS,
                                                 MOVED,
                                                 Collective,
                                                 collectives,
                                                 count,
                                                 group_size,
                                                 layer_body,
                                                 step_counts,
)
from qwen35_lib.parallel.hlo.hbm import BLOCKS, OpBytes, block, op_bytes, op_rows
from qwen35_lib.parallel.hlo.text import BYTES, INSTR, OP_NAME, VAR, called, computations, counted_loop

__all__ = ["BLOCKS", "BYTES", "INSTR", "KINDS", "MOVED", "OP_NAME", "VAR", "Collective", "OpBytes", "block", "called",
           "collectives", "computations", "count", "counted_loop", "group_size", "layer_body", "op_bytes", "op_rows",
           "step_counts"]
