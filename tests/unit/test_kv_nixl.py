"""The NIXL connector's plain parts (kv_nixl.py): the pool's region table and the indices a
transfer lists, against the pool tensor's own addresses, and the side channel's hand-out. No NIXL
agent here (tests/integration/test_disaggregation_nixl.py runs two)."""

from __future__ import annotations

import json

import torch

from tokenmill.kv_nixl import SideChannel, fetch_metadata, pool_regions, region_indices


def test_each_region_is_one_layers_k_or_v_of_one_block_at_its_address_in_the_pool():
    pool = torch.zeros(3, 2, 5, 2, 4, 8)  # (layers, K|V, blocks + 1, kv_heads, block_size, head_dim)
    regions = pool_regions(pool.data_ptr(), tuple(pool.shape), pool.element_size())
    assert regions.shape == (3 * 2 * 5, 3)
    for layer, kv, block in [(0, 0, 0), (1, 1, 3), (2, 0, 4), (2, 1, 4)]:
        address, length, device = regions[(layer * 2 + kv) * 5 + block]
        assert (address, length, device) == (pool[layer, kv, block].data_ptr(), 2 * 4 * 8 * 4, 0)


def test_a_transfer_lists_its_blocks_one_after_another_each_with_every_layers_k_and_v():
    assert region_indices([4, 1], layers=2, blocks=10).tolist() == [4, 14, 24, 34, 1, 11, 21, 31]
    assert region_indices([4, 1], layers=2, blocks=10).dtype.name == "int32"


def test_the_side_channel_hands_its_payload_to_each_caller_until_closed():
    channel = SideChannel("127.0.0.1", 0, json.dumps({"engine_id": "e1", "pool_shape": [1, 2]}).encode())
    try:
        assert fetch_metadata("127.0.0.1", channel.port, timeout=5.0) == {"engine_id": "e1", "pool_shape": [1, 2]}
        assert fetch_metadata("127.0.0.1", channel.port, timeout=5.0)["engine_id"] == "e1"
    finally:
        channel.close()
    assert not channel.thread.is_alive()


def test_transfer_params_read_only_as_the_prefill_side_writes_them():
    from tokenmill.kv_nixl import well_formed
    good = {"do_remote_prefill": True, "remote_engine_id": "e1", "remote_host": "127.0.0.1", "remote_port": 5555,
            "remote_block_ids": [3, 4], "remote_request_id": "r1", "remote_expires_at": 1e12}
    assert well_formed(good)
    for bad in ({"remote_block_ids": 5}, {"remote_block_ids": ["3"]}, {"remote_block_ids": [True]},
                {"remote_port": "5555"}, {"remote_engine_id": None}, {"remote_expires_at": "soon"},
                {"do_remote_prefill": 1}):
        assert not well_formed({**good, **bad}), bad
    assert not well_formed(None) and not well_formed([good])
