import json, os, statistics, time, torch
from offload.ops import adam
from offload.node import NodeShare, affinity
n = 16 << 20
p = torch.randn(n); g = torch.randn(n); m = torch.zeros(n); v = torch.zeros(n)
share = NodeShare(1, 0, tuple(affinity()))
res = {"torch_threads": torch.get_num_threads(), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"), "elements": n}
for label, threads in (("1 thread (torch.get_num_threads() under OMP_NUM_THREADS=1)", None), ("the rank's share", share.threads)):
    ts = []
    for i in range(12):
        t = time.perf_counter()
        adam.adam_step(p, g, m, v, step=i + 1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01,
                       adamw_mode=True, bias_correction=True, num_threads=threads)
        ts.append(time.perf_counter() - t)
    med = statistics.median(ts[2:])
    res[label] = {"threads": threads or torch.get_num_threads(), "median_s": round(med, 4), "gparams_per_s": round(n / med / 1e9, 3)}
print(json.dumps(res, indent=1))
