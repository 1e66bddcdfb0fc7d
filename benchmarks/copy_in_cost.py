"""``copy_`` against ``torch._foreach_copy_`` for a one-tensor copy-in, alone and before the
replay of a 12-layer MLP's graph: host us per call, interleaved rounds."""
import time, statistics, torch, torch.nn as nn
torch.manual_seed(0)
x = torch.randn(8, 512, device="cuda"); s = torch.empty_like(x)
m = nn.Sequential(*[nn.Linear(512, 512) for _ in range(12)]).cuda().eval()
g = torch.cuda.CUDAGraph()
st = torch.cuda.Stream()
with torch.no_grad():
    st.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(st):
        for _ in range(3): m(s)
    torch.cuda.current_stream().wait_stream(st)
    with torch.cuda.graph(g):
        out = m(s)
fc = torch._foreach_copy_
ls, lx = [s], [x]
variants = {
    "copy_": lambda: s.copy_(x),
    "foreach": lambda: fc([s], [x]),
    "foreach prebuilt lists": lambda: fc(ls, lx),
    "copy_ + replay": lambda: (s.copy_(x), g.replay()),
    "foreach + replay": lambda: (fc([s], [x]), g.replay()),
}
def per(f, n=2000):
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n): f()
    e = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return e
res = {k: [] for k in variants}
for _ in range(3):
    for f in variants.values(): per(f, 200)
for r in range(40):
    for k, f in variants.items():
        res[k].append(per(f, 500 if "replay" not in k else 200))
for k, v in res.items():
    print(f"{k:26s} min {min(v):6.2f} med {statistics.median(v):6.2f}")
