"""The mesh convention (core/mesh.py): rank order, strides, groups over one or several axes, and what the
axes mean for the batch and the gradients. Pure arithmetic, no processes."""

import pytest

from core.mesh import Mesh, canonical, group_key, label


def test_rank_order_and_strides():
    mesh = Mesh({"tp": 2, "pp": 2, "dp": 2})  # any order written: pp outermost, tp innermost
    assert mesh.names == ["pp", "dp", "tp"] and mesh.world == 8
    assert mesh.group_ranks("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert mesh.group_ranks("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert mesh.group_ranks("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [mesh.stride(a) for a in ("tp", "dp", "pp", "cp")] == [1, 2, 4, 2]
    assert mesh.coords(5) == {"pp": 1, "dp": 0, "tp": 1} and mesh.rank_of({"pp": 1, "tp": 1}) == 5


def test_groups_over_several_axes():
    mesh = Mesh((("dp", 2), ("cp", 2), ("tp", 2)))
    assert mesh.group_ranks(("dp", "cp")) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert mesh.group_of(3, ("cp", "tp")) == [0, 1, 2, 3]


def test_the_batch_splits_over_dp_fsdp_and_ep():
    mesh = Mesh((("dp", 2), ("cp", 2), ("ep", 2)))
    assert mesh.batch_shards == 4 and mesh.loss_replicas == 8
    # cp ranks read the same sequences; ep ranks different ones
    assert [mesh.batch_index(r) for r in range(8)] == [0, 1, 0, 1, 2, 3, 2, 3]


def test_gradient_axes_and_the_groups_a_run_needs():
    mesh = Mesh((("dp", 2), ("fsdp", 2), ("ep", 2), ("tp", 2)))
    assert mesh.grad_axes() == ("dp", "fsdp", "ep") and mesh.grad_axes(expert=True) == ("dp", "fsdp")
    assert mesh.grad_axes(extra=("tp",)) == ("dp", "fsdp", "ep", "tp")
    assert mesh.shard_axis() == "fsdp" and Mesh((("dp", 4),)).shard_axis() == "dp"
    assert mesh.reduce_groups(0, moe=True) == [("dp", "fsdp", "ep"), ("dp", "fsdp")]
    assert mesh.reduce_groups(3, moe=False) == [("dp", "fsdp", "ep"), ("dp", "ep")]
    assert group_key(("dp", "cp")) == "dp+cp"


def test_labels_and_bad_names():
    assert label({"tp": 2, "dp": 1, "pp": 2}) == "pp=2,tp=2" and label({"dp": 1}) == "dp=1"
    with pytest.raises(ValueError, match="unknown"):
        canonical({"xx": 2})


def test_cp_slices_in_order_and_zig_zagged():
    from core.mesh import cp_chain_hops, cp_chain_sends, cp_slice_owners

    assert cp_slice_owners(3, zigzag=False) == [0, 1, 2]
    assert cp_slice_owners(3, zigzag=True) == [0, 1, 2, 2, 1, 0]  # rank r: slices r and 2 cp - 1 - r
    # a state passed along the sequence: cp - 1 hops in order; zig-zagged, out to the last rank and back
    assert [cp_chain_hops(n, False) for n in (1, 2, 4)] == [0, 1, 3]
    assert [cp_chain_hops(n, True) for n in (1, 2, 4)] == [0, 2, 6]
    # but one rank sends at most one of them in order, two zig-zagged (cp = 4: ranks send 1, 2, 2, 1, as the
    # engine's state passing does, engine/ssm_cp.py)
    assert [cp_chain_sends(n, False) for n in (1, 2, 4, 8)] == [0, 1, 1, 1]
    assert [cp_chain_sends(n, True) for n in (1, 2, 4, 8)] == [0, 1, 2, 2]
