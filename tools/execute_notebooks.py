"""Execute notebooks top to bottom in a fresh kernel and save them with their outputs.

    python tools/execute_notebooks.py notebooks/00_collectives.ipynb [...]

Run from the repo root (or `make notebooks`). Uses the standard `python3` kernel, the one the
notebooks declare, with the notebooks/ folder as working directory, exactly as nbval runs them.
"""
import sys
import time

import nbformat
from nbclient import NotebookClient

for path in sys.argv[1:]:
    t0 = time.time()
    nb = nbformat.read(path, as_version=4)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (zerolab)", "language": "python"}
    NotebookClient(nb, timeout=900, kernel_name="python3", record_timing=False,
                   resources={"metadata": {"path": "notebooks"}}).execute()
    nbformat.write(nb, path)
    print(f"{path}: executed in {time.time() - t0:.0f} s")
