import torch, sys, os
torch._dynamo.config.enable_aot_compile = True
m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU()).cuda()
def fwd(mod, *a):
    return mod(*a)
x = torch.randn(2, 8, device="cuda")
path = "/tmp/aot.bin"
if os.path.exists(path):
    with open(path, "rb") as f:
        loaded = torch.compiler.load_compiled_function(f, f_globals=globals())
else:
    with torch.no_grad():
        loaded = torch.compile(fwd, fullgraph=True).aot_compile(((m, x), {}))
    loaded.save_compiled_function(path)
with torch.no_grad():
    print((loaded(m, x) - m(x)).abs().max())
