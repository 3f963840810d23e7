"""Helpers shared by the tests: assertions on what the ranks returned, and starting/stopping servers."""
import os
import signal
import socket
import time
import urllib.request

import psutil
import torch


def assert_params(results, expected, what, *, exact=False, **tol):
    """Every rank's {name: tensor} in ``results`` equals ``expected`` (one {name: tensor} for all
    ranks, or a list of them, one per rank): the same names, the same dtypes, and values bit for bit
    with ``exact``, else within ``tol`` of torch.testing.assert_close. A failure names the rank and
    the parameter."""
    per_rank = expected if isinstance(expected, (list, tuple)) else [expected] * len(results)
    assert len(per_rank) == len(results), f"{what}: {len(results)} results, {len(per_rank)} expected"
    for rank, (got, want) in enumerate(zip(results, per_rank)):
        assert sorted(got) == sorted(want), f"rank {rank}, {what}: parameter names differ"
        for name in want:
            if exact:
                g, w = got[name], want[name]
                if g.dtype != w.dtype or g.shape != w.shape:
                    raise AssertionError(f"rank {rank}, {what}, {name}: {g.dtype} {tuple(g.shape)}, "
                                         f"expected {w.dtype} {tuple(w.shape)}")
                assert torch.equal(g, w), (f"rank {rank}, {what}, {name}: not bit-identical (largest "
                                           f"difference {(g.double() - w.double()).abs().max().item():.3g})")
                continue
            try:
                torch.testing.assert_close(got[name], want[name], **tol)
            except AssertionError as exc:
                raise AssertionError(f"rank {rank}, {what}, parameter {name}: {exc}") from None


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kill_tree(proc):
    """Stop ``proc`` and everything it started (a server, its kernels in their own sessions, their
    ranks): SIGTERM, then SIGKILL for what is still alive after 10 s."""
    try:
        parent = psutil.Process(proc.pid)
        family = [parent] + parent.children(recursive=True)
    except psutil.NoSuchProcess:
        return
    for p in family:
        try:
            p.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(family, timeout=10)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=5)


def jupyter_env(home):
    """os.environ with every Jupyter and JupyterLab folder under ``home``: a server started with it
    reads no user settings and leaves nothing behind."""
    env = dict(os.environ, JUPYTER_RUNTIME_DIR=str(home / "runtime"), JUPYTER_CONFIG_DIR=str(home / "config"),
               JUPYTERLAB_SETTINGS_DIR=str(home / "settings"), JUPYTERLAB_WORKSPACES_DIR=str(home / "ws"))
    env.pop("PYTEST_CURRENT_TEST", None)
    return env


def wait_for_jupyter(proc, base, token, timeout=90):
    """Return once the Jupyter server at ``base`` answers; raise if ``proc`` exits or time runs out
    (with what ``proc`` printed, when its output is piped)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2)
            return
        except OSError:
            if proc.poll() is not None:
                printed = proc.stdout.read() if proc.stdout else ""
                raise RuntimeError(f"the Jupyter server exited with {proc.returncode}:\n{printed}") from None
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Jupyter server did not answer within {timeout} s") from None
            time.sleep(0.5)


# The own-loop tests' models (tests/test_fully_shard.py, tests/test_mixed_precision.py): what every
# rank builds, one rank's micro-batch, and the global batch one process trains on.
SMALL_GPT = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=2, seq_len=16)
MICRO = 4


def build_small(name, dtype=torch.float64):
    from zerolab import models
    return models.build(name, seed=0, dtype=dtype, **(SMALL_GPT if name == "gpt" else {}))


def small_batch(name, model, step, rank, dtype=torch.float64):
    from zerolab import models
    return models.batch(name, seed=100 * step + rank, batch_size=MICRO, model=model, dtype=dtype)


def small_global_batch(name, model, step, n, dtype=torch.float64):
    parts = [small_batch(name, model, step, r, dtype) for r in range(n)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
