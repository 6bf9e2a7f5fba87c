"""A GPU workload that counts its own work, for checking ebtrace on a real GPU.

argv: MODE COUNTER_FILE OUT_PREFIX
  launches: 100 x.add_(1) per synchronize (one kernel each)
  matmul:   (a @ a).relu_().sum().item() per iteration
  jax:      a jitted tanh(x @ x).sum() per iteration
The counter file holds (iterations, kernels launched per iteration) as two
little-endian u64. SIGUSR1: profile the next 200 iterations with the
framework's own profiler and write OUT_PREFIX.own_profile.json (with, for
PyTorch, the op each kernel ran for). SIGUSR2:
write each iteration's end time (time.time_ns) to OUT_PREFIX.iter_ns.npy.
"""
import json, mmap, os, signal, struct, sys, time

import numpy as np

mode, counter_path, out_prefix = sys.argv[1:4]
with open(counter_path, "wb") as fh:
    fh.write(b"\0" * 16)
fd = os.open(counter_path, os.O_RDWR)
mm = mmap.mmap(fd, 16)

flags = {"profile": False, "dump": False}
signal.signal(signal.SIGUSR1, lambda *_: flags.__setitem__("profile", True))
signal.signal(signal.SIGUSR2, lambda *_: flags.__setitem__("dump", True))

ends = np.zeros(4_000_000, dtype=np.int64)

if mode == "jax":
    import jax, jax.numpy as jnp

    x = jnp.ones((1024, 1024), dtype=jnp.float32) / 1024
    step = jax.jit(lambda x: jnp.tanh(x @ x).sum())
    step(x).block_until_ready()

    def one():
        step(x).block_until_ready()

    per_iter = 0
else:
    import torch

    if mode == "launches":
        v = torch.zeros(1024, device="cuda")

        def one():
            for _ in range(100):
                v.add_(1.0)
            torch.cuda.synchronize()

        per_iter = 100
    else:
        a = torch.randn(2048, 2048, device="cuda") / 45

        def one():
            (a @ a).relu_().sum().item()

        per_iter = 0
    one()
    torch.cuda.synchronize()


_keep = []


def cupti_probe():
    import ctypes

    paths = [l.split()[-1] for l in open("/proc/self/maps") if "libcupti" in l]
    if not paths:
        return {"cupti": "not mapped"}
    lib = ctypes.CDLL(paths[0])
    res = {}
    sub = ctypes.c_void_p()
    cb = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p)(lambda *a: None)
    _keep.append(cb)
    r = lib.cuptiSubscribe(ctypes.byref(sub), cb, None)
    res["subscribe"] = r
    if r == 0:
        res["unsubscribe"] = lib.cuptiUnsubscribe(sub)
    d = ctypes.c_size_t()
    res["dropped_rc"] = lib.cuptiActivityGetNumDroppedRecords(None, 0, ctypes.byref(d))
    res["dropped"] = d.value
    return res


def own_profile(n=200):
    out = {"iterations": n, "kernels": {}}
    if mode != "jax":
        try:
            out["cupti_before"] = cupti_probe()
        except Exception as e:
            out["cupti_before"] = repr(e)
    if mode == "jax":
        import glob, tempfile

        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import xspace_summary

        d = tempfile.mkdtemp()
        with jax.profiler.trace(d):
            for _ in range(n):
                one()
        pb = glob.glob(f"{d}/**/*.xplane.pb", recursive=True)
        with open(pb[0], "rb") as fh:
            out["xspace"] = xspace_summary.summarize(fh.read())
        return out
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        for _ in range(n):
            one()
        torch.cuda.synchronize()
    # Each kernel under the op whose runtime call launched it.
    ops = {}
    try:
        for e in p.events():
            for k in getattr(e, "kernels", []):
                d = ops.setdefault(k.name, {})
                d[e.name] = d.get(e.name, 0) + 1
    except Exception as e:  # reported, the loop goes on
        ops = {"error": repr(e)}
    out["kernel_ops"] = ops
    path = out_prefix + ".torch_trace.json"
    p.export_chrome_trace(path)
    try:
        out["cupti_after"] = cupti_probe()
    except Exception as e:
        out["cupti_after"] = repr(e)
    with open(path) as fh:
        tr = json.load(fh)
    k = {}
    for e in tr.get("traceEvents", []):
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            d = k.setdefault(e["name"], [])
            d.append(float(e.get("dur", 0)))
        if e.get("cat") == "cuda_runtime" or e.get("cat") == "cuda_driver":
            d = out.setdefault("runtime_calls", {})
            d[e["name"]] = d.get(e["name"], 0) + 1
    for name, durs in k.items():
        durs.sort()
        out["kernels"][name] = {"count": len(durs), "median_us": durs[len(durs) // 2]}
    return out


print(json.dumps({"pid": os.getpid(), "per_iter": per_iter}), flush=True)
i = 0
while True:
    one()
    ends[i % len(ends)] = time.time_ns()
    i += 1
    struct.pack_into("<QQ", mm, 0, i, per_iter)
    if flags["dump"]:
        flags["dump"] = False
        np.save(out_prefix + ".iter_ns.npy", ends[: min(i, len(ends))])
        open(out_prefix + ".iter_ns.done", "w").close()
    if flags["profile"]:
        flags["profile"] = False
        try:
            res = own_profile()
        except Exception as e:  # reported, the loop goes on
            res = {"error": repr(e)}
        with open(out_prefix + ".own_profile.json", "w") as fh:
            json.dump(res, fh)
