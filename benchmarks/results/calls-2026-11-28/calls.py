"""Calls per Produce request, from two cProfile runs of one proxy (cprof.sh) that differ only
in how many requests they served: the difference leaves start-up and shutdown out.

    python calls.py SMALL.prof LARGE.prof REQUESTS [ROWS]

REQUESTS: how many more Produce requests the large run served (its metrics tell). Counts
are exact; cProfile's times are not (it slows Python calls far more than C), so they only
rank. A coroutine counts once per resumption, as cProfile counts it.
"""

import pstats
import sys


def by_function(path: str) -> dict[str, tuple[int, float]]:
    stats = pstats.Stats(path).stats  # type: ignore[attr-defined]
    table = {}
    for (file, line, name), (_, calls, own, _, _) in stats.items():
        short = file.split("site-packages/")[-1].split("lib/python3.11/")[-1]
        table[f"{short}:{line}({name})"] = (calls, own)
    return table


def main() -> None:
    small, large = by_function(sys.argv[1]), by_function(sys.argv[2])
    requests = int(sys.argv[3])
    rows = int(sys.argv[4]) if len(sys.argv) > 4 else 40
    per_request = []
    for key, (calls, own) in large.items():
        calls0, own0 = small.get(key, (0, 0.0))
        per_request.append(((calls - calls0) / requests, (own - own0) * 1e6 / requests, key))
    total_calls = sum(calls for calls, _, _ in per_request)
    print(f"calls per request: {total_calls:.0f} (own time under cProfile, to rank only)")
    for calls, own, key in sorted(per_request, reverse=True)[:rows]:
        print(f"{calls:8.2f} {own:8.2f} us  {key}")


if __name__ == "__main__":
    main()
