"""The hardware-aware cost model: specs, op costs, collectives, the step-time model, the scheduler simulation,
and the ladder predicted stage by stage (the stages are `qwen35_lib.plan.STAGES`). Public: `predict`, `ladder`,
`step_time`, `Batch`.

    from qwen35_lib import costmodel
    costmodel.predict("qwen3.5-397b-a17b", "tpu7x-8", "kernels", isl=8192, osl=1024, concurrency=512)

`python -m qwen35_lib.costmodel predict --model NAME --hardware NAME --stage NAME --isl N --osl N --concurrency N`.
"""

from qwen35_lib.costmodel.ops import Batch
from qwen35_lib.costmodel.predict import predict, serving_model
from qwen35_lib.costmodel.stage_ladder import ladder
from qwen35_lib.costmodel.step import step_time
from qwen35_lib.costmodel.traffic import StepShape, collective_counts, resident_bytes

__all__ = ["Batch", "StepShape", "collective_counts", "ladder", "predict", "resident_bytes", "serving_model",
           "step_time"]
