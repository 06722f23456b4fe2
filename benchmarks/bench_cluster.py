"""What a cluster costs the simulator: one iteration of Llama-3-70B on 128 and on 2,048
DGX H100 servers (1,024 and 16,384 GPUs), each in a fresh process, the wall time of the
first simulation (the shard traced, cold) and of the next (warm), and the process's peak
resident memory; then the search of ``choose --tokens`` (Llama-3-70B, 2e12 tokens, two H100
clusters, 16 to 1,024 servers) on two local worker processes and on a local Ray instance
of two CPUs, each in a fresh process, its wall time and whether both answers are the same.

    python benchmarks/bench_cluster.py > reports/bench_cluster.txt

The engine simulates one pipeline replica on the servers its stages use (``ClusterView``):
what a job costs grows with its stages and microbatches, not with its data-parallel
replicas or servers (``mpsim.hardware.cluster``). The global batch is 4 Mi tokens (512 x 8,192) on
1,024 GPUs and 16 Mi tokens on 16,384, so each replica runs 32 microbatches.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time

CASES = (  # servers, data, tensor, pipeline, ZeRO stage, HSDP, microbatches per replica
    (128, 16, 8, 8, 1, False, 32),
    (128, 16, 8, 8, 3, True, 32),
    (2048, 128, 8, 16, 1, False, 32),
    (2048, 128, 8, 16, 3, True, 32),
)


def _one(case: tuple) -> dict:
    from mpsim.plans.job import Parallelism, job_of
    from mpsim.sim import Job, simulate_job

    servers, data, tensor, stages, zero, hsdp, m = case
    par = Parallelism(data=data, tensor=tensor, sequence_parallel=True, pipeline=stages, zero_stage=zero, hsdp=hsdp)
    times = []
    for _ in range(2):
        start = time.perf_counter()
        job = job_of(None, "llama-3-70b", microbatches=m, microbatch=1, n_stages=stages, parallelism=par,
                     cluster="dgx-h100-superpod", servers=servers)
        result = simulate_job(Job(job))
        times.append(time.perf_counter() - start)
    rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"gpus": servers * 8, "layout": job.layout_name, "cold_s": times[0], "warm_s": times[1],
            "rss_mib": rss_mib, "iteration_s": result.iteration_s, "events": result.sim_events,
            "simulated_gpus": len(result.gpus)}


SEARCH = {"model": "llama-3-70b", "clusters": ["dgx-h100-superpod", "aws-p5"], "tokens": 2e12, "days": 30.0,
          "min_servers": 16, "max_servers": 1024}


def _search(backend: str) -> dict:
    from mpsim.studies.backends import make_backend
    from mpsim.studies.scale import scale

    start = time.perf_counter()
    report = scale(SEARCH["model"], SEARCH["clusters"], SEARCH["tokens"], SEARCH["days"],
                   backend=make_backend(backend, 2), min_servers=SEARCH["min_servers"],
                   max_servers=SEARCH["max_servers"])
    return {"wall_s": time.perf_counter() - start, "report": report.to_dict(),
            "configurations": sum(a.simulated for a in report.answers)}


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--search":
        print(json.dumps(_search(sys.argv[2])))
        return
    if len(sys.argv) > 1:
        print(json.dumps(_one(tuple(json.loads(sys.argv[1])))))
        return
    print(__doc__.strip().splitlines()[0])
    print(f"{'GPUs':>6}  {'layout':<34} {'cold s':>7} {'warm s':>7} {'peak RSS MiB':>12} {'events':>8} "
          f"{'iteration s':>11}")
    for case in CASES:
        out = subprocess.run([sys.executable, __file__, json.dumps(case)], capture_output=True, text=True, check=True)
        r = json.loads(out.stdout)
        print(f"{r['gpus']:>6}  {r['layout']:<34} {r['cold_s']:>7.2f} {r['warm_s']:>7.2f} {r['rss_mib']:>12.0f} "
              f"{r['events']:>8} {r['iteration_s']:>11.3f}")
    print()
    answers = {}
    for backend in ("local", "ray"):
        out = subprocess.run([sys.executable, __file__, "--search", backend], capture_output=True, text=True,
                             check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        answers[backend] = r["report"]
        print(f"search on {backend} (2 CPUs): {r['configurations']} configurations in {r['wall_s']:.0f} s")
    print(f"same answer on both: {answers['local'] == answers['ray']}")


if __name__ == "__main__":
    main()
