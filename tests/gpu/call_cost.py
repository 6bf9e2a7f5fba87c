"""Times two cheap CUDA driver calls in batches, for the probes' cost per call.

argv: OUT_FILE
Appends one line per batch to OUT_FILE: the batch's end (time.time_ns) and
the ns a call of cuCtxSetCurrent and of cuCtxGetCurrent took in it (20,000
calls each through ctypes, whose own cost is in both).
"""
import ctypes, os, sys, time

cu = ctypes.CDLL("libcuda.so.1")
assert cu.cuInit(0) == 0
dev = ctypes.c_int()
assert cu.cuDeviceGet(ctypes.byref(dev), 0) == 0
ctx = ctypes.c_void_p()
assert cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0
set_current, get_current = cu.cuCtxSetCurrent, cu.cuCtxGetCurrent
out = ctypes.c_void_p()
out_ref = ctypes.byref(out)
N = 20_000
print(f'{{"pid": {os.getpid()}}}', flush=True)
with open(sys.argv[1], "a") as fh:
    while True:
        t0 = time.perf_counter_ns()
        for _ in range(N):
            set_current(ctx)
        t1 = time.perf_counter_ns()
        for _ in range(N):
            get_current(out_ref)
        t2 = time.perf_counter_ns()
        fh.write(f"{time.time_ns()} {(t1 - t0) / N:.1f} {(t2 - t1) / N:.1f}\n")
        fh.flush()
