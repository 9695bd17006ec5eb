"""engine.step: the rows a step must be a multiple of for the plan's MoE to keep its reduce-scatters
(`rs_row_tile`); the jitted steps themselves run in every engine test (test_engine.py: greedy against the
full-sequence forward and transformers, traced once a bucket)."""

from qwen35_lib import get_config
from qwen35_lib.engine.step import rs_row_tile
from qwen35_lib.plan import SINGLE, get_stage, make_mesh


def test_rs_row_tile_is_64_only_where_ep_with_token_replication_reduce_scatters():
    cfg = get_config("qwen3.5-tiny")
    mesh = make_mesh()
    assert rs_row_tile(get_stage("replicate").bind(mesh, cfg)) == 64
    assert rs_row_tile(get_stage("dp_ep").bind(mesh, cfg)) == 1  # all-to-all routing: no reduce-scatter
    assert rs_row_tile(SINGLE.bind(make_mesh(mesh.devices.flat[:1]), cfg)) == 1  # one device: nothing to scatter
