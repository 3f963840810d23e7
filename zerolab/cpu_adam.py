"""One-pass AdamW for the host optimizer: the 16-bit gradient read and the 16-bit parameter written
inside the update's own loop, as DeepSpeed's CPU-Adam does (ZeRO-Offload, arXiv 2101.06840, Sec. 5.1;
DeepSpeed's ``csrc/includes/cpu_adam.h``, ``Step_AVX``, reads the half-precision gradient and writes
the half-precision parameter in the same vectorised loop).

Why a kernel of its own. AdamW is memory-bound: per parameter it does ~10 flops and moves bytes.
Built from torch ops, a bf16 host step makes three passes over memory: cast the bf16 gradient up
into an fp32 workspace (read 2, write 4 bytes per parameter), torch's fused AdamW (read p, g, m, v,
write p, m, v: 28 bytes), cast the fp32 master down into the bf16 parameter (read 4, write 2):
40 bytes per parameter. One loop that reads the 2-byte gradient, updates p, m and v in registers and
writes the 2-byte parameter moves 2 + 12 + 12 + 2 = 28 bytes, what torch's fused AdamW moves on fp32
data alone. Bytes are time here, so that is the whole difference.

How. :data:`SOURCE` is a small C file, compiled the first time it is needed by the machine's C
compiler (``$CC``, else ``cc``) with OpenMP and auto-vectorisation for this CPU, cached on disk (a hash
of the source, the flags and the CPU names the file), loaded with :mod:`ctypes`. Its OpenMP runtime is
torch's own (the library asks for ``libgomp.so.1``, which torch has already loaded), and it runs on
``torch.get_num_threads()`` threads. :func:`load` returns None where no compiler works (no compiler,
no OpenMP, a read-only disk): :class:`zerolab.offload.HostOptimizer` then keeps torch's fused kernel
with the two casts around it, slower and otherwise the same.

The arithmetic is torch's fused CPU AdamW's, operation by operation and in the same order
(``aten/src/ATen/native/cpu/FusedAdamKernel.cpp``, the float path; the scalars computed in double,
then rounded to float), with the same two fused multiply-adds torch's build makes (the first moment's
lerp, and the second moment's last add) and no other: the file is compiled with floating-point
contraction off, so the compiler adds none of its own. On the same fp32 inputs its master, moments and
parameters therefore equal torch's fused AdamW followed by the cast bit for bit, except possibly on the
last few elements of a tensor (fewer than one vector: torch runs those in a scalar loop that its
compiler may fuse differently), which can differ by one rounding (``tests/test_offload.py`` checks both).
"""
import ctypes
import hashlib
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile

import torch

SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef struct {          /* per step; computed by the caller in double, rounded to float (as torch does) */
    float decay;          /* 1 - lr * weight_decay: AdamW's decoupled weight decay */
    float lerp;           /* exp_avg.lerp_(grad, 1 - beta1), see from_grad */
    float beta2, sq;      /* exp_avg_sq * beta2 + (1 - beta2) * grad * grad, the last + fused */
    float bc2_sqrt, eps;  /* denom = sqrt(exp_avg_sq) / sqrt(1 - beta2^t) + eps */
    float neg_step;       /* -lr / (1 - beta1^t) */
    float grad_scale;     /* the gradient is multiplied by it first (1 / the loss scale) */
    int from_grad;        /* torch's lerp: m + w (g - m) for a weight w < 0.5, else g + (w - 1)(g - m) */
} adamw_args;

static inline float from_bf16(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }
static inline uint16_t to_bf16(float f) {      /* round to nearest even, NaN to 0x7fc0: c10::BFloat16's */
    uint32_t u; memcpy(&u, &f, 4);
    uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (uint16_t)(f != f ? 0x7fc0u : rounded);
}
static inline float from_f32(float f) { return f; }

/* One pass: per element the gradient (2 or 4 bytes) and p, m, v (4 each) are read once, and p, m, v
   and the compute-dtype copy of p (none, 2 or 4 bytes) written once. */
#define ADAMW(NAME, GRAD_T, LOAD_GRAD, OUT_T, STORE_OUT)                                              \
void NAME(float *p, const GRAD_T *g, float *m, float *v, OUT_T *out, int64_t n, int threads,          \
          const adamw_args *a) {                                                                      \
    const float decay = a->decay, lerp = a->lerp, beta2 = a->beta2, sq = a->sq, eps = a->eps;          \
    const float bc2_sqrt = a->bc2_sqrt, neg_step = a->neg_step, scale = a->grad_scale;                \
    const int from_grad = a->from_grad;                                                               \
    (void)out;                                                                                        \
    _Pragma("omp parallel for simd schedule(static) num_threads(threads)")                            \
    for (int64_t i = 0; i < n; i++) {                                                                 \
        float grad = LOAD_GRAD(g[i]) * scale;                                                         \
        float param = p[i] * decay;                                                                   \
        float exp_avg = m[i];                                                                         \
        exp_avg = fmaf(lerp, grad - exp_avg, from_grad ? grad : exp_avg);                             \
        float exp_avg_sq = fmaf(sq * grad, grad, v[i] * beta2);                                       \
        float denom = sqrtf(exp_avg_sq) / bc2_sqrt + eps;                                             \
        param = param + neg_step * exp_avg / denom;                                                   \
        p[i] = param;                                                                                 \
        m[i] = exp_avg;                                                                               \
        v[i] = exp_avg_sq;                                                                            \
        STORE_OUT;                                                                                    \
    }                                                                                                 \
}

ADAMW(adamw_f32_none, float, from_f32, float, (void)0)
ADAMW(adamw_f32_f32, float, from_f32, float, out[i] = param)
ADAMW(adamw_f32_bf16, float, from_f32, uint16_t, out[i] = to_bf16(param))
ADAMW(adamw_bf16_none, uint16_t, from_bf16, float, (void)0)
ADAMW(adamw_bf16_f32, uint16_t, from_bf16, float, out[i] = param)
ADAMW(adamw_bf16_bf16, uint16_t, from_bf16, uint16_t, out[i] = to_bf16(param))
"""
# The compiler's flags: vectorised for this CPU, OpenMP, sqrtf without errno (so it vectorises), and no
# floating-point contraction (a * b + c stays two roundings, as in torch's kernel). Without -march=native
# (a compiler that does not know it) the code is portable and slower; without OpenMP it is not built.
FLAG_SETS = (["-O3", "-march=native"], ["-O3"])
COMMON_FLAGS = ["-fno-math-errno", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared"]
DTYPE_NAMES = {torch.float32: "f32", torch.bfloat16: "bf16"}      # what the kernel reads and writes


class _Args(ctypes.Structure):
    _fields_ = [(name, ctypes.c_float) for name in
                ("decay", "lerp", "beta2", "sq", "bc2_sqrt", "eps", "neg_step", "grad_scale")] + [("from_grad", ctypes.c_int)]


def _cpu_id():
    """What the compiled code depends on besides its source: the machine and its instruction sets
    (-march=native), so that a cache shared between machines never hands one another's code."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()} {flags}"


def _cache_dirs():
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return [pathlib.Path(base) / "zerolab", pathlib.Path(tempfile.gettempdir()) / f"zerolab-{os.getuid()}"]


def _build(compiler, flags, target):
    """Compile SOURCE into ``target`` (written under a temporary name, then renamed: ranks that build at
    the same time never load a half-written file). True if it worked."""
    target.parent.mkdir(parents=True, exist_ok=True)
    src = target.with_suffix(f".{os.getpid()}.c")
    tmp = target.with_suffix(f".{os.getpid()}.tmp")
    try:
        src.write_text(SOURCE)
        done = subprocess.run([compiler, *flags, *COMMON_FLAGS, str(src), "-o", str(tmp), "-lm"],
                              capture_output=True, timeout=300)
        if done.returncode != 0:
            return False
        os.replace(tmp, target)
        return True
    finally:
        for f in (src, tmp):
            f.unlink(missing_ok=True)


def _compiler_id(compiler):
    """The compiler's resolved path and modification time (None: no such program): part of the cache key,
    so that a compiler installed or upgraded later is tried afresh."""
    path = shutil.which(compiler)
    if path is None:
        return None
    return f"{os.path.realpath(path)} {os.stat(path).st_mtime_ns}"


def load(compiler=None):
    """The compiled kernel (a :class:`ctypes.CDLL`), built on first use and cached on disk; None where it
    cannot be built or loaded here (then the caller uses torch's kernels). ``compiler``: default ``$CC``,
    else ``cc``. Not on Windows (no ``cc``); only where ``libgomp`` is torch's OpenMP runtime (Linux).
    Cheap when it cannot work: no compiler is found at once; a compiler that fails (no OpenMP, say)
    leaves a ``.failed`` mark next to where the library would be, and is not run again for that key."""
    if platform.system() != "Linux":
        return None                          # elsewhere torch's OpenMP may not be libgomp: two runtimes
    compiler = compiler or os.environ.get("CC") or "cc"
    compiler_id = _compiler_id(compiler)
    if compiler_id is None:
        return None                          # no C compiler here (a CI image, say): torch's kernels
    for flags in FLAG_SETS:
        key = hashlib.sha256("\n".join([SOURCE, compiler_id, *flags, *COMMON_FLAGS, _cpu_id()]).encode()).hexdigest()[:20]
        for cache in _cache_dirs():
            target = cache / f"cpu_adam_{key}.so"
            failed = target.with_suffix(".failed")
            try:
                if target.exists():
                    return _bind(ctypes.CDLL(str(target)))
                if failed.exists():
                    break                    # this compiler cannot build these flags: known, not retried
                if _build(compiler, flags, target):
                    return _bind(ctypes.CDLL(str(target)))
                failed.touch()
                break                        # the compiler said no: another cache folder will not help
            except (OSError, subprocess.SubprocessError):
                continue                     # an unwritable cache, a library that will not load, a timeout
    return None


def _bind(lib):
    ptr, n, threads, args = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.POINTER(_Args)
    for g in DTYPE_NAMES.values():
        for o in (*DTYPE_NAMES.values(), "none"):
            fn = getattr(lib, f"adamw_{g}_{o}")
            fn.argtypes, fn.restype = [ptr, ptr, ptr, ptr, ptr, n, threads, args], None
    return lib


def supports(param, grad, out=None):
    """True if :func:`adamw_` takes these tensors: an fp32 param on the CPU, a bf16 or fp32 gradient,
    a bf16 or fp32 ``out`` (or None), all contiguous, of one size."""
    tensors = [param, grad] + ([] if out is None else [out])
    return (param.dtype == torch.float32 and grad.dtype in DTYPE_NAMES
            and (out is None or out.dtype in DTYPE_NAMES)
            and all(t.device.type == "cpu" and t.is_contiguous() and t.numel() == param.numel() for t in tensors))


@torch.no_grad()
def adamw_(lib, param, grad, exp_avg, exp_avg_sq, out=None, *, step, lr, beta1, beta2, eps, weight_decay,
           grad_scale=1.0):
    """One AdamW update of ``param`` (fp32) from ``grad`` (bf16 or fp32, times ``grad_scale``), in place in
    ``param``, ``exp_avg`` and ``exp_avg_sq`` (fp32), and, in the same pass, ``out`` = the new ``param``
    in out's dtype (bf16 or fp32; None: no copy). ``step``: the step number t after this update counts,
    as torch's state["step"] holds it (1 at the first). ``lib``: from :func:`load`."""
    if not (supports(param, grad, out) and supports(param, exp_avg) and supports(param, exp_avg_sq)
            and exp_avg.dtype == exp_avg_sq.dtype == torch.float32):
        raise ValueError(f"cpu_adam.adamw_: needs contiguous CPU tensors of one size, fp32 param and moments, a "
                         f"bf16/fp32 grad and out; got param {param.dtype} {tuple(param.shape)}, grad {grad.dtype} "
                         f"{tuple(grad.shape)}, out {None if out is None else (out.dtype, tuple(out.shape))}")
    bias_correction1, bias_correction2 = 1 - beta1 ** step, 1 - beta2 ** step
    weight = 1 - beta1                       # torch: exp_avg.lerp_(grad, weight), from exp_avg if weight < 0.5
    args = _Args(decay=1 - lr * weight_decay, lerp=weight if abs(weight) < 0.5 else weight - 1, beta2=beta2,
                 sq=1 - beta2, bc2_sqrt=bias_correction2 ** 0.5, eps=eps, neg_step=-(lr / bias_correction1),
                 grad_scale=grad_scale, from_grad=int(abs(weight) >= 0.5))
    fn = getattr(lib, f"adamw_{DTYPE_NAMES[grad.dtype]}_{'none' if out is None else DTYPE_NAMES[out.dtype]}")
    fn(param.data_ptr(), grad.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(),
       None if out is None else out.data_ptr(), param.numel(), torch.get_num_threads(), ctypes.byref(args))
