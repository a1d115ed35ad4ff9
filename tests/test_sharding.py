"""The shard layout (fmoe/sharding.py), pure: a group's padded shards tile each tensor, and the
layout from process groups and the one from sizes alone share one expert-shape rule."""

from __future__ import annotations

import torch
from conftest import tiny_config

from fmoe import sharding
from fmoe.mesh import Mesh
from fmoe.stages import qwen3_moe


def test_a_groups_padded_shards_tile_the_full_tensor_and_their_held_ranges_tile_its_elements():
    full = torch.arange(1.0, 1.0 + 3 * 7).view(3, 7)  # 21 elements: padded for 2, 4 and 5 ranks
    for size in (1, 2, 3, 4, 5, 20, 21, 22):  # 20: ranks past the last element hold padding only
        infos = [sharding.ShardInfo((3, 7), "dp_cp_ep", size, i) for i in range(size)]
        shards = [info.mine(info.pad(full.reshape(-1))) for info in infos]
        assert all(s.numel() == infos[0].shard_numel for s in shards), size
        padded = torch.cat(shards)
        assert padded.numel() == infos[0].padded_numel >= full.numel(), size
        assert torch.equal(infos[0].unpad(padded), full) and not padded[full.numel() :].any(), size
        ranges = [info.held() for info in infos]
        assert ranges[0][0] == 0 and ranges[-1][1] == full.numel(), (size, ranges)
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])), (size, ranges)
        for info, s, (lo, hi) in zip(infos, shards, ranges):
            assert torch.equal(s[: hi - lo], full.reshape(-1)[lo:hi]), (size, info.index)


def test_experts_split_over_ep_on_dim_0_and_shard_over_dp_x_cp_the_rest_over_dp_x_cp_x_ep():
    cfg = tiny_config(num_hidden_layers=2, mlp_only_layers=(0,))
    model, shapes = qwen3_moe.build(cfg), qwen3_moe.param_shapes(cfg)
    mesh = Mesh(1, 2, 1, 2, rank=3, coords={"pp": 0, "dp": 1, "cp": 0, "ep": 1})
    infos = sharding.planned_layout(model, mesh, shapes, list(shapes))
    experts = model.expert_params
    assert experts and len(experts) < len(shapes)
    for name, info in infos.items():
        shape = tuple(shapes[name])
        if name in experts:
            assert info.full_shape == (model.num_experts // 2, *shape[1:]), name
            assert (info.group, info.size, info.index) == ("dp_cp", 2, 1), name
        else:
            assert info.full_shape == shape, name
            assert (info.group, info.size, info.index) == ("dp_cp_ep", 4, 3), name
        assert info.full_shape == sharding.local_shape(name in experts, shape, model.num_experts, mesh.ep)
