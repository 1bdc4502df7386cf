import gc, json, os, sys, threading, time
_times = {0: [], 1: [], 2: []}
_start = [0.0]
def _cb(phase, info):
    if phase == "start":
        _start[0] = time.perf_counter()
    else:
        _times[info["generation"]].append(time.perf_counter() - _start[0])
gc.callbacks.append(_cb)
def _dump():
    while True:
        time.sleep(5)
        out = {"argv": sys.argv, "objects": None, "frozen": gc.get_freeze_count()}
        for g, v in _times.items():
            v = list(v)
            out[str(g)] = {"n": len(v), "total_ms": sum(v) * 1e3, "max_ms": max(v, default=0) * 1e3,
                           "over_5ms": sum(1 for x in v if x > 0.005), "last10_ms": [round(x*1e3,2) for x in v[-10:]]}
        with open(f"/tmp/gcstats/{os.getpid()}.json", "w") as f:
            json.dump(out, f)
threading.Thread(target=_dump, daemon=True).start()
