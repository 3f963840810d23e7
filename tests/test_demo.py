"""`zerolab demo`, run as an instructor runs it (a subprocess from a shell), against independent
references: the final loss of one process training on the same global batches with plain torch
AdamW, the ZeRO per-rank formulas written out here, and the ring's byte count."""
import os
import re
import subprocess
import sys

import torch

from zerolab import models

STAGES = ["0", "1", "2", "3", "2+offload"]
N, STEPS, D, LAYERS, BATCH = 2, 3, 32, 1, 4


def reference_last_loss():
    """The last step's loss averaged over ranks (= over the global batch): one process, AdamW
    (lr 1e-3) on both ranks' batches concatenated."""
    model = models.build("gpt", seed=0, d_model=D, n_layers=LAYERS)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(STEPS):
        parts = [models.batch("gpt", seed=step * N + r, batch_size=BATCH, model=model) for r in range(N)]
        x, y = torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])
        if step == STEPS - 1:
            with torch.no_grad():
                psi = sum(p.numel() for p in model.parameters())
                return model(x, y).item(), psi, sum(p.numel() for p in model.blocks.parameters())
        opt.zero_grad()
        model(x, y).backward()
        opt.step()


def test_demo_prints_one_row_per_stage_saves_figures_and_every_loss_is_one_process_loss(tmp_path):
    out = tmp_path / "figs"
    proc = subprocess.run([sys.executable, "-m", "zerolab", "demo", "--world-size", str(N), "--steps",
                           str(STEPS), "--d-model", str(D), "--layers", str(LAYERS), "--out", str(out)],
                          capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert proc.returncode == 0, proc.stderr
    rows = {line.split()[0]: line.split() for line in proc.stdout.splitlines()
            if len(line.split()) == 11 and line.split()[0] in STAGES}
    assert list(rows) == STAGES, proc.stdout
    loss, psi, in_blocks = reference_last_loss()
    assert f"{N} ranks, TinyGPT with {psi:,} parameters" in proc.stdout
    # fp32 AdamW, K = 8: 16Ψ for DP, 8Ψ + 8Ψ/N, 4Ψ + 12Ψ/N, 16Ψ/N; offload keeps 4Ψ on the device
    formula = {"0": 16 * psi, "1": 8 * psi + 8 * psi / N, "2": 4 * psi + 12 * psi / N, "3": 16 * psi / N,
               "2+offload": 4 * psi}
    ring = {s: 2 * 4 * psi * (N - 1) / N for s in STAGES}           # all-reduce = RS + AG, fp32 words
    # stage 3: blocks gathered in forward and in backward, then reduce-scattered (3x); the root unit
    # (embeddings, final norm, tied head) is gathered once per step (2x)
    ring["3"] = (3 * in_blocks + 2 * (psi - in_blocks)) * 4 * (N - 1) / N
    for spec, cols in rows.items():
        state, pad, wire, final = float(cols[1]), float(cols[3]), float(cols[6]), float(cols[-1])
        assert abs(state - pad - formula[spec] / 1e6) < 2e-3, f"stage {spec}: {state} MB (+{pad} pad) vs formula"
        assert abs(wire - ring[spec] / 1e6) < 2e-3, f"stage {spec}: sent {wire} MB, ring {ring[spec] / 1e6:.3f}"
        assert abs(final - loss) < 2e-5, f"stage {spec}: final loss {final}, one process {loss:.6f}"
    # the table says why stage 3's wire is below ZeRO's 3Ψ: the root unit is gathered once
    note = next(line for line in proc.stdout.splitlines() if line.startswith("stage 3: the theory is ZeRO's 3Ψ"))
    said = float(re.search(r"([0-9.]+) MB with the root gathered once", note).group(1))
    assert abs(said - ring["3"] / 1e6) < 2e-3 and f"{psi - in_blocks:,} elements" in note, note
    assert sorted(p.name for p in out.iterdir()) == ["comm.png", "memory.png", "timeline.png"]


def test_demo_refuses_a_bad_stage_with_usage():
    proc = subprocess.run([sys.executable, "-m", "zerolab", "demo", "--stages", "5"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "stage '5': use 0, 1, 2, 3" in proc.stderr, proc.stderr
