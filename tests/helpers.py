"""Assertions shared by the engine tests (run in the test process, on what the ranks returned)."""
import torch


def assert_params(results, expected, what, *, exact=False, **tol):
    """Every rank's {name: tensor} in ``results`` equals ``expected`` (bit for bit with ``exact``,
    else within ``tol`` of torch.testing.assert_close); a failure names the rank and the parameter."""
    for rank, got in enumerate(results):
        assert sorted(got) == sorted(expected), f"rank {rank}, {what}: parameter names differ"
        for name in expected:
            if exact:
                assert torch.equal(got[name], expected[name]), f"rank {rank}, {what}, {name}: not bit-identical"
                continue
            try:
                torch.testing.assert_close(got[name], expected[name], **tol)
            except AssertionError as exc:
                raise AssertionError(f"rank {rank}, {what}, parameter {name}: {exc}") from None
