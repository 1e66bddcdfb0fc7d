"""Probe (two GPUs): what each front does with work on a second GPU inside the graphed call.

Three small models on cuda:0 with a part on cuda:1: ``MP`` moves its activations there and back
(naive model parallelism, as Hugging Face's ``device_map="auto"`` makes over two GPUs); ``Side``
adds to a counter buffer on cuda:1 with no data passing between the devices; ``Out`` returns a
cuda:1 tensor computed from a cuda:0 sum. For each of ``tr.graph``, ``sizes=``,
``make_graphed_callables`` and ``breaks="auto"`` it prints whether the build raised, and if not,
the largest difference from eager over 4 calls (and ``Side``'s counter against eager's); then
``tr.check``'s findings. The expectation to test (session 75, not yet run): a cross-device copy
inside a capture fails the capture (an event between a capturing and a non-capturing stream), so
``MP`` and ``Out`` raise ``CaptureError``; ``Side``'s cuda:1 kernel runs during warm-up and
capture on that device's own stream and is never recorded, so a replay would leave the counter
behind eager's, silently. Usage: ``PYTHONPATH=. python scripts/multi_device_probe.py``.
"""
import torch, torchreplay as tr

torch.manual_seed(0)

class MP(torch.nn.Module):  # HF device_map="auto" across two GPUs, in small
    def __init__(s):
        super().__init__()
        s.a = torch.nn.Linear(64, 64).to("cuda:0")
        s.b = torch.nn.Linear(64, 64).to("cuda:1")
    def forward(s, x):
        return s.b(torch.relu(s.a(x)).to("cuda:1")).to("cuda:0")

class Side(torch.nn.Module):  # independent work on cuda:1: a counter there
    def __init__(s):
        super().__init__()
        s.a = torch.nn.Linear(64, 64).to("cuda:0")
        s.register_buffer("seen", torch.zeros(1, device="cuda:1"))
    def forward(s, x):
        s.seen.add_(1)
        return s.a(x)

class Out(torch.nn.Module):  # returns a result computed on cuda:1 from a cuda:1 weight only
    def __init__(s):
        super().__init__()
        s.a = torch.nn.Linear(64, 64).to("cuda:0")
        s.w = torch.nn.Parameter(torch.randn(64, device="cuda:1"))
    def forward(s, x):
        return s.a(x), s.w * x.sum().to("cuda:1")

for cls in (MP, Side, Out):
    m = cls().eval()
    x = torch.randn(8, 64, device="cuda:0")
    for front in ("graph", "sizes", "mgc", "breaks-auto"):
        mm = cls().eval(); mm.load_state_dict(m.state_dict())
        try:
            if front == "graph":
                g = tr.graph(mm, x)
            elif front == "sizes":
                g = tr.graph(mm, x, sizes=[4, 8])
            elif front == "breaks-auto":
                g = tr.graph(mm, x, breaks="auto")
            else:
                g = tr.make_graphed_callables(mm, (x,))
            worst = 0.0
            for i in range(4):
                xi = torch.randn(8, 64, device="cuda:0")
                with torch.no_grad():
                    got, want = g(xi), m(xi)
                got = got if isinstance(got, tuple) else (got,)
                want = want if isinstance(want, tuple) else (want,)
                worst = max(worst, max((a.to("cpu") - b.to("cpu")).abs().max().item() for a, b in zip(got, want)))
            extra = f" seen {float(mm.seen):.0f} vs eager {float(m.seen):.0f}" if cls is Side else ""
            print(f"{cls.__name__} {front}: built; worst diff {worst:.2e}{extra}; stats {getattr(g, 'stats', getattr(getattr(g, 'forward', None), 'stats', None))}")
        except Exception as e:
            print(f"{cls.__name__} {front}: {type(e).__name__}: {str(e)[:400]}")
    try:
        f = tr.check(m, x)
        print(f"{cls.__name__} check: {[getattr(r, 'kind', r) for r in getattr(f, 'findings', [])]} {str(f)[:300]}")
    except Exception as e:
        print(f"{cls.__name__} check: {type(e).__name__}: {str(e)[:300]}")
