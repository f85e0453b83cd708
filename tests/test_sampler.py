from rlhf_core.data.sampler import global_batch, rank_slice, total_steps


def test_each_sample_once_per_epoch_and_stream_continues_across_epochs():
    n, bsz = 10, 4
    stream = [i for step in range(5) for i in global_batch(n, bsz, step, seed=3)]  # 20 items = 2 epochs
    assert sorted(stream[:10]) == list(range(10))
    assert sorted(stream[10:]) == list(range(10))
    assert stream[:10] != stream[10:]  # a new permutation for epoch 2


def test_restart_at_step_k_continues_the_same_stream():
    first = [global_batch(50, 8, k, seed=1) for k in range(6)]
    again = [global_batch(50, 8, k, seed=1) for k in range(3, 6)]
    assert first[3:] == again


def test_rank_slices_partition_the_global_batch_for_any_world_size():
    batch = global_batch(64, 8, 0, seed=0)
    for world in (1, 2, 4):
        parts = [i for r in range(world) for i in rank_slice(batch, r, world)]
        assert parts == batch


def test_total_steps():
    assert total_steps(10, 4, 2, None) == 5
    assert total_steps(10, 4, 2, 3) == 3
    assert total_steps(3, 4, 1, None) == 0
