"""The engine's knobs (`EngineConfig`: sequences, tokens a step, pages, context, ranks, KV dtype, drafts) and the
check that the pools they ask for fit the devices' memory before a byte is allocated."""

from __future__ import annotations

import dataclasses

from qwen35_lib.config import Config
from qwen35_lib.engine.cache import CacheShape, kv_words_for, memory_shortfall
from qwen35_lib.plan import BoundPlan, ServingPlan


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 8  # running sequences per rank
    max_num_batched_tokens: int = 128  # new tokens per step per rank (decodes + prefill chunks)
    page_size: int = 16
    num_pages: int | None = None  # per rank, null page included; None: enough for max_num_seqs full contexts
    max_model_len: int = 1024  # prompt + output tokens of one request
    ranks: int = 1  # data-parallel ranks, each with its own pools
    # the KV cache's dtype where the plan names none (None: the model dtype; "float8_e4m3fn": FP8 with per-token
    # scales); the engine reads the bound plan's (`BoundPlan.kv_dtype`), its one home
    kv_dtype: str | None = None
    # k: tokens each running sequence drafts with the model's MTP head and the next step verifies
    # (`engine.speculative`); 0: off
    speculative_tokens: int = 0

    def __post_init__(self):
        for f in ("max_num_seqs", "max_num_batched_tokens", "page_size", "max_model_len", "ranks"):
            if getattr(self, f) < 1:
                raise ValueError(f"EngineConfig.{f} must be >= 1, got {getattr(self, f)}")
        if self.speculative_tokens < 0:
            raise ValueError(f"EngineConfig.speculative_tokens must be >= 0, got {self.speculative_tokens}")

    @property
    def pages_per_seq(self) -> int:
        return -(-self.max_model_len // self.page_size)

    @property
    def pages(self) -> int:
        """Pages per rank, the null page included: `num_pages`, else max_num_seqs whole contexts of max_model_len
        (`CacheShape.for_requests`, the one pool-for-N-requests formula)."""
        n = self.num_pages if self.num_pages is not None else CacheShape.for_requests(
            self.max_num_seqs, self.max_model_len, page_size=self.page_size).num_pages
        if n - 1 < self.pages_per_seq:
            raise ValueError(f"num_pages={n} cannot hold one request of max_model_len={self.max_model_len} "
                             f"({self.pages_per_seq} pages of {self.page_size} + the null page): raise num_pages "
                             "or lower max_model_len")
        return n

    def cache_shape(self, plan: BoundPlan | None = None) -> CacheShape:
        """The pools these knobs give each rank under the bound `plan`: `pages` pages, a slot for each of
        max_num_seqs sequences and the null slot; the KV dtype the plan is bound with, stored as its attention
        asks (`engine.cache.kv_words_for`). No plan: these knobs' own KV dtype, as values."""
        if plan is None:
            return CacheShape(ranks=self.ranks, num_pages=self.pages, page_size=self.page_size,
                              num_slots=self.max_num_seqs + 1, kv_dtype=self.kv_dtype,
                              verify=self.speculative_tokens + 1)
        return dataclasses.replace(self.cache_shape(), kv_dtype=plan.kv_dtype, kv_words=kv_words_for(plan))


def check_cache_memory(config: Config, ec: EngineConfig, shape: CacheShape, mesh=None,
                       plan: ServingPlan | None = None) -> None:
    """A ValueError naming the knobs to lower when the KV pages and GDN slots of `shape` cannot fit the memory of
    the devices that would hold them (host RAM on CPU, HBM on an accelerator; on `mesh` under the bound `plan`).
    Allocates nothing."""
    short = memory_shortfall(config, shape, mesh, plan)
    if short is None:
        return
    what = (f"{shape.ranks} rank(s) x ({shape.num_pages} KV pages of {shape.page_size} tokens, {shape.num_slots} "
            "GDN slots)")
    fix = (f"lower num_pages ({ec.num_pages})" if ec.num_pages is not None else
           f"lower max_num_seqs ({ec.max_num_seqs}) or max_model_len ({ec.max_model_len}), or set num_pages below "
           f"{shape.num_pages}")
    if config.attn_per_group and not shape.kv_dtype:
        fix += ", or use kv_dtype='float8_e4m3fn'"
    raise ValueError(f"{short} for {what}: {fix}")
