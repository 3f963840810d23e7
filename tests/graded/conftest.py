import pytest

from zerolab import RankError


@pytest.fixture
def on_ranks(clusters):
    """``on_ranks(n, fn, *args)``: run a check on n ranks; a rank's failure becomes a plain test
    failure whose message names the rank (no noise from the launcher's own frames)."""
    def run(n, fn, *args, **kwargs):
        try:
            return clusters(n).run(fn, *args, **kwargs)
        except RankError as exc:
            pytest.fail(str(exc), pytrace=False)
    return run
