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


@pytest.fixture(scope="session", autouse=True)
def _impl_each(request, clusters):
    """With ``--impl-each DIRS`` every graded test runs once per folder (pytest groups the tests by
    folder): the folder is switched here, in this process and on the ranks already running (ranks
    started later inherit it). Without the option: nothing to do."""
    path = getattr(request, "param", None)
    if path is None:
        yield
        return
    from zerolab.grade.helpers import use_impl
    use_impl(path)
    for cluster in clusters.live():
        cluster.run(use_impl, path)
    yield
