"""Ceilings that hold: the fastest this machine can move the bytes a bandwidth-bound row moves.

A row reported as a fraction of a ceiling is only meaningful if no implementation can beat the ceiling.
Two kinds here, each measured in the same rounds as the rows it bounds (benchmarks/protocol.py), so
that load hits the ceiling and the rows alike, and each row's fraction is a paired median:

* **memory** (host Adam): STREAM's kernels, as STREAM runs them (McCalpin, www.cs.virginia.edu/stream:
  compiled C, OpenMP on every core, each array at least 4x the caches, bytes counted as the program
  reads and writes them, no write-allocate traffic), copy (c = a, 8 B per element) and triad
  (a = b + q c, 12 B), plus the same kind of loop with the access pattern of the rows it bounds: AdamW's
  traffic with its arithmetic taken out (read p, g, m, v, write p, m, v: 28 B per parameter in fp32;
  with a bf16 gradient in and a bf16 parameter out: 28 B too). The bound of a row is the fastest of
  them. Why the pattern kernels: on this machine a read-modify-write loop over several streams (every
  line written was just read, so no write-allocate read) moves far more counted bytes per second than
  STREAM's copy and triad (whose stores first read the line); torch's fused AdamW beat STREAM's triad by
  ~1.8x, paired, in our runs. A ceiling it beats is no ceiling; the same traffic with less work is one.
* **transport** (collectives): gloo send/recv between two ranks, 64 MB and the chunk sizes a ring sends,
  one way (rank 0 to rank 1) and both ways at once (a ring step), the bytes a rank sends per second;
  the bound is the fastest. A collective's bus bandwidth (the bytes a rank sends under the ideal ring,
  per second) must stay below it.

:func:`fraction` reports a row both ways, paired per round and best round over the ceiling's best round
(STREAM's own reading: the best of several); :func:`check` raises :class:`CeilingExceeded` when the
paired middle half lies entirely above 1 (a row faster than its ceiling out of the noise): the
benchmark fails loudly instead of printing it; a best round above the ceiling's best round alone is
printed as a warning beside the table.
"""
import ctypes
import hashlib
import os
import pathlib
import subprocess
import tempfile
from dataclasses import dataclass

import torch

from benchmarks.protocol import Ratio

STREAM_SOURCE = r"""
#include <stdint.h>
#include <string.h>
/* STREAM's copy and triad (McCalpin), and loops with AdamW's memory traffic and no arithmetic to speak of. */
void stream_copy(float *c, const float *a, int64_t n, int t) {
    #pragma omp parallel for simd schedule(static) num_threads(t)
    for (int64_t i = 0; i < n; i++) c[i] = a[i];
}
void stream_triad(float *a, const float *b, const float *c, float q, int64_t n, int t) {
    #pragma omp parallel for simd schedule(static) num_threads(t)
    for (int64_t i = 0; i < n; i++) a[i] = b[i] + q * c[i];
}
/* AdamW's traffic, written as zerolab/cpu_adam.py's one-pass kernel is (each stream loaded once into a
   local, every store after the loads, restrict pointers), its arithmetic cut down to one add per stream:
   a loop that moves what the kernel moves and does less, so the kernel cannot beat it by being better
   written. The first version (in-place += on possibly aliased pointers) ran 5% slower than the real
   kernel on a quiet 2-core EPYC: the benchmark failed loudly, as it should. */
void adam_traffic_f32(float *restrict p, const float *restrict g, float *restrict m, float *restrict v,
                      int64_t n, int t) {
    #pragma omp parallel for simd schedule(static) num_threads(t)
    for (int64_t i = 0; i < n; i++) {
        float gi = g[i], pi = p[i], mi = m[i], vi = v[i];
        mi = mi + gi; vi = vi + gi; pi = pi - mi;
        p[i] = pi; m[i] = mi; v[i] = vi;
    }
}
void adam_traffic_bf16(float *restrict p, const uint16_t *restrict g, float *restrict m, float *restrict v,
                       uint16_t *restrict out, int64_t n, int t) {
    #pragma omp parallel for simd schedule(static) num_threads(t)
    for (int64_t i = 0; i < n; i++) {
        uint32_t u = (uint32_t)g[i] << 16; float gi; memcpy(&gi, &u, 4);
        float pi = p[i], mi = m[i], vi = v[i];
        mi = mi + gi; vi = vi + gi; pi = pi - mi;
        p[i] = pi; m[i] = mi; v[i] = vi;
        uint32_t w; memcpy(&w, &pi, 4); out[i] = (uint16_t)(w >> 16);
    }
}
"""
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared"]


class CeilingExceeded(RuntimeError):
    """A row ran faster than the ceiling measured to bound it: the ceiling (or the row's byte count)
    is wrong, and every fraction built on it would be too."""


def _library():
    """STREAM_SOURCE compiled with the machine's C compiler (cached in the temp dir), or None."""
    cc = os.environ.get("CC") or "cc"
    key = hashlib.sha256("\n".join([STREAM_SOURCE, cc, *FLAGS]).encode()).hexdigest()[:16]
    target = pathlib.Path(tempfile.gettempdir()) / f"zerolab-bench-{os.getuid()}" / f"stream_{key}.so"
    try:
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            src, tmp = target.with_suffix(f".{os.getpid()}.c"), target.with_suffix(f".{os.getpid()}.tmp")
            src.write_text(STREAM_SOURCE)
            done = subprocess.run([cc, *FLAGS, str(src), "-o", str(tmp)], capture_output=True, timeout=300)
            src.unlink(missing_ok=True)
            if done.returncode != 0:
                return None
            os.replace(tmp, target)
        return ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError):
        return None


def stream_numel():
    """Elements per STREAM array: at least 4x the caches of all the cores together (STREAM's rule; cpu0's
    caches times the number of cores, which counts a shared L3 more than once: larger is safe), and at
    least 2^26 (256 MiB of fp32)."""
    per_core = 0
    for index in pathlib.Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            size = (index / "size").read_text().strip()
            per_core += int(size[:-1]) * {"K": 1 << 10, "M": 1 << 20}.get(size[-1], 1)
        except (OSError, ValueError):
            pass
    return max(1 << 26, 4 * per_core * (os.cpu_count() or 1) // 4)


def memory_kernels(adam_numel):
    """{name: (fn(round), bytes counted per call)}: STREAM copy and triad on arrays beyond the caches,
    and AdamW's traffic (fp32; bf16 gradient in, bf16 parameter out) on ``adam_numel`` parameters.
    With no C compiler: torch's copy and triad only (and the check says it ran without the rest)."""
    n, threads = stream_numel(), torch.get_num_threads()
    a, b, c = torch.full((n,), 1.0), torch.full((n,), 2.0), torch.zeros(n)
    lib = _library()
    if lib is None:
        return {"STREAM copy (torch)": (lambda r: c.copy_(a), 8 * n),
                "STREAM triad (torch)": (lambda r: torch.add(b, c, alpha=3.0, out=a), 12 * n)}
    P, I = ctypes.c_void_p, ctypes.c_int64
    p, g, m, v = (torch.zeros(adam_numel) for _ in range(4))
    g16, out16 = torch.zeros(adam_numel, dtype=torch.bfloat16), torch.zeros(adam_numel, dtype=torch.bfloat16)
    ptr = lambda t: P(t.data_ptr())
    return {
        "STREAM copy": (lambda r: lib.stream_copy(ptr(c), ptr(a), I(n), threads), 8 * n),
        "STREAM triad": (lambda r: lib.stream_triad(ptr(a), ptr(b), ptr(c), ctypes.c_float(3.0), I(n), threads), 12 * n),
        "AdamW's traffic, fp32 (read p, g, m, v; write p, m, v)":
            (lambda r: lib.adam_traffic_f32(ptr(p), ptr(g), ptr(m), ptr(v), I(adam_numel), threads), 28 * adam_numel),
        "AdamW's traffic, bf16 grad in, bf16 param out":
            (lambda r: lib.adam_traffic_bf16(ptr(p), ptr(g16), ptr(m), ptr(v), ptr(out16), I(adam_numel), threads),
             28 * adam_numel),
    }


@dataclass
class Fraction(Ratio):
    """A row's rate as a fraction of its ceiling, two ways: paired (per round, the row over the fastest
    ceiling of the same round: :class:`Ratio`'s median and middle half), and ``best``: the row's best
    round over the ceiling's best round, the way STREAM reports a bandwidth (the best of several runs:
    the least disturbed). On a loaded machine a round's ceiling can be slowed while its row is not, so
    the paired fraction is noisy; the best-of-rounds one is not, and a true ceiling holds in both."""
    best: float = float("nan")

    def __str__(self):
        return f"{super().__str__()}, best {self.best:.2f}"


def fraction(rates, ceilings):
    """A row's :class:`Fraction` of the ceilings measured in the same rounds. ``rates``: [bytes/s per
    round]; ``ceilings``: {name: [bytes/s per round]}; the bound is the fastest of them."""
    per_round = [max(c[i] for c in ceilings.values()) for i in range(len(rates))]
    return Fraction(Ratio.of(rates, per_round).ratios, best=max(rates) / max(map(max, ceilings.values())))


def check(rows):
    """``rows``: {row name: its :class:`Fraction`}. Raise CeilingExceeded naming every row faster than its
    ceiling out of the noise (its paired middle half entirely above 1: the protocol's rule for a verdict).
    Returns the rows whose best round alone beat the ceiling's best round while the paired fraction did
    not: a warning the section prints (on a loaded machine one lucky round of a row can beat every
    round of a ceiling slowed by load), never silently dropped."""
    over = {name: r for name, r in rows.items() if r.side(1.0) > 0}
    if over:
        raise CeilingExceeded("faster than the ceiling that bounds it (fraction: paired median [middle half], best "
                              "round / the ceiling's best round): " +
                              "; ".join(f"{name}: {r}" for name, r in over.items()) +
                              ". The ceiling is not one: measure it with the rows' own access pattern.")
    return {name: r for name, r in rows.items() if r.best > 1.0}


def warning(lucky):
    """The line a section prints for :func:`check`'s returned rows (empty when there are none)."""
    if not lucky:
        return ""
    return ("\n**Warning:** best round above the ceiling's best round, the paired fraction within the noise: " +
            "; ".join(f"{name}: {r}" for name, r in lucky.items()) +
            ". Out of the noise this would fail the benchmark; rerun on a quieter machine.\n")
