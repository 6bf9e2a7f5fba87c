"""Summarize an XSpace (bytes) with a minimal protobuf wire decoder: no stubs needed."""
import collections, json, statistics, sys


def varint(b, i):
    r = s = 0
    while True:
        c = b[i]
        i += 1
        r |= (c & 0x7F) << s
        s += 7
        if c < 0x80:
            return r, i


def fields(b):
    i, n = 0, len(b)
    while i < n:
        key, i = varint(b, i)
        f, wt = key >> 3, key & 7
        if wt == 0:
            v, i = varint(b, i)
        elif wt == 1:
            v = b[i : i + 8]
            i += 8
        elif wt == 2:
            ln, i = varint(b, i)
            v = b[i : i + ln]
            i += ln
        elif wt == 5:
            v = b[i : i + 4]
            i += 4
        else:
            raise ValueError(f"wire type {wt}")
        yield f, v


def signed(v):
    return v - (1 << 64) if v >= 1 << 63 else v


def plane_summary(pb, keep_durations):
    name, lines, meta = "", [], {}
    for f, v in fields(pb):
        if f == 2:
            name = bytes(v).decode(errors="replace")
        elif f == 3:
            lines.append(v)
        elif f == 4:
            k, m = None, None
            for ff, vv in fields(v):
                if ff == 1:
                    k = signed(vv)
                elif ff == 2:
                    m = vv
            mname = ""
            for ff, vv in fields(m or b""):
                if ff == 2:
                    mname = bytes(vv).decode(errors="replace")
            meta[k] = mname
    out_lines = []
    counts = collections.Counter()
    durs = collections.defaultdict(list)
    first_ns, last_ns = None, None
    for lb in lines:
        lname, ts, nev = "", 0, 0
        evs = []
        for f, v in fields(lb):
            if f == 2:
                lname = bytes(v).decode(errors="replace")
            elif f == 11 and not lname:
                lname = bytes(v).decode(errors="replace")
            elif f == 3:
                ts = signed(v)
            elif f == 4:
                evs.append(v)
        for e in evs:
            mid, off, dur = 0, 0, 0
            for f, v in fields(e):
                if f == 1:
                    mid = signed(v)
                elif f == 2:
                    off = signed(v)
                elif f == 3:
                    dur = signed(v)
            n = meta.get(mid, f"#{mid}")
            counts[n] += 1
            if keep_durations:
                durs[n].append(dur)
            s = ts * 1000 + off
            first_ns = s if first_ns is None else min(first_ns, s)
            last_ns = s + dur if last_ns is None else max(last_ns, s + dur)
        out_lines.append({"name": lname, "events": len(evs)})
    top = []
    for n, c in counts.most_common(25):
        d = durs.get(n)
        top.append(
            {
                "name": n[:160],
                "count": c,
                "median_us": (statistics.median(d) / 1e6) if d else None,
                "total_us": (sum(d) / 1e6) if d else None,
            }
        )
    return {
        "name": name,
        "lines": len(out_lines),
        "events": sum(counts.values()),
        "line_events": out_lines[:40],
        "span_ps": [first_ns, last_ns],
        "top": top,
    }


def summarize(data, keep_durations=True):
    planes = []
    for f, v in fields(data):
        if f == 1:
            planes.append(plane_summary(v, keep_durations))
    return {"bytes": len(data), "planes": planes}


def metadata_names(plane, field):
    """The plane's event (field 4) or stat (field 5) metadata: id -> name."""
    out = {}
    for f, v in fields(plane):
        if f == field:
            k, m = None, b""
            for ff, vv in fields(v):
                if ff == 1:
                    k = signed(vv)
                elif ff == 2:
                    m = vv
            for ff, vv in fields(m):
                if ff == 2:
                    out[k] = bytes(vv).decode(errors="replace")
    return out


def launching_ops(data, stat="torch_op"):
    """For each GPU plane's events: (event name, the str or ref value of
    `stat`, or None) -> count."""
    counts = collections.Counter()
    for f, pb in fields(data):
        if f != 1:
            continue
        name = ""
        for ff, vv in fields(pb):
            if ff == 2:
                name = bytes(vv).decode(errors="replace")
        if not name.startswith("/device:GPU"):
            continue
        stats = metadata_names(pb, 5)
        events = metadata_names(pb, 4)
        for ff, lb in fields(pb):
            if ff != 3:
                continue
            for f3, eb in fields(lb):
                if f3 != 4:
                    continue
                mid, op = 0, None
                for f4, v4 in fields(eb):
                    if f4 == 1:
                        mid = signed(v4)
                    elif f4 == 4:
                        sid, value = None, None
                        for f5, v5 in fields(v4):
                            if f5 == 1:
                                sid = signed(v5)
                            elif f5 == 5:
                                value = bytes(v5).decode(errors="replace")
                            elif f5 == 7:
                                value = stats.get(signed(v5))
                        if stats.get(sid) == stat:
                            op = value
                counts[(events.get(mid, f"#{mid}"), op)] += 1
    return counts


if __name__ == "__main__":
    with open(sys.argv[1], "rb") as fh:
        print(json.dumps(summarize(fh.read()), indent=1))
