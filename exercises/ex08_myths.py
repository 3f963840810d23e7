"""Exercise 08 — the measurements behind two myths, done yourself.

Myth 3, "ZeRO aggregates gradients on a master GPU": lesson 08 builds the master scheme and measures
rank 0 sending N-1 times what the others send. A parameter server can be SHARDED: K servers, each
owning 1/K of the tensor. 08.1 builds it from point-to-point messages; measure it for K = 1, 2, N
in the lesson and see what it becomes when every rank is a server.

Myth 2, "ZeRO compresses gradients": 08.2 measures, on the sockets, how many bytes a real ZeRO
step sends per gradient element.

Grade your work:  ``make grade`` or, in lesson 08, ``zerolab.grade.check("08")``.
"""


def sharded_server_average(tensor, servers, group=None):
    """Average ``tensor`` over the ranks of ``group``, in place, through ``servers`` parameter servers.

    Contract (graded on 4 ranks, K = 1, 2, 4, exact values): the tensor's elements are cut into K
    contiguous slices (``tensor.view(-1).tensor_split(K)``); slice k belongs to server rank k
    (ranks 0 .. K-1). Every rank sends each slice it does not serve to that slice's server; a server
    adds what it receives to its own slice, divides by N, and sends the averaged slice back to every
    other rank. Use only point-to-point ``torch.distributed`` / ``zerolab.comm`` send and recv (the
    graded tests make every collective raise and record each message): a rank that is not a server
    talks to servers only, and every byte is sent once on its way in and once on its way out."""
    raise NotImplementedError(
        "Exercise 08.1: average the tensor through K servers that each own one slice of it.")


def bytes_per_element(param_dtype):
    """Run one training step (forward, backward, step) of zerolab's stage-2 engine on TinyGPT on
    the current ranks (``zerolab.initialize(models.build("gpt"), stage=2, lr=1e-3,
    param_dtype=param_dtype)``, batch from ``models.batch("gpt", seed=rank, model=model)``; start
    the measurement after a first, warm-up step) and return the bytes this rank wrote to its sockets
    during the measured step, divided by the number of elements its collectives carried under the
    ring (a reduce-scatter of the gradients and an all-gather of the parameters: 2(N-1)/N x Ψ).

    Measure the bytes (the kernel's counter, ``zerolab.comm.log().measured_bytes``); graded against
    the grader's own measurement for float32 and bfloat16. Then explain the two numbers."""
    raise NotImplementedError(
        "Exercise 08.2: measure one step's socket bytes and divide by the elements the ring carries.")
