"""Where a DP step's time goes: torch's profiler on the variants of bench_dp_step.py.

For each model (seed CNN, quickstart CNN) at one batch size, the plain step, our
DP step (``train_dp_sgd`` on torch.func) and the drop-in's step (the user's loop in
``private_training``) are run ``--steps`` times under ``torch.profiler``: the sum of
the operators' own CPU time (the kernels' work), the process's CPU time per step
(everything: kernels plus Python), their difference (the Python around the
kernels: torch.func's transforms, pytree handling of the parameter dicts, the
dispatch modes, the DP step's bookkeeping) and the ten operators with the most own
time. One torch thread. Usage:

    python examples/profile_dp_step.py            # -> results/bench/dp_step_profile.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))

from bench_dp_step import make_variants, models  # noqa: E402

VARIANTS = ("plain", "ours", "ours_user_loop")


def measure(run, steps_per_call: int, calls: int) -> dict:
    run()  # warm-up
    t = time.process_time()
    for _ in range(calls):
        run()
    per_step_ms = (time.process_time() - t) / (calls * steps_per_call) * 1e3
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            run()
    events = prof.key_averages()
    kernels_ms = sum(e.self_cpu_time_total for e in events) / 1e3 / (calls * steps_per_call)
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:10]
    return {
        "process_cpu_ms_per_step": round(per_step_ms, 3),
        "operators_own_cpu_ms_per_step": round(kernels_ms, 3),
        "python_and_rest_ms_per_step": round(per_step_ms - kernels_ms, 3),
        "top_operators_own_ms_per_step": {e.key: round(e.self_cpu_time_total / 1e3 / (calls * steps_per_call), 3)
                                          for e in top},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3, help="steps per call")
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--out", default=str(ROOT / "results" / "bench" / "dp_step_profile.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    out = {"command": "python examples/profile_dp_step.py" + (f" --batch {args.batch}" if args.batch != 64 else ""),
           "batch": args.batch, "torch": torch.__version__, "torch_threads": 1,
           "note": "process CPU time per step (no profiler) vs the operators' own CPU time under the profiler; "
                   "the difference is Python and dispatch around the kernels", "models": {}}
    for name, (build, rule) in models().items():
        variants = make_variants(build, rule, args.batch, args.steps)
        res = {v: measure(variants[v], args.steps, args.calls) for v in VARIANTS}
        for v in VARIANTS:
            res[v]["ratio_to_plain_process"] = round(res[v]["process_cpu_ms_per_step"]
                                                     / res["plain"]["process_cpu_ms_per_step"], 3)
            res[v]["ratio_to_plain_operators"] = round(res[v]["operators_own_cpu_ms_per_step"]
                                                       / res["plain"]["operators_own_cpu_ms_per_step"], 3)
        out["models"][name] = res
        for v in VARIANTS:
            r = res[v]
            print(f"{name:15s} {v:15s} step {r['process_cpu_ms_per_step']:7.2f} ms ({r['ratio_to_plain_process']:.2f}x)"
                  f"  operators {r['operators_own_cpu_ms_per_step']:7.2f} ms ({r['ratio_to_plain_operators']:.2f}x)"
                  f"  rest {r['python_and_rest_ms_per_step']:6.2f} ms")
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
