"""python -m benchmarks.bench_collectives [--rounds 7]

gloo's collectives against zerolab's ring versions built from send/recv (lesson 00), on the same
ranks and buffers, in one run, with the paired protocol (benchmarks/protocol.py): every round runs
every contender once, in rotating order, each time the slowest rank's.

* bus bandwidth = the bytes a rank sends under the ideal ring / time (all_reduce 2(N-1)/N S,
  reduce_scatter and all_gather (N-1)/N S): comparable across collectives and N;
* the transport ceiling (benchmarks/ceilings.py), measured in the same rounds: gloo send/recv between
  ranks 0 and 1 at 64 MB and at the chunk a ring step moves (64 MB / N), one way and both ways at once,
  in bytes a rank sends per second; the fastest is the ceiling of that round, every row's bus bandwidth
  a fraction of it (paired, and best round over best round), and a row above it out of the noise fails
  the benchmark (a lucky best round alone: a printed warning);
* ring / gloo: the paired time ratio;
* CPU time (at the largest size, in rounds of their own): each call's CPU seconds summed over the ranks'
  processes, gloo's transport threads included (protocol.cpu_all_ranks), ring / gloo paired, and the
  cores busy (CPU time over wall time times the cores); for the all_reduce, user and system time apart.
  Where the cores are saturated, a collective's time follows the CPU work it gives them, and that,
  not a link, is what a ring from send/recv competes on against gloo's ring.

Of note: gloo's reduce_scatter is emulated with a whole all_reduce (2x the ideal bytes, and a
full-size temporary), so a ring reduce-scatter that sends the ideal (N-1)/N S can take about half
its time, the target here being 0.6x; gloo's all_reduce is its own well-optimised ring, which a
ring from send/recv should match.
"""
import argparse
import os

import torch
import torch.distributed as dist

from benchmarks import Section, ceilings, protocol
from zerolab import Cluster, comm, ring

SIZES_MB = (1, 16, 64)
CEILING_MB = 64
OPS = ("all_reduce", "reduce_scatter", "all_gather")
RS_TARGET = 0.6


def _p2p(nbytes, both):
    """Ranks 0 and 1: one way (0 sends, 1 receives) or both ways at once (each sends and receives,
    as in a ring step); the other ranks wait. Returns fn(round)."""
    send, recv = torch.ones(nbytes // 4), torch.empty(nbytes // 4)

    def run(r):
        rank = dist.get_rank()
        if rank > 1:
            return
        peer = 1 - rank
        if both:
            ring.exchange(send, recv, peer, peer)
        elif rank == 0:
            comm.send(send, peer)
        else:
            comm.recv(recv, peer)
    return run


def _measure(sizes_mb, timed):
    n = dist.get_world_size()
    contenders, ideal = {}, {}
    for mb in sizes_mb:
        numel = mb * 2**20 // 4 // n * n
        big, small = torch.ones(numel), torch.ones(numel // n)
        S = numel * 4
        fns = {"all_reduce": (lambda: comm.all_reduce(big), lambda: ring.ring_all_reduce(big)),
               "reduce_scatter": (lambda: comm.reduce_scatter(small, big), lambda: ring.ring_reduce_scatter(small, big)),
               "all_gather": (lambda: comm.all_gather(big, small), lambda: ring.ring_all_gather(big, small))}
        for op, (gloo_fn, ring_fn) in fns.items():
            for impl, fn in (("gloo", gloo_fn), ("ring", ring_fn)):
                contenders[op, mb, impl] = lambda r, fn=fn: fn()
                ideal[op, mb, impl] = (2 if op == "all_reduce" else 1) * (n - 1) / n * S
    for mb in sorted({CEILING_MB, CEILING_MB // n}):
        for both in (False, True):
            key = ("p2p", mb, "both ways" if both else "one way")
            contenders[key] = _p2p(mb * 2**20, both)
            ideal[key] = mb * 2**20
    times = protocol.rounds(contenders, timed=timed, clock=protocol.slowest_rank())
    mb = max(sizes_mb)                # the same calls again, in CPU seconds of all ranks (gloo's threads too)
    split = protocol.rounds({key: fn for key, fn in contenders.items() if key[0] in OPS and key[1] == mb},
                            timed=timed, clock=protocol.cpu_all_ranks(part="split"))   # (user, system) per call
    cpu = {}
    for key, parts in split.items():            # the total, and the ranks' own code and the kernel apart
        cpu[key] = [u + s for u, s in parts]
        cpu[key + ("user",)], cpu[key + ("system",)] = [u for u, _ in parts], [s for _, s in parts]
    return {key: (ts, ideal[key]) for key, ts in times.items()}, cpu


def _cpu_reading(bound, cores):
    """What the CPU rounds say about the ring all-reduce against gloo's, per N, from the measurement:
    {N: (time ratio, CPU-time ratio, the lower of the two calls' cores-busy fractions,
    {"user" | "system": (gloo's, the ring's median CPU seconds, their paired ratio)})}."""
    out = []
    for n, (time_ratio, cpu_ratio, busy, parts) in bound.items():
        (gu, ru, user), (gs, rs, system) = parts["user"], parts["system"]
        reading = (f"{n} ranks: the ring all-reduce takes {time_ratio} of gloo's time and spends {cpu_ratio} of its CPU "
                   f"time: in user time (the ranks' own code) {ru * 1e3:.0f} ms against gloo's {gu * 1e3:.0f}, "
                   f"{user}; in system time (the kernel's) {rs * 1e3:.0f} against {gs * 1e3:.0f}, {system}. The cores "
                   f"were busy at least {busy:.2f} of either call")
        if busy >= 0.8:
            reading += (": most of the call is CPU work on this machine's cores: moving the bytes (each byte sent is "
                        "copied into the kernel and out of it again, on loopback TCP) and the adds. A ring from "
                        "send/recv sends the same bytes as gloo's ring (lesson 00 counts them on the sockets) and does "
                        "the same adds; how much CPU each spends on that can differ: the kernel's share with how many "
                        "pieces the bytes go in and how often a rank waits, the ranks' own share with the code "
                        "around them (a Python call per piece here, C++ in gloo's ring)")
        else:
            reading += (": for the rest of the call the cores did other work or none (waiting), which this "
                        "measurement does not place")
        out.append(reading + ".")
    return " ".join(out)


def main(sizes_mb=SIZES_MB, timed=7):
    rows = ["| ranks | op | MB | gloo (ms) | ring from send/recv (ms) | ring / gloo, paired | gloo bus GB/s | "
            "ring bus GB/s | gloo / ceiling | ring / ceiling |", "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    ceiling_rows = ["| ranks in the group | send/recv between ranks 0 and 1 | MB | GB/s a rank sends, best | median |",
                    "|---:|---|---:|---:|---:|"]
    headlines, fractions = [], {}
    cores = len(os.sched_getaffinity(0))
    cpu_rows = ["| ranks | op | MB | gloo CPU ms | ring CPU ms | ring / gloo, paired | cores busy: gloo | ring |",
                "|---:|---|---:|---:|---:|---:|---:|---:|"]
    bound = {}
    for n in (2, 4):
        with Cluster(n, timeout=900) as cluster:
            result, cpu = cluster.run(_measure, sizes_mb, timed)[0]
        rate = {key: [b / t for t in ts] for key, (ts, b) in result.items()}
        p2p = {key: r for key, r in rate.items() if key[0] == "p2p"}
        for (_, mb, how), r in p2p.items():
            ceiling_rows.append(f"| {n} | {how} | {mb} | {max(r) / 1e9:.2f} | {protocol.median(r) / 1e9:.2f} |")
        times = {key: ts for key, (ts, _) in result.items()}
        for mb in sizes_mb:
            for op in OPS:
                g, rg = (op, mb, "gloo"), (op, mb, "ring")
                frac = {impl: ceilings.fraction(rate[op, mb, impl], p2p) for impl in ("gloo", "ring")}
                fractions.update({f"{impl} {op}, {n} ranks, {mb} MB": f for impl, f in frac.items()})
                rows.append(f"| {n} | {op} | {mb} | {protocol.median(times[g]) * 1e3:.1f} | "
                            f"{protocol.median(times[rg]) * 1e3:.1f} | {protocol.ratio(times, rg, g)} | "
                            f"{protocol.median(rate[g]) / 1e9:.2f} | {protocol.median(rate[rg]) / 1e9:.2f} | "
                            f"{frac['gloo']} | {frac['ring']} |")
        mb = max(sizes_mb)
        busy = {}
        for op in OPS:
            g, rg = (op, mb, "gloo"), (op, mb, "ring")
            busy[op] = {k: protocol.median(cpu[k]) / (protocol.median(times[k]) * cores) for k in (g, rg)}
            cpu_rows.append(f"| {n} | {op} | {mb} | {protocol.median(cpu[g]) * 1e3:.1f} | "
                            f"{protocol.median(cpu[rg]) * 1e3:.1f} | {protocol.ratio(cpu, rg, g)} | "
                            f"{busy[op][g]:.2f} | {busy[op][rg]:.2f} |")
        rs = protocol.ratio(times, ("reduce_scatter", mb, "ring"), ("reduce_scatter", mb, "gloo"))
        ar = protocol.ratio(times, ("all_reduce", mb, "ring"), ("all_reduce", mb, "gloo"))
        ar_cpu = protocol.ratio(cpu, ("all_reduce", mb, "ring"), ("all_reduce", mb, "gloo"))
        parts = {part: (protocol.median(cpu["all_reduce", mb, "gloo", part]), protocol.median(cpu["all_reduce", mb, "ring", part]),
                        protocol.ratio(cpu, ("all_reduce", mb, "ring", part), ("all_reduce", mb, "gloo", part)))
                 for part in ("user", "system")}
        bound[n] = (ar, ar_cpu, min(busy["all_reduce"].values()), parts)
        headlines += [
            protocol.headline(f"ring reduce_scatter from send/recv / gloo's, {n} ranks, {mb} MB", rs,
                              reference=RS_TARGET, below=f"within the target <= {RS_TARGET}",
                              above=f"misses the target <= {RS_TARGET}",
                              note=f"gloo's runs a whole all_reduce (2x the bytes): the ring's ideal is about 0.5; "
                                   f"bus bandwidth / transport ceiling: ring {fractions[f'ring reduce_scatter, {n} ranks, {mb} MB']}, "
                                   f"gloo {fractions[f'gloo reduce_scatter, {n} ranks, {mb} MB']}"),
            protocol.headline(f"ring all_reduce from send/recv / gloo's, {n} ranks, {mb} MB", ar,
                              below="the ring faster", above="gloo faster",
                              note=f"bus bandwidth / transport ceiling: ring {fractions[f'ring all_reduce, {n} ranks, {mb} MB']}, "
                                   f"gloo {fractions[f'gloo all_reduce, {n} ranks, {mb} MB']}; CPU time of all ranks, "
                                   f"ring / gloo: {ar_cpu}, the {cores} cores busy "
                                   f"{min(busy['all_reduce'].values()):.2f}-{max(busy['all_reduce'].values()):.2f} of the call")]
    lucky = ceilings.check(fractions)            # fails loudly: a collective faster than send/recv itself
    text = ("### Collectives: gloo vs ring built from send/recv\n\n" + "\n".join(rows) +
            "\n\nTransport ceiling (benchmarks/ceilings.py), measured in the same rounds; a row's fraction of it: its bus "
            "bandwidth over the fastest of these in the same round (paired median [middle half]), and its best round "
            "over their best round (best):\n\n" + "\n".join(ceiling_rows) +
            f"\n\nCPU time, {max(sizes_mb)} MB: the same calls in rounds of their own, each call's CPU time summed over "
            "the ranks' processes (gloo's transport threads included: `protocol.cpu_all_ranks`), and the cores busy: "
            f"that CPU time over the call's median wall time (above) times this machine's {cores} cores:\n\n"
            + "\n".join(cpu_rows) + "\n\n" + _cpu_reading(bound, cores) +
            "\n\n" + protocol.PROTOCOL_NOTE + "\n" + ceilings.warning(lucky))
    return Section(text, headlines)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7, help="timed paired rounds")
    ap.add_argument("--sizes-mb", type=int, nargs="+", default=list(SIZES_MB))
    args = ap.parse_args()
    print(main(tuple(args.sizes_mb), args.rounds))
