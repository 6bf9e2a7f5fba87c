"""ebtrace on a real NVIDIA GPU, against the frameworks' own profilers.

Run as root on a machine with a GPU, PyTorch and jax (CUDA):

    python3 tests/gpu/check.py --ebtrace target/release/ebtrace [STEP ...]

Steps (all by default):
  env                 kernel, driver, library versions
  recorder_launches   `serve --retain 30s` on a PyTorch loop launching flat
  recorder_matmul     ... on a PyTorch matmul loop (fp32, 2048x2048)
  recorder_jax        ... on a jitted jax loop of small steps
                      (each: the target's rate without and with the recorder,
                      ebtrace's CPU, launches counted on /metrics against the
                      loop's own count, two GetSnapshot calls, every kernel
                      in them named, peak memory)
  recorder_threads    (not by default) ebtrace's CPU per thread on the launch
                      loop, stack samples at 99 Hz, the default 19 Hz and
                      1 Hz
  recorder_ab         with --baseline OTHER_EBTRACE: the recorder's cost on
                      the --ab-loops (jax, launches), OTHER_EBTRACE and this
                      one taking turns on one target, untraced between them
  snapshot_ab         with --baseline: GetSnapshot on the --snapshot-loops
                      (matmul, launches, jax), the two recorders taking
                      turns on one target: the client's time, the server's
                      (timeline, XSpace) and the events, two calls each
  call_cost           with --baseline: the ns the recorder adds to a
                      cuCtxSetCurrent and a cuCtxGetCurrent call, the same way
  record_matmul       `ebtrace --pid` for 2 s with CUPTI: kernels on the GPU
                      plane against the loop's iterations in the window, and
                      their durations against torch.profiler's afterwards
  record_jax          the same on the jax loop, through jax's own session
  record_ops          `ebtrace --pid` on the PyTorch matmul loop: each kernel's
                      op (its `torch_op` stat, through its launch's correlation
                      id) against the op torch.profiler gives it afterwards
  profile_after       captures ended by SIGKILL (after --kill-after seconds)
                      or normally (--normal N): torch.profiler in the program
                      must then record every kernel (CUPTI left free)

Writes OUT/results.json (everything measured, and `checks`: what failed)
and prints the checks.
"""
import argparse, glob, gzip, json, os, re, signal, struct, subprocess, sys, tarfile, time, traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import xspace_summary  # noqa: E402

ARGS = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ARGS.add_argument("--ebtrace", required=True, help="the ebtrace binary")
ARGS.add_argument("--baseline", help="recorder_ab, call_cost: another ebtrace binary to compare with")
ARGS.add_argument("--ab-loops", default="jax,launches", help="recorder_ab: the loops")
ARGS.add_argument("--snapshot-loops", default="matmul,launches,jax", help="snapshot_ab: the loops")
ARGS.add_argument("--snapshot-fill", type=float, default=12, help="snapshot_ab: seconds each recorder runs before its snapshots")
ARGS.add_argument("--out", default="ebtrace-gpu-check", help="where results.json goes")
ARGS.add_argument("--work", default="/tmp/ebtrace-gpu-check", help="scratch directory")
ARGS.add_argument("--kill-after", default="0,0.5,1.5,3", help="profile_after: seconds into each killed capture")
ARGS.add_argument("--normal", type=int, default=2, help="profile_after: captures that end normally")
ARGS.add_argument("steps", nargs="*")
A = ARGS.parse_args()

OUT = A.out
W = A.work
os.makedirs(W, exist_ok=True)
os.makedirs(OUT, exist_ok=True)
EBT = os.path.abspath(A.ebtrace)
PY = sys.executable
R = {"checks": {}}
DELAYS = [float(x) for x in A.kill_after.split(",") if x] + [-1.0] * A.normal
STEPS = A.steps or ["env", "call_cost", "recorder_ab", "snapshot_ab", "recorder_launches", "recorder_matmul", "recorder_jax", "record_matmul", "record_jax", "record_ops", "profile_after"]


def check(name, ok, detail):
    """One verdict: `ok` true when ebtrace agrees with the independent count."""
    R["checks"][name] = {"ok": bool(ok), "detail": detail}


def save():
    with open(os.path.join(OUT, "results.json"), "w") as fh:
        json.dump(R, fh, indent=1)


def log(*a):
    print(time.strftime("%H:%M:%S"), *a, flush=True)


def sh(cmd, timeout=60):
    p = subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=timeout)
    return (p.stdout + p.stderr).strip()


class Target:
    def __init__(self, mode):
        self.mode = mode
        self.counter = f"{W}/{mode}.counter"
        self.prefix = f"{W}/{mode}"
        self.p = subprocess.Popen(
            [PY, os.path.join(HERE, "gpu_target.py"), mode, self.counter, self.prefix],
            stdout=subprocess.PIPE,
            stderr=open(f"{W}/{mode}.target.err", "w"),
            text=True,
        )
        self.pid = json.loads(self.p.stdout.readline())["pid"]
        log(f"{mode} target pid {self.pid}")

    def count(self):
        with open(self.counter, "rb") as fh:
            return struct.unpack("<QQ", fh.read(16))

    def rate(self, secs):
        a, t = self.count()[0], time.time()
        time.sleep(secs)
        b = self.count()[0]
        return (b - a) / (time.time() - t)

    def alive(self):
        return self.p.poll() is None

    def own_profile(self, timeout=120):
        path = self.prefix + ".own_profile.json"
        if os.path.exists(path):
            os.remove(path)
        os.kill(self.pid, signal.SIGUSR1)
        t = time.time()
        while not os.path.exists(path) and time.time() - t < timeout and self.alive():
            time.sleep(0.2)
        time.sleep(0.3)
        with open(path) as fh:
            return json.load(fh)

    def iter_ends(self):
        import numpy as np

        done = self.prefix + ".iter_ns.done"
        if os.path.exists(done):
            os.remove(done)
        os.kill(self.pid, signal.SIGUSR2)
        t = time.time()
        while not os.path.exists(done) and time.time() - t < 30:
            time.sleep(0.1)
        return np.load(self.prefix + ".iter_ns.npy")

    def stop(self):
        if self.alive():
            self.p.kill()
        self.p.wait()


def cpu_ticks(pid):
    with open(f"/proc/{pid}/stat") as fh:
        f = fh.read().rsplit(")", 1)[1].split()
    return int(f[11]) + int(f[12])


def status_kb(pid, key):
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1])


def metrics(port=9464):
    import urllib.request

    txt = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for line in txt.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        k, v = line.rsplit(" ", 1)
        out[k] = float(v)
    return out


def metric(m, name, pid=None):
    for k, v in m.items():
        if k.split("{")[0] == name and (pid is None or f'pid="{pid}"' in k):
            return v


def grpc_call(method, req=b"", addr="127.0.0.1:6009", timeout=120):
    import grpc

    ch = grpc.insecure_channel(addr, options=[("grpc.max_receive_message_length", 2**31 - 1)])
    f = ch.unary_unary(f"/tensorflow.ProfilerService/{method}")
    t = time.perf_counter()
    resp = f(req, timeout=timeout)
    return resp, time.perf_counter() - t


def xspace_of(resp):
    xs = None
    for f, v in xspace_summary.fields(resp):
        if f == 6:
            for ff, vv in xspace_summary.fields(v):
                if ff == 2:
                    xs = bytes(vv)
        elif f == 8:
            xs = bytes(v)
    return xs


def serve(pid, extra="", binary=EBT):
    err = open(f"{W}/serve_{pid}.err", "a")
    p = subprocess.Popen(
        f"exec {binary} serve --pid {pid} --retain 30s --http 127.0.0.1:9464 {extra}",
        shell=True,
        stdout=err,
        stderr=err,
    )
    for _ in range(100):
        time.sleep(0.2)
        try:
            metrics()
            break
        except Exception:
            pass
    return p


def step_env():
    R["env"] = {
        "uname": sh("uname -a"),
        "nvidia_smi": sh("nvidia-smi --query-gpu=name,driver_version --format=csv,noheader"),
        "tracefs": sh("mount | grep -E 'tracefs|debugfs' || echo none"),
        "btf": os.path.exists("/sys/kernel/btf/vmlinux"),
        "versions": sh(f"{PY} -c 'import torch,jax;print(torch.__version__, torch.version.cuda, jax.__version__)'"),
        "libcuda": sh("ldconfig -p | grep libcuda.so.1; ls -la /usr/local/nvidia/lib64/libcuda* 2>/dev/null | head -3"),
        "cupti": sh(f"{PY} -c 'import glob,torch,os;print(glob.glob(os.path.dirname(torch.__file__)+\"/../nvidia/**/libcupti*\",recursive=True)[:4])'"),
        "nproc": os.cpu_count(),
        "ebtrace_version": sh(f"{EBT} --version"),
    }
    if "tracefs" not in R["env"]["tracefs"]:
        R["env"]["mount_tracefs"] = sh("mount -t tracefs nodev /sys/kernel/tracing; mount -t debugfs nodev /sys/kernel/debug; mount | grep -E 'tracefs|debugfs'")


def recorder_on(mode):
    t = Target(mode)
    r = R[f"recorder_{mode}"] = {"pid": t.pid}
    try:
        time.sleep(3)
        r["rate_untraced_before"] = t.rate(8)
        s = serve(t.pid)
        time.sleep(5)
        c0, n0, m0, w0 = cpu_ticks(s.pid), t.count()[0], metrics(), time.time()
        time.sleep(10)
        c1, n1, m1, w1 = cpu_ticks(s.pid), t.count()[0], metrics(), time.time()
        hz = os.sysconf("SC_CLK_TCK")
        r["rate_with_recorder"] = (n1 - n0) / (w1 - w0)
        r["ebtrace_cpu_pct_of_one_core"] = 100 * (c1 - c0) / hz / (w1 - w0)
        per = t.count()[1]
        r["launches_by_target"] = (n1 - n0) * per
        a = metric(m0, "ebtrace_process_cuda_launches_total", t.pid)
        b = metric(m1, "ebtrace_process_cuda_launches_total", t.pid)
        r["launches_by_metrics"] = None if a is None or b is None else b - a
        r["sync_wait_s"] = [metric(m0, "ebtrace_process_cuda_sync_wait_seconds_total", t.pid), metric(m1, "ebtrace_process_cuda_sync_wait_seconds_total", t.pid)]
        r["recorder_records"] = metric(m1, "ebtrace_recorder_records")
        r["recorder_limit"] = metric(m1, "ebtrace_recorder_records_limit")
        r["forgotten"] = metric(m1, "ebtrace_recorder_forgotten_records_total")
        r["dropped"] = metric(m1, "ebtrace_records_dropped_total")
        time.sleep(5)
        mark = time.time_ns()
        snaps = []
        for i in range(2):
            resp, dt = grpc_call("GetSnapshot")
            xs = xspace_of(resp)
            summ = xspace_summary.summarize(xs, keep_durations=(i == 0))
            snaps.append({"seconds": dt, "response_bytes": len(resp), "summary": summ if i == 0 else None})
            if i == 0:
                with gzip.open(f"{W}/snapshot_{mode}.xplane.pb.gz", "wb", compresslevel=3) as fh:
                    fh.write(xs)
            time.sleep(2)
        r["snapshot_asked_unix_ns"] = mark
        r["snapshots"] = snaps
        m2 = metrics()
        r["after_snapshots"] = {k: metric(m2, k) for k in ["ebtrace_recorder_records", "ebtrace_recorder_records_limit", "ebtrace_recorder_forgotten_records_total", "ebtrace_resident_memory_bytes", "ebtrace_records_dropped_total"]}
        r["ebtrace_vmhwm_mib"] = status_kb(s.pid, "VmHWM") / 1024
        r["ebtrace_vmrss_mib"] = status_kb(s.pid, "VmRSS") / 1024
        s.send_signal(signal.SIGTERM)
        s.wait(timeout=30)
        r["serve_exit"] = s.returncode
        time.sleep(2)
        r["rate_untraced_after"] = t.rate(6)
        r["target_alive"] = t.alive()
        if per:
            by_t, by_m = r["launches_by_target"], r["launches_by_metrics"] or 0
            check(f"recorder_{mode}: launches on /metrics", abs(by_m - by_t) <= max(50, by_t / 1000), f"{by_m:.0f} counted, {by_t} launched")
        check(f"recorder_{mode}: memory within --retain-memory", r["ebtrace_vmhwm_mib"] <= 256, f"peak {r['ebtrace_vmhwm_mib']:.0f} MiB")
        slowest = max(x["seconds"] for x in snaps)
        check(f"recorder_{mode}: GetSnapshot within 0.5 s", slowest <= 0.5, f"{slowest * 1000:.0f} ms")
        gpu = [p for p in snaps[0]["summary"]["planes"] if p["name"].startswith("/device:GPU:")]
        shown = [k["name"] for p in gpu for k in p["top"]]
        unnamed = [n for n in shown if n.startswith("<unresolved")]
        check(f"recorder_{mode}: snapshot kernels named", shown and not unnamed, f"{len(unnamed)} of {len(shown)} unresolved: {unnamed[:3]}")
        check(f"recorder_{mode}: the target lives on", r["target_alive"], "")
    finally:
        t.stop()
        r["serve_stderr_tail"] = open(f"{W}/serve_{t.pid}.err").read()[-3000:]


def step_recorder_ab():
    """The baseline's recorder and this one's on one target, in turns."""
    if not A.baseline:
        return
    base = os.path.abspath(A.baseline)
    out = R["recorder_ab"] = {"baseline": sh(f"{base} --version"), "this": sh(f"{EBT} --version")}
    hz = os.sysconf("SC_CLK_TCK")
    for mode in A.ab_loops.split(","):
        t = Target(mode)
        phases = out[mode] = []
        try:
            time.sleep(4)
            phases.append({"with": "nothing", "rate": t.rate(6)})
            # ABBA: a drift of the target's own rate weighs on both alike.
            for name, binary in [("baseline", base), ("this", EBT), ("this", EBT), ("baseline", base)]:
                s = serve(t.pid, binary=binary)
                time.sleep(3)
                c0, n0, w0 = cpu_ticks(s.pid), t.count()[0], time.time()
                time.sleep(8)
                c1, n1, w1 = cpu_ticks(s.pid), t.count()[0], time.time()
                m = metrics()
                s.send_signal(signal.SIGTERM)
                s.wait(timeout=30)
                phases.append({"with": name, "rate": (n1 - n0) / (w1 - w0), "cpu_pct": 100 * (c1 - c0) / hz / (w1 - w0), "records": metric(m, "ebtrace_recorder_records"), "dropped": metric(m, "ebtrace_records_dropped_total")})
                time.sleep(1)
                phases.append({"with": "nothing", "rate": t.rate(4)})
            save()
        finally:
            t.stop()
    for mode in A.ab_loops.split(","):
        ph = out[mode]
        untraced = sorted(p["rate"] for p in ph if p["with"] == "nothing")[len([p for p in ph if p["with"] == "nothing"]) // 2]
        for name in ["baseline", "this"]:
            runs = [p for p in ph if p["with"] == name]
            out[f"{mode}_{name}"] = {"ratio": [p["rate"] / untraced for p in runs], "cpu_pct": [p["cpu_pct"] for p in runs]}
        log(mode, json.dumps({k: v for k, v in out.items() if k.startswith(mode + "_")}))


def step_snapshot_ab():
    """GetSnapshot of the baseline's recorder and this one's, in turns on
    one target, each after --snapshot-fill seconds of recording."""
    if not A.baseline:
        return
    base = os.path.abspath(A.baseline)
    out = R["snapshot_ab"] = {"baseline": base, "this": EBT}
    for mode in A.snapshot_loops.split(","):
        t = Target(mode)
        turns = out[mode] = []
        try:
            time.sleep(3)
            # ABBA: a drift of the target's own rate weighs on both alike.
            for name, binary in [("baseline", base), ("this", EBT), ("this", EBT), ("baseline", base)]:
                err = f"{W}/serve_{t.pid}.err"
                logged = os.path.getsize(err) if os.path.exists(err) else 0
                s = serve(t.pid, binary=binary)
                time.sleep(A.snapshot_fill)
                client = []
                for _ in range(2):
                    resp, dt = grpc_call("GetSnapshot")
                    client.append(dt)
                    time.sleep(1.5)
                s.send_signal(signal.SIGTERM)
                s.wait(timeout=30)
                with open(err) as fh:
                    fh.seek(logged)
                    server = [line for line in fh if "session snapshot" in line]
                num = lambda key, line: int(re.search(key + r" (\d+)", line).group(1))
                turns.append({
                    "with": name,
                    "client_ms": [round(1000 * c) for c in client],
                    "server_ms": [num("answered", l) for l in server],
                    "timeline_ms": [num("timeline", l) for l in server],
                    "xspace_ms": [num("XSpace", l) for l in server],
                    "events": [int(re.search(r"window, (\d+) events", l).group(1)) for l in server],
                })
                log(mode, json.dumps(turns[-1]))
            save()
        finally:
            t.stop()
    for mode in A.snapshot_loops.split(","):
        for name in ["baseline", "this"]:
            client = sorted(c for p in out[mode] if p["with"] == name for c in p["client_ms"])
            out[f"{mode}_{name}_client_ms_median"] = (client[1] + client[2]) / 2 if len(client) == 4 else None
        log(mode, "client ms, medians:", out[f"{mode}_baseline_client_ms_median"], "->", out[f"{mode}_this_client_ms_median"])


def step_call_cost():
    """ns per driver call with nothing, the baseline's and this recorder."""
    if not A.baseline:
        return
    base = os.path.abspath(A.baseline)
    path = f"{W}/call_cost.txt"
    if os.path.exists(path):
        os.remove(path)
    p = subprocess.Popen([PY, os.path.join(HERE, "call_cost.py"), path], stdout=subprocess.PIPE, text=True)
    pid = json.loads(p.stdout.readline())["pid"]
    phases = []
    try:
        time.sleep(3)
        for name, binary in [(None, None), ("baseline", base), (None, None), ("this", EBT), (None, None), ("this", EBT), (None, None), ("baseline", base), (None, None)]:
            s = serve(pid, binary=binary) if binary else None
            time.sleep(3 if s else 0)
            t0 = time.time_ns()
            time.sleep(5)
            phases.append((name or "nothing", t0, time.time_ns()))
            if s:
                s.send_signal(signal.SIGTERM)
                s.wait(timeout=30)
                time.sleep(1)
    finally:
        p.kill()
        p.wait()
    rows = [tuple(float(x) for x in line.split()) for line in open(path)]
    out = R["call_cost"] = {"phases": []}
    for name, t0, t1 in phases:
        batch = [r for r in rows if t0 <= r[0] <= t1]
        med = lambda i: sorted(r[i] for r in batch)[len(batch) // 2] if batch else None
        out["phases"].append({"with": name, "batches": len(batch), "set_current_ns": med(1), "get_current_ns": med(2)})
    plain = [ph for ph in out["phases"] if ph["with"] == "nothing"]
    for key in ["set_current_ns", "get_current_ns"]:
        untraced = sorted(ph[key] for ph in plain)[len(plain) // 2]
        for name in ["baseline", "this"]:
            out[f"{key}_added_by_{name}"] = [ph[key] - untraced for ph in out["phases"] if ph["with"] == name]
    log("call_cost", json.dumps({k: v for k, v in out.items() if k != "phases"}))


def step_recorder_launches():
    recorder_on("launches")


def step_recorder_matmul():
    recorder_on("matmul")


def step_recorder_jax():
    recorder_on("jax")


def thread_cpu_ns(pid):
    """Each thread's name and CPU time (ns, from schedstat) by tid."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as fh:
                name = fh.read().strip()
            with open(f"/proc/{pid}/task/{tid}/schedstat") as fh:
                out[tid] = (name, int(fh.read().split()[0]))
        except OSError:
            pass
    return out


def step_recorder_threads():
    """Where the recorder's CPU goes on the launch loop: each thread's share
    over 10 s, with stack samples at 99 Hz, the default 19 Hz and 1 Hz."""
    t = Target("launches")
    r = R["recorder_threads"] = {}
    try:
        time.sleep(3)
        for hz in ["99", "19", "1"]:
            s = serve(t.pid, f"--retain-sample-hz {hz}")
            time.sleep(10)
            a, t0 = thread_cpu_ns(s.pid), time.time()
            time.sleep(10)
            b, t1 = thread_cpu_ns(s.pid), time.time()
            shares = {}
            for tid, (name, ns) in b.items():
                shares[name] = shares.get(name, 0) + 100 * (ns - a.get(tid, (name, 0))[1]) / 1e9 / (t1 - t0)
            r[hz] = {"total_pct": sum(shares.values()), "threads_pct": shares}
            log(f"--retain-sample-hz {hz}: ebtrace {r[hz]['total_pct']:.2f}% of a CPU: {shares}")
            s.send_signal(signal.SIGTERM)
            s.wait(timeout=30)
    finally:
        t.stop()


def record(pid, name, secs="2s", extra=""):
    d = f"{W}/rec_{name}"
    p = subprocess.run(
        f"{EBT} --pid {pid} --duration {secs} --logdir {d} --json {extra}",
        shell=True,
        capture_output=True,
        text=True,
        timeout=180,
    )
    with open(f"{W}/rec_{name}.stderr", "w") as fh:
        fh.write(p.stderr)
    js = None
    try:
        js = json.loads(p.stdout)
    except Exception:
        pass
    xs = None
    if js and js.get("trace"):
        with open(js["trace"], "rb") as fh:
            xs = xspace_summary.summarize(fh.read())
    return {"rc": p.returncode, "json": js, "stderr": p.stderr[-4000:], "xspace": xs}


def step_record_matmul():
    t = Target("matmul")
    r = R["record_matmul"] = {"pid": t.pid}
    try:
        time.sleep(3)
        r["record"] = record(t.pid, "matmul")
        ends = t.iter_ends()
        js = r["record"]["json"] or {}
        w = js.get("window") or {}
        if w:
            a, b = w["start_unix_ns"], w["stop_unix_ns"]
            r["iterations_ending_in_window"] = int(((ends >= a) & (ends <= b)).sum())
        own = r["own_profile_after"] = t.own_profile()
        r["maps_after"] = sh(f"grep -i -E 'ebtrace|cupti' /proc/{t.pid}/maps | awk '{{print $6}}' | sort | uniq -c")
        r["target_alive"] = t.alive()
        gpu = [p for p in (r["record"]["xspace"] or {"planes": []})["planes"] if p["name"] == "/device:GPU:0"]
        top = {k["name"]: k for k in (gpu[0]["top"] if gpu else [])}
        gemm = sum(k["count"] for n, k in top.items() if "gemm" in n)
        its = r.get("iterations_ending_in_window", -1)
        check("record_matmul: one GEMM a window's iteration", abs(gemm - its) <= 2, f"{gemm} GEMM kernels, {its} iterations")
        for name, theirs in own.get("kernels", {}).items():
            ours = top.get(name[:160])
            if ours and theirs["median_us"]:
                ratio = ours["median_us"] / theirs["median_us"]
                check(f"record_matmul: median of {name[:40]} as torch.profiler's", abs(ratio - 1) <= 0.05, f"{ours['median_us']:.3f} us against {theirs['median_us']:.3f}")
        check("record_matmul: torch.profiler records after the capture", sum(k["count"] for k in own.get("kernels", {}).values()) > 0, "")
    finally:
        t.stop()


def step_record_ops():
    t = Target("matmul")
    r = R["record_ops"] = {"pid": t.pid}
    try:
        time.sleep(3)
        rec = record(t.pid, "ops")
        r["record"] = {k: rec[k] for k in ("rc", "stderr")}
        trace = (rec["json"] or {}).get("trace")
        ours = {}
        if trace:
            with open(trace, "rb") as fh:
                for (kernel, op), n in xspace_summary.launching_ops(fh.read()).items():
                    ours.setdefault(kernel[:160], {})[op] = n
        r["ours"] = ours
        theirs = t.own_profile().get("kernel_ops", {})
        r["theirs"] = theirs
        compared = 0
        for kernel, by_op in theirs.items():
            mine = ours.get(kernel[:160])
            if not isinstance(by_op, dict) or not mine:
                continue
            compared += 1
            top = max(by_op, key=by_op.get)
            named = max(mine, key=mine.get)
            check(f"record_ops: {kernel[:40]} ran for {top}", named == top, f"ebtrace: {mine}, torch.profiler: {by_op}")
        check("record_ops: kernels compared", compared >= 2, f"{compared} kernels in both")
        check("record_ops: target alive", t.alive(), "")
    finally:
        t.stop()


def step_record_jax():
    t = Target("jax")
    r = R["record_jax"] = {"pid": t.pid}
    try:
        time.sleep(4)
        r["rate"] = t.rate(2)
        r["record"] = record(t.pid, "jax", secs="2s")
        ends = t.iter_ends()
        w = (r["record"]["json"] or {}).get("window") or {}
        if w:
            a, b = w["start_unix_ns"], w["stop_unix_ns"]
            r["iterations_ending_in_window"] = int(((ends >= a) & (ends <= b)).sum())
        r["own_profile_after"] = t.own_profile()
        r["target_alive"] = t.alive()
        records = (r["record"]["json"] or {}).get("records") or {}
        check("record_jax: no record dropped", records.get("dropped") == 0, str(records))
        gpu = [p for p in (r["record"]["xspace"] or {"planes": []})["planes"] if p["name"].startswith("/device:GPU:")]
        check("record_jax: one plane a GPU", len(gpu) == len({p["name"] for p in gpu}), str([p["name"] for p in gpu]))
        its = r.get("iterations_ending_in_window", -1)
        for plane in gpu:
            for k in plane["top"][:4]:
                check(f"record_jax: {k['name'][:40]} once a step", abs(k["count"] - its) <= 2, f"{k['count']} on {plane['name']}, {its} steps")
    finally:
        t.stop()
        r["target_stderr"] = open(f"{W}/jax.target.err").read()[-2000:]


def threads(pid):
    """The target's threads: tid, name, state and where each waits."""
    rows = []
    for tid in sorted(os.listdir(f"/proc/{pid}/task"), key=int):
        b = f"/proc/{pid}/task/{tid}"
        try:
            comm = open(b + "/comm").read().strip()
            wchan = open(b + "/wchan").read().strip()
            state = open(b + "/stat").read().rsplit(")", 1)[1].split()[0]
            rows.append(f"{tid} {comm} {state} {wchan}")
        except OSError:
            pass
    return rows


def step_profile_after():
    out = R["profile_after"] = []
    for delay in DELAYS:
        t = Target("matmul")
        r = {"pid": t.pid, "delay": delay}
        out.append(r)
        try:
            time.sleep(3)
            errp = f"{W}/kill_{delay}.stderr"
            err = open(errp, "w")
            dur = "4s" if delay < 0 else "30s"
            p = subprocess.Popen([EBT, "--pid", str(t.pid), "--duration", dur, "--logdir", f"{W}/rec_kill"], stdout=err, stderr=err)
            t0 = time.time()
            while time.time() - t0 < 60 and "device activity" not in open(errp).read():
                time.sleep(0.05)
            r["device_line_after_s"] = time.time() - t0
            if delay >= 0:
                time.sleep(delay)
                os.kill(p.pid, signal.SIGKILL)
            p.wait()
            time.sleep(1)
            r["agent_threads"] = [x for x in threads(t.pid) if "ebtrace" in x]
            a = t.own_profile()
            r["own_1"] = {"kernels": sum(v["count"] for v in a.get("kernels", {}).values()), "runtime": sum(a.get("runtime_calls", {}).values()), "error": a.get("error"), "cupti_before": a.get("cupti_before"), "cupti_after": a.get("cupti_after")}
            b = t.own_profile()
            r["own_2"] = {"kernels": sum(v["count"] for v in b.get("kernels", {}).values()), "runtime": sum(b.get("runtime_calls", {}).values()), "error": b.get("error")}
            r["alive"] = t.alive()
            how = "normal end" if delay < 0 else f"SIGKILL after {delay} s"
            check(f"profile_after #{len(out)}: torch.profiler after a {how}", r["own_1"]["kernels"] > 0 and r["alive"], str(r["own_1"]["kernels"]) + " kernels")
            r["stderr"] = open(errp).read()[-1500:]
            r["target_stderr"] = open(f"{W}/matmul.target.err").read()[-3000:]
        except Exception:
            r["exc"] = traceback.format_exc()[-1500:]
        finally:
            t.stop()
        save()


def main():
    for name in STEPS:
        log("step", name)
        t0 = time.time()
        try:
            globals()["step_" + name]()
        except Exception:
            R.setdefault("errors", {})[name] = traceback.format_exc()[-3000:]
            check(f"{name}: ran", False, traceback.format_exc()[-300:])
            log(traceback.format_exc())
        R.setdefault("step_seconds", {})[name] = time.time() - t0
        save()
        log("done", name, f"{time.time() - t0:.1f}s")
    with tarfile.open(os.path.join(OUT, "logs.tar.gz"), "w:gz") as tf:
        for f in glob.glob(f"{W}/*.err") + glob.glob(f"{W}/*.stderr"):
            tf.add(f, arcname=os.path.basename(f))
    failed = [n for n, c in R["checks"].items() if not c["ok"]]
    for n, c in R["checks"].items():
        print(("ok     " if c["ok"] else "FAILED ") + n + (f": {c['detail']}" if c["detail"] else ""))
    print(f"{len(R['checks']) - len(failed)} of {len(R['checks'])} checks passed; everything measured is in {OUT}/results.json")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
