"""The premises the tests' one reference (tests/reference.py) rests on, checked in one process."""
import pytest
import torch

from reference import batch, build, global_batch, rank_batch, reference


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_global_batch_gradient_is_the_mean_of_the_micro_batch_gradients(name):
    """One process on the global batch = N ranks x M micro-batches averaged, because every loss is a
    mean over equal-size micro-batches: the gradients agree to float64 rounding."""
    n, micro = 3, 2
    model = build(name)
    params = [p for p in model.parameters() if p.requires_grad]
    whole = torch.autograd.grad(model(*global_batch(name, 0, n, micro)), params)
    parts = [torch.autograd.grad(model(*batch(name, 0, r, m)), params) for r in range(n) for m in range(micro)]
    for p, w, *ps in zip(params, whole, *parts):
        torch.testing.assert_close(w, sum(ps) / len(ps), rtol=1e-12, atol=1e-15)


def test_shards_give_the_same_data_whatever_the_number_of_ranks():
    """With ``shards``, the ranks' data of a step, concatenated, are the reference's global batch."""
    want = global_batch("gpt", 3, 12, size=1)
    for n in (1, 2, 3, 4, 6, 12):
        parts = [rank_batch("gpt", 3, r, n, shards=12, size=1) for r in range(n)]
        assert all(x.shape[0] == 12 // n for x, _ in parts)
        assert torch.equal(torch.cat([x for x, _ in parts]), want[0])
        assert torch.equal(torch.cat([y for _, y in parts]), want[1])
    with pytest.raises(ValueError, match="do not split evenly"):
        rank_batch("gpt", 0, 0, 5, shards=12)


def test_batches_differ_and_seeds_cannot_collide():
    seen = {batch("mlp", s, r, m)[0][0, 0].item() for s in range(2) for r in range(3) for m in range(3)}
    assert len(seen) == 18
    for bad in (dict(micro=10), dict(rank=100)):
        with pytest.raises(ValueError, match="seeds would collide"):
            batch("mlp", 0, **dict(dict(rank=0, micro=0), **bad))


def test_every_state_dict_name_tied_ones_included():
    """As engine.full_state_dict(): every name of named_parameters(remove_duplicate=False), a tied
    weight once (one tensor under both names); mixed precision: fp32 masters, frozen in bf16."""
    state = reference("gpt", 2, 1, lr=1e-3)
    assert sorted(state) == sorted(n for n, _ in build("gpt").named_parameters(remove_duplicate=False))
    assert state["head.weight"] is state["tok.weight"]
    mixed = reference("mlp", 2, 1, lr=1e-3, param_dtype=torch.bfloat16)
    assert mixed["inp.weight"].dtype == torch.float32 and mixed["frozen.weight"].dtype == torch.bfloat16


def test_stale_reference_lags_one_update():
    """The delayed parameter update: the first step's gradient is taken at p_0 both ways; from the
    second on, at the parameters one update old, so the results part."""
    plain = [reference("mlp", 2, s, lr=1e-2) for s in (1, 2)]
    stale = [reference("mlp", 2, s, lr=1e-2, stale=True) for s in (1, 2)]
    assert all(torch.equal(plain[0][k], stale[0][k]) for k in plain[0])
    assert any(not torch.equal(plain[1][k], stale[1][k]) for k in plain[1])
