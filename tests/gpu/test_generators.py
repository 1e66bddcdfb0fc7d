"""Random numbers from the user's own CUDA generators (``torch.randn(..., generator=g)``: a
sampler's per-request generator, diffusers' ``generator=``, an RNG tracker's) in every API, and a
call that seeds a generator inside itself, refused (core/generators.py).

Every test runs the same calls eagerly and graphed from the same generator state, on fresh random
inputs, over many calls, and compares bitwise (the graph launches the same kernels at the same
philox offsets), and checks where the generator stands after each call.
"""

from __future__ import annotations

import logging
import random
import re
from typing import Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torchreplay as tr

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

DEV = "cuda"
CALLS = 12


def cuda_generator(seed: int) -> torch.Generator:
    g = torch.Generator(device=DEV)
    g.manual_seed(seed)
    return g


class Noisy(nn.Module):
    """A block that draws from its own generator (noise and a mask) and from the default one
    (dropout)."""

    def __init__(self, gen: torch.Generator, width: int = 64) -> None:
        super().__init__()
        self.gen = gen
        self.lin = nn.Linear(width, width)
        self.drop = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        h = h + 0.1 * torch.randn(h.shape, device=h.device, dtype=h.dtype, generator=self.gen)
        keep = torch.rand(h.shape, device=h.device, generator=self.gen) > 0.1
        return self.drop(torch.where(keep, h, 0.0).tanh())


def test_a_function_drawing_from_its_own_generator_replays_as_eager() -> None:
    """The issue's case: this failed to capture ("Attempt to increase offset for a CUDA
    generator not in capture mode"). The build leaves the generator where it found it; every
    replay draws what the eager call would and moves the generator as far."""
    gen = cuda_generator(1)

    def sample(logits: torch.Tensor) -> torch.Tensor:
        noise = torch.rand(logits.shape, device=logits.device, generator=gen)
        gumbel = -torch.log(-torch.log(noise.clamp_min(1e-10)))
        return (logits + gumbel).argmax(-1), torch.bernoulli(logits.sigmoid(), generator=gen)

    x = torch.randn(4, 100, device=DEV)
    before = gen.get_state()
    g = tr.graph(sample, x)
    assert torch.equal(gen.get_state(), before), "the build moved the caller's generator"
    inputs = [torch.randn(4, 100, device=DEV) for _ in range(CALLS)]
    got = []
    for i, xi in enumerate(inputs):
        got.append([t.clone() for t in g(xi)])
        if i == CALLS // 2:  # seeded outside, between calls: both follow
            gen.manual_seed(7)
    after_graph = gen.get_state()
    gen.set_state(before)
    for i, xi in enumerate(inputs):
        want = sample(xi)
        assert all(torch.equal(a, b) for a, b in zip(got[i], want)), f"call {i}"
        if i == CALLS // 2:
            gen.manual_seed(7)
    assert torch.equal(after_graph, gen.get_state())
    assert g.stats.replays == CALLS
    assert not [f for f in tr.check(sample, x) if f.kind == "rng"]  # (no longer a finding)


def test_a_failed_capture_leaves_the_generator_where_it_stood_and_usable() -> None:
    """The capture fails at an ``.item()`` after a draw from a registered generator. Torch 2.11
    clears the generator's "capturing" mark only when a capture ends well: every later draw
    from it in the process failed ("Offset increment outside graph capture encountered
    unexpectedly"), as the default generator's did before ``_compat.end_rng_capture``."""
    gen = cuda_generator(4)

    def scaled_noise(x: torch.Tensor) -> torch.Tensor:
        h = x + torch.rand(x.shape, device=x.device, generator=gen)
        return h / float(h.abs().max().item())

    x = torch.randn(8, device=DEV)
    at = gen.get_state()
    with pytest.raises(tr.CaptureError, match="item"):
        tr.graph(scaled_noise, x)
    assert torch.equal(gen.get_state(), at), "the failed build moved the generator"
    twin = cuda_generator(0)
    twin.set_state(at)
    for _ in range(3):
        xi = torch.randn(8, device=DEV)
        want = xi + torch.rand(xi.shape, device=DEV, generator=twin)
        assert torch.equal(scaled_noise(xi), want / float(want.abs().max().item()))
    torch.rand(4, device=DEV)  # (the default generator too)


def replays_draw_as_eager(g: Callable[[torch.Tensor], torch.Tensor], model: nn.Module, gen: torch.Generator) -> None:
    """Calls at the captured sizes 2, 4 and 8 in mixed order, on fresh inputs: the graph's
    outputs equal eager's from the same generator states (``gen`` and the default one, which
    dropout draws from), and both generators end where eager leaves them."""
    rows = [2, 8, 4, 4, 2, 8, 8, 2, 4, 2, 8, 4]
    inputs = [torch.randn(n, 64, device=DEV) for n in rows]
    gen_at, cuda_at = gen.get_state(), torch.cuda.get_rng_state()  # (after the inputs drew)
    got = [g(x).clone() for x in inputs]
    gen_after, cuda_after = gen.get_state(), torch.cuda.get_rng_state()
    gen.set_state(gen_at)
    torch.cuda.set_rng_state(cuda_at)
    for i, x in enumerate(inputs):
        assert torch.equal(got[i], model(x)), f"call {i} at {rows[i]} rows"
    assert torch.equal(gen_after, gen.get_state()) and torch.equal(cuda_after, torch.cuda.get_rng_state())


def test_a_module_with_its_generator_and_dropout_under_sizes() -> None:
    """Its own generator and the default one (dropout, train mode) in one module, with
    ``sizes=``: each size's graph registers the generator; calls at the captured sizes, in
    any order, draw what eager draws."""
    torch.manual_seed(0)
    gen = cuda_generator(3)
    model = Noisy(gen).to(DEV).train()
    g = tr.graph(model, torch.randn(8, 64, device=DEV), sizes=[2, 4, 8])
    replays_draw_as_eager(g, model, gen)


def noisy(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    return x + torch.randn(x.shape, device=x.device, generator=generator)


def test_a_generator_argument_is_taken_from_every_call() -> None:
    """A per-request generator (a serving sampler's: one seeded generator per request): any
    CUDA generator may be passed at a call. The graph draws from its own stand-in, put where the
    call's generator stands, and moves the call's generator on as the eager call would. The
    sample's generator is not moved by the build."""
    sample_gen = cuda_generator(5)
    x = torch.randn(16, device=DEV)
    g = tr.graph(noisy, x, generator=sample_gen)
    assert sample_gen.get_offset() == 0
    for call in range(CALLS):
        xi = torch.randn(16, device=DEV)
        request, twin = cuda_generator(100 + call), cuda_generator(100 + call)
        for _ in range(2):  # two steps of one request
            assert torch.equal(g(xi, generator=request), noisy(xi, generator=twin)), f"call {call}"
            assert request.get_offset() == twin.get_offset() > 0
    assert torch.equal(g(x, generator=sample_gen), noisy(x, generator=cuda_generator(5)))
    with pytest.raises(tr.ReplayInputError, match=r"kwargs\['generator'\].*pass a generator on that device"):
        g(x, generator=torch.Generator())  # a CPU generator: the graph cannot draw from it
    assert g.stats.fallbacks == 0


@pytest.mark.parametrize("verify", [0, 3])
def test_generator_arguments_under_sizes_and_make_graphed_callables(verify: int) -> None:
    """With ``verify=``, the first calls run eagerly too, from the same state: the generator
    argument is put back before the replay (the replay drew on from where the reference run
    left it, a false VerifyError, and the caller's generator moved twice as far, before)."""
    gen = cuda_generator(1)
    g = tr.graph(noisy, torch.randn(8, 4, device=DEV), gen, sizes=[2, 4, 8])
    for call, rows in enumerate([2, 8, 4, 2, 8]):
        xi = torch.randn(rows, 4, device=DEV)
        request, twin = cuda_generator(call), cuda_generator(call)
        assert torch.equal(g(xi, request), noisy(xi, twin)), f"call {call} at {rows} rows"
        assert request.get_offset() == twin.get_offset()
    lin = nn.Linear(4, 4).to(DEV)

    def layer(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        return lin(noisy(x, generator))

    x0 = torch.randn(8, 4, device=DEV, requires_grad=True)
    graphed = tr.make_graphed_callables(layer, (x0, gen), verify=verify)
    for call in range(CALLS):
        x = torch.randn(8, 4, device=DEV, requires_grad=True)
        xr = x.detach().clone().requires_grad_(True)
        request, twin = cuda_generator(50 + call), cuda_generator(50 + call)
        y, yr = graphed(x, request), layer(xr, twin)
        torch.testing.assert_close(y, yr, rtol=1e-5, atol=1e-6)
        if call % 3 == 2:  # a gradient penalty: recomputed eagerly, drawing the call's noise again
            (gx,) = torch.autograd.grad(y.square().sum(), x, create_graph=True)
            (gxr,) = torch.autograd.grad(yr.square().sum(), xr, create_graph=True)
            (y.sum() + gx.square().sum()).backward()
            (yr.sum() + gxr.square().sum()).backward()
        else:
            y.square().sum().backward()
            yr.square().sum().backward()
        torch.testing.assert_close(x.grad, xr.grad, rtol=1e-5, atol=1e-6)
        assert request.get_offset() == twin.get_offset()
    assert graphed.stats.verified == verify and graphed.stats.recomputed == CALLS // 3


def host_scale(x: torch.Tensor) -> torch.Tensor:  # a break: it reads a value on the host
    return x / (float(x.abs().max().item()) + 1.0)


class HostScale(nn.Module):
    """``host_scale`` in a module of its own, which ``breaks="auto"`` can break at."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return host_scale(x)


#: ``breaks=``: the function by name, or found by ``"auto"`` (its module: ``scale``)
BREAKS = pytest.mark.parametrize("breaks", ["host_scale", "auto"])


def breaks_of(name: str) -> list | str:
    return [host_scale] if name == "host_scale" else name


def segments(graphed: object) -> int:
    """How many graph segments ``tr.explain`` reports: one more than the breaks. With
    ``"auto"`` the models here break at ``scale`` alone. They draw from a generator before it,
    and the search's trial capture, which did not register the generator, failed at that draw:
    the search broke there too (before)."""
    text = tr.explain(graphed)
    found = re.search(r"segments: (\d+) per size|(\d+) segment\(s\)", text)
    assert found is not None, text
    return int(found.group(1) or found.group(2))


@pytest.mark.parametrize("api", ["graph", "breaks"])
@pytest.mark.parametrize("how", ["torch.manual_seed", "Generator.manual_seed", "made per call"])
def test_a_call_that_seeds_inside_itself_is_refused(how: str, api: str) -> None:
    """Eagerly such a call draws the same numbers every time; a graph's replays would draw on
    (this was silent for torch.manual_seed: replays differed from eager, no error). Refused at
    the build with the fix; the process and the caller's generators carry on."""
    gen = cuda_generator(2)

    def f(x: torch.Tensor) -> torch.Tensor:
        x = host_scale(x) if api == "breaks" else x
        if how == "torch.manual_seed":
            torch.manual_seed(0)
            return x + torch.randn(x.shape, device=x.device)
        g = gen if how == "Generator.manual_seed" else torch.Generator(device=x.device)
        g.manual_seed(0)
        return x + torch.randn(x.shape, device=x.device, generator=g)

    x = torch.randn(8, device=DEV)
    cuda_at, gen_at = torch.cuda.get_rng_state(), gen.get_state()
    fix = r"Seed it outside the graphed call"
    with pytest.raises(tr.CaptureError, match="makes at every call" if how == "made per call" else "sets the state") as err:
        tr.graph(f, x, breaks=[host_scale] if api == "breaks" else None)
    assert fix in str(err.value)
    if how != "torch.manual_seed":  # (that one seeds the caller's generator: as eager would)
        assert torch.equal(torch.cuda.get_rng_state(), cuda_at)
    assert torch.equal(gen.get_state(), gen_at) or how == "Generator.manual_seed"
    g = tr.graph(lambda t: t * 2 + torch.randn(t.shape, device=t.device, generator=gen), x)
    assert g(x).shape == x.shape  # the process carries on


def test_make_graphed_callables_and_a_recomputed_penalty_draw_what_eager_draws() -> None:
    """make_graphed_callables of a module with its own generator: forward and backward equal
    eager over many steps; a create_graph backward (recomputed eagerly) draws the call's noise
    again from where the generator stood at that call, not from where it stands now."""
    torch.manual_seed(0)
    gen, ref_gen = cuda_generator(9), cuda_generator(9)
    model = Noisy(gen).to(DEV).eval()  # (eval: no dropout; the recompute's default RNG is tested elsewhere)
    ref = Noisy(ref_gen).to(DEV).eval()
    ref.load_state_dict(model.state_dict())
    x0 = torch.randn(16, 64, device=DEV, requires_grad=True)
    graphed = tr.make_graphed_callables(model, (x0,))
    for step in range(CALLS):
        x = torch.randn(16, 64, device=DEV, requires_grad=True)
        xr = x.detach().clone().requires_grad_(True)
        y, yr = graphed(x), ref(xr)
        torch.testing.assert_close(y, yr, rtol=1e-5, atol=1e-6, msg=f"step {step}")
        if step % 3 == 2:  # a gradient penalty: the backward graph cannot compute it
            (gx,) = torch.autograd.grad(y.square().sum(), x, create_graph=True)
            (gxr,) = torch.autograd.grad(yr.square().sum(), xr, create_graph=True)
            loss, loss_r = y.sum() + gx.square().sum(), yr.sum() + gxr.square().sum()
        else:
            loss, loss_r = y.square().mean(), yr.square().mean()
        loss.backward()
        loss_r.backward()
        # (noise drawn elsewhere would differ by about 0.1; the graph's kernels by rounding)
        torch.testing.assert_close(x.grad, xr.grad, rtol=1e-4, atol=1e-5)
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)
        assert torch.equal(gen.get_state(), ref_gen.get_state())
    assert graphed.forward.stats.recomputed >= CALLS // 3


@pytest.mark.parametrize("verify", [0, 3])
def test_graph_step_with_a_generator_trains_as_eager(verify: int) -> None:
    """A module holding its generator, in a whole training step; ``verify=``'s eager reference
    runs put it back (the replay after one drew other noise, before)."""
    torch.manual_seed(0)
    gen, ref_gen = cuda_generator(11), cuda_generator(11)
    model = nn.Sequential(Noisy(gen), nn.Linear(64, 1)).to(DEV)
    ref = nn.Sequential(Noisy(ref_gen), nn.Linear(64, 1)).to(DEV)
    ref.load_state_dict(model.state_dict())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, capturable=True, fused=True)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, capturable=True, fused=True)

    def make(m, o):
        def step(x, y):
            o.zero_grad(set_to_none=True)
            loss = F.mse_loss(m(x), y)
            loss.backward()
            o.step()
            return loss
        return step

    data = [(torch.randn(8, 64, device=DEV), torch.randn(8, 1, device=DEV)) for _ in range(CALLS)]
    cuda_at = torch.cuda.get_rng_state()
    step = tr.graph_step(make(model, opt), *data[0], verify=verify)
    torch.cuda.set_rng_state(cuda_at)  # (dropout: both from one default-generator state)
    ref_step = make(ref, ref_opt)
    losses = [step(x, y).clone() for x, y in data]
    torch.cuda.set_rng_state(cuda_at)
    for i, (x, y) in enumerate(data):
        torch.testing.assert_close(losses[i], ref_step(x, y).detach(), rtol=1e-5, atol=1e-6)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert torch.equal(gen.get_state(), ref_gen.get_state())
    assert step.stats.verified == verify


def test_a_breakable_graph_whose_segments_and_break_draw_from_one_generator() -> None:
    """Draws before the break, in it (eager at replay) and after it: one sequence, as eager."""
    gen = cuda_generator(13)

    def host_noise(h: torch.Tensor) -> torch.Tensor:  # the break: it reads a host value
        scale = float(h.abs().max().item()) + 1.0
        return h / scale + torch.randn(h.shape, device=h.device, generator=gen)

    def model(x: torch.Tensor) -> torch.Tensor:
        h = x * 2 + torch.rand(x.shape, device=x.device, generator=gen)
        h = host_noise(h)
        return h.sin() + torch.randn(h.shape, device=h.device, generator=gen)

    x = torch.randn(32, device=DEV)
    at = gen.get_state()
    g = tr.graph(model, x, breaks=[host_noise])
    assert torch.equal(gen.get_state(), at)
    inputs = [torch.randn(32, device=DEV) for _ in range(CALLS)]
    got = [g(xi).clone() for xi in inputs]
    gen.set_state(at)
    for i, xi in enumerate(inputs):
        assert torch.equal(got[i], model(xi)), f"call {i}"


def host_noise_from(h: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """A break that reads a host value and draws from the generator it is passed."""
    scale = float(h.abs().max().item()) + 1.0
    return h / scale + torch.randn(h.shape, device=h.device, generator=generator)


def noisy_around_a_break(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Draws from the generator argument before the break, in it and after it."""
    h = x * 2 + torch.rand(x.shape, device=x.device, generator=generator)
    h = host_noise_from(h, generator)
    return h.sin() + torch.randn(h.shape, device=h.device, generator=generator)


def test_a_breakable_graphs_generator_argument_is_taken_from_every_call() -> None:
    """A per-request generator passed to a breakable graph (a sampler after the attention
    breaks): the segments draw from a stand-in put where the call's generator stands, the break
    from the same, and the call's generator moves on as the eager call moves it. Before, the
    generator was a constant of the graph: another one at a call was a new capture."""
    sample_gen = cuda_generator(7)
    x = torch.randn(4, 32, device=DEV)
    g = tr.graph(noisy_around_a_break, x, generator=sample_gen, breaks=[host_noise_from])
    assert sample_gen.get_offset() == 0  # the build drew from the graph's own generator
    captures = g.stats.captures
    for call in range(CALLS):
        xi = torch.randn(4, 32, device=DEV)
        request, twin = cuda_generator(300 + call), cuda_generator(300 + call)
        for step in range(2):  # two steps of one request: the second goes on from the first
            assert torch.equal(g(xi, generator=request), noisy_around_a_break(xi, generator=twin)), (
                f"call {call}, step {step}")
            assert request.get_offset() == twin.get_offset() > 0
    assert g.stats.captures == captures and g.stats.fallbacks == 0
    assert torch.equal(g(x, generator=sample_gen), noisy_around_a_break(x, generator=cuda_generator(7)))
    with pytest.raises(tr.ReplayInputError, match=r"kwargs\['generator'\].*pass a generator on that device"):
        g(x, generator=torch.Generator())  # a CPU generator: the segments cannot draw from it


def two_noises(x: torch.Tensor, a: torch.Generator, b: torch.Generator) -> torch.Tensor:
    h = host_scale(x + torch.rand(x.shape, device=x.device, generator=a))
    return h + torch.randn(h.shape, device=h.device, generator=b)


def test_a_breakable_graph_under_sizes_with_one_generator_passed_twice() -> None:
    """sizes= with generator arguments (each call at a captured size: a padded draw would draw
    more numbers than eager); one generator passed in two places draws one sequence, as eagerly,
    and a call that passes them otherwise than the sample did is refused."""
    gen = cuda_generator(3)
    g = tr.graph(two_noises, torch.randn(8, 16, device=DEV), gen, gen, sizes=[2, 4, 8], breaks=[host_scale])
    for call, rows in enumerate([2, 8, 4, 2, 8, 4]):
        xi = torch.randn(rows, 16, device=DEV)
        request, twin = cuda_generator(call), cuda_generator(call)
        assert torch.equal(g(xi, request, request), two_noises(xi, twin, twin)), f"call {call} at {rows} rows"
        assert request.get_offset() == twin.get_offset() > 0
    with pytest.raises(tr.ReplayInputError, match=r"pass generators as the sample did"):
        g(torch.randn(2, 16, device=DEV), cuda_generator(0), cuda_generator(0))
    apart = tr.graph(two_noises, torch.randn(4, 16, device=DEV), cuda_generator(1), cuda_generator(2),
                     breaks=[host_scale])
    with pytest.raises(tr.ReplayInputError, match=r"pass generators as the sample did"):
        apart(torch.randn(4, 16, device=DEV), gen, gen)
    a, b, a2, b2 = cuda_generator(11), cuda_generator(12), cuda_generator(11), cuda_generator(12)
    xi = torch.randn(4, 16, device=DEV)
    assert torch.equal(apart(xi, a, b), two_noises(xi, a2, b2))
    assert (a.get_offset(), b.get_offset()) == (a2.get_offset(), b2.get_offset())
    assert g.stats.fallbacks == 0 and apart.stats.fallbacks == 0


def drawn_twice(x: torch.Tensor, a: torch.Generator, b: torch.Generator) -> torch.Tensor:
    return x + torch.rand(x.shape, device=x.device, generator=a) + torch.randn(x.shape, device=x.device, generator=b)


@pytest.mark.parametrize("sizes", [None, [4, 8]])
def test_one_generator_passed_in_two_places_draws_one_sequence(sizes: list[int] | None) -> None:
    """Eagerly the second draw goes on from the first. Each place used to get a stand-in of
    its own: both drew the same numbers, and the generator moved on by one draw, silently."""
    gen = cuda_generator(4)
    g = tr.graph(drawn_twice, torch.randn(8, 16, device=DEV), gen, gen, sizes=sizes)
    for call, rows in enumerate([8, 4, 8] * 4 if sizes else [8] * CALLS):
        xi = torch.randn(rows, 16, device=DEV)
        request, twin = cuda_generator(40 + call), cuda_generator(40 + call)
        assert torch.equal(g(xi, request, request), drawn_twice(xi, twin, twin)), f"call {call}"
        assert request.get_offset() == twin.get_offset() > 0
    with pytest.raises(tr.ReplayInputError, match=r"pass generators as the sample did"):
        g(torch.randn(8, 16, device=DEV), cuda_generator(0), cuda_generator(0))
    apart = tr.graph(drawn_twice, torch.randn(8, 16, device=DEV), cuda_generator(1), cuda_generator(2), sizes=sizes)
    with pytest.raises(tr.ReplayInputError, match=r"pass generators as the sample did"):
        apart(torch.randn(8, 16, device=DEV), gen, gen)
    assert g.stats.fallbacks == 0


class HostNoise(nn.Module):
    """A break that reads a host value and draws from the generator it is passed."""

    def forward(self, h: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        return host_noise_from(h, generator)


class NoisyAroundABreak(nn.Module):
    """Draws from the generator argument before a break and after it; with ``noisy``, the
    break (:class:`HostNoise`) draws from it too."""

    def __init__(self, noisy: bool = False) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.middle = HostNoise() if noisy else HostScale()
        self.b = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        h = self.a(x) + torch.rand(x.shape, device=x.device, generator=generator)
        h = self.middle(h, generator) if isinstance(self.middle, HostNoise) else self.middle(h)
        return self.b(h) + torch.randn(h.shape, device=h.device, generator=generator)


@pytest.mark.parametrize("breaks", ["host_scale", "auto", "HostNoise"])
def test_training_around_breaks_takes_a_generator_argument_from_every_call(breaks: str) -> None:
    """make_graphed_callables(..., breaks=) with a per-request generator: the segments' graphs
    draw from their stand-ins, put where the call's generator stands, which then moves on as the
    eager call moves it; forward and gradients equal eager's. Before, any other generator than
    the sample's was refused. ``HostNoise``: the break (eager) draws from the call's generator
    itself between the segments' draws: one sequence, as eagerly."""
    torch.manual_seed(0)
    noisy = breaks == "HostNoise"
    model = NoisyAroundABreak(noisy).to(DEV)
    ref = NoisyAroundABreak(noisy).to(DEV)
    ref.load_state_dict(model.state_dict())
    gen = cuda_generator(21)
    x0 = torch.randn(4, 16, device=DEV, requires_grad=True)
    graphed = tr.make_graphed_callables(model, (x0, gen), breaks=[HostNoise] if noisy else breaks_of(breaks))
    assert gen.get_offset() == 0  # (the build drew from the stand-ins)
    assert segments(model) == 2
    for call in range(CALLS):
        request, twin = (gen, cuda_generator(21)) if call == 0 else (cuda_generator(400 + call), cuda_generator(400 + call))
        for step in range(2):  # two steps of one request: the second goes on from the first
            x = torch.randn(4, 16, device=DEV, requires_grad=True)
            xr = x.detach().clone().requires_grad_(True)
            y, yr = graphed(x, request), ref(xr, twin)
            torch.testing.assert_close(y, yr, rtol=1e-5, atol=1e-6)
            y.square().sum().backward()
            yr.square().sum().backward()
            torch.testing.assert_close(x.grad, xr.grad, rtol=1e-5, atol=1e-6)
            assert request.get_offset() == twin.get_offset() > 0, f"call {call}, step {step}"
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)
    assert model.forward.stats.fallbacks == 0
    with pytest.raises(tr.ReplayInputError, match=r"pass a generator on that device"):
        graphed(torch.randn(4, 16, device=DEV), torch.Generator())  # a CPU one


class TwoGenerators(nn.Module):
    """Draws from two generator arguments around a break."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.scale = HostScale()

    def forward(self, x: torch.Tensor, a: torch.Generator, b: torch.Generator) -> torch.Tensor:
        h = self.scale(self.lin(x) + torch.rand(x.shape, device=x.device, generator=a))
        return h + torch.randn(h.shape, device=h.device, generator=b)


def test_training_around_breaks_with_one_generator_in_two_places() -> None:
    """Graphed with one generator passed as both: the draws follow each other, at every call
    with one generator in both; two different ones at a call are refused (the segments were
    graphed drawing one sequence), and the other way round."""
    torch.manual_seed(0)
    model, ref = TwoGenerators().to(DEV), TwoGenerators().to(DEV)
    ref.load_state_dict(model.state_dict())
    gen = cuda_generator(31)
    graphed = tr.make_graphed_callables(model, (torch.randn(4, 16, device=DEV, requires_grad=True), gen, gen),
                                        breaks=[host_scale])
    for call in range(CALLS):
        request, twin = cuda_generator(500 + call), cuda_generator(500 + call)
        x = torch.randn(4, 16, device=DEV, requires_grad=True)
        torch.testing.assert_close(graphed(x, request, request), ref(x, twin, twin), rtol=1e-5, atol=1e-6)
        assert request.get_offset() == twin.get_offset() > 0
    with pytest.raises(tr.ReplayInputError, match=r"one generator.*called with two"):
        graphed(torch.randn(4, 16, device=DEV), cuda_generator(1), cuda_generator(2))


class NoisyBreakable(nn.Module):
    """Noisy's draws (its own generator, and dropout from the default one) on both sides of a
    break that reads a host value."""

    def __init__(self, gen: torch.Generator, width: int = 64) -> None:
        super().__init__()
        self.first = Noisy(gen, width)
        self.scale = HostScale()
        self.second = Noisy(gen, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.scale(self.first(x)))


@BREAKS
def test_a_breakable_module_with_its_generator_at_sizes_captured_at_their_first_call(breaks: str) -> None:
    """Sizes below the sample's rows are captured at their first call, whose capture replays
    the segments for real: the generators are put back before the call's own replay (the
    module's drew on from where the capture left it, silently, before). ``"auto"``'s search
    leaves them where they stood too (it moved the module's on by its own draws, before)."""
    torch.manual_seed(0)
    gen = cuda_generator(9)
    model = NoisyBreakable(gen).to(DEV).train()
    sample = torch.randn(8, 64, device=DEV)
    gen_at, cuda_at = gen.get_state(), torch.cuda.get_rng_state()
    g = tr.graph(model, sample, sizes=[2, 4, 8], breaks=breaks_of(breaks))
    assert segments(g) == 2
    assert torch.equal(gen.get_state(), gen_at) and torch.equal(torch.cuda.get_rng_state(), cuda_at)
    replays_draw_as_eager(g, model, gen)
    assert g.stats.fallbacks == 0


@BREAKS
def test_training_around_breaks_with_the_modules_own_generator_draws_as_eager(breaks: str) -> None:
    """make_graphed_callables(model, ..., breaks=) of a module that holds its generator: the
    build leaves it (and the default generator) where they stood; calls draw what eager draws."""
    torch.manual_seed(0)
    gen, twin = cuda_generator(17), cuda_generator(17)
    model = NoisyBreakable(gen).to(DEV).train()
    ref = NoisyBreakable(twin).to(DEV).train()
    ref.load_state_dict(model.state_dict())
    sample = torch.randn(4, 64, device=DEV, requires_grad=True)
    gen_at, cuda_at = gen.get_state(), torch.cuda.get_rng_state()
    graphed = tr.make_graphed_callables(model, (sample,), breaks=breaks_of(breaks))
    assert segments(model) == 2
    assert torch.equal(gen.get_state(), gen_at), "the build moved the module's generator"
    assert torch.equal(torch.cuda.get_rng_state(), cuda_at), "the build moved the default generator"
    for call in range(CALLS):
        x = torch.randn(4, 64, device=DEV, requires_grad=True)
        xr = x.detach().clone().requires_grad_(True)
        cuda_before = torch.cuda.get_rng_state()
        y = graphed(x)
        torch.cuda.set_rng_state(cuda_before)  # (dropout: both from one default-generator state)
        yr = ref(xr)
        torch.testing.assert_close(y, yr, rtol=1e-5, atol=1e-6)
        y.square().sum().backward()
        yr.square().sum().backward()
        torch.testing.assert_close(x.grad, xr.grad, rtol=1e-5, atol=1e-6)
        assert gen.get_offset() == twin.get_offset() > 0, f"call {call}"


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("where", ["argument", "module"])
def test_the_compile_backend_draws_from_a_users_generator_as_eager(where: str) -> None:
    """``tr.compile`` of a function given a generator, and of a module holding one: its pieces
    do not register generators, so whatever draws from one runs eagerly or ungraphed; either
    way every call draws what eager draws and moves the generator as far."""
    torch.manual_seed(0)
    gen, twin = cuda_generator(61), cuda_generator(61)
    if where == "argument":
        f, ref = tr.compile(noisy), noisy
        run, run_ref = (lambda x: f(x, gen)), (lambda x: ref(x, twin))
    else:
        model = Noisy(gen).to(DEV).eval()
        ref_model = Noisy(twin).to(DEV).eval()
        ref_model.load_state_dict(model.state_dict())
        f = tr.compile(model)
        run, run_ref = (lambda x: f(x)), (lambda x: ref_model(x))
    for call in range(CALLS):
        x = torch.randn(8, 64, device=DEV)
        with torch.no_grad():
            got, want = run(x), run_ref(x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"call {call}")
        assert gen.get_offset() == twin.get_offset() > 0, f"call {call}"


def from_both(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Draws from the generator it is passed and from the default one (as dropout does)."""
    return x + torch.rand(x.shape, device=x.device, generator=generator) + torch.rand(x.shape, device=x.device)


@pytest.mark.parametrize("api", ["graph", "sizes", "breaks"])
def test_the_default_generator_passed_as_an_argument_draws_one_sequence(api: str) -> None:
    """``generator=torch.cuda.default_generators[0]``: eagerly both draws come from that one
    generator, one after the other. Before, the graph drew the argument's from a stand-in bound
    where the default one stood at the call, and its own default draws from the same place:
    the two were the same numbers. The default generator is now a constant of the graph (torch
    registers it with every graph). A call that passes it where the sample passed a generator
    of its own is refused, saying why."""
    default = torch.cuda.default_generators[0]
    x = torch.randn(8, 16, device=DEV)

    def f(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        return from_both(host_scale(x) if api == "breaks" else x, generator)

    kw = {"sizes": [4, 8]} if api == "sizes" else {"breaks": [host_scale]} if api == "breaks" else {}
    g = tr.graph(f, x, default, **kw)
    inputs = [torch.randn(8, 16, device=DEV) for _ in range(CALLS)]
    at = torch.cuda.get_rng_state()
    got = [g(xi, default).clone() for xi in inputs]
    after = torch.cuda.get_rng_state()
    torch.cuda.set_rng_state(at)
    for i, xi in enumerate(inputs):
        assert torch.equal(got[i], f(xi, default)), f"call {i}"
    assert torch.equal(after, torch.cuda.get_rng_state())
    own = tr.graph(f, x, cuda_generator(3), **kw)
    with pytest.raises(tr.ReplayInputError, match="default CUDA generator of cuda:0.*of your own"):
        own(x, default)


def test_a_generator_made_for_cuda_0_is_taken_where_one_made_for_cuda_was_captured() -> None:
    """``torch.Generator(device="cuda")`` reports device ``cuda``, one made for ``"cuda:0"``
    reports ``cuda:0``: the same device. A call passing the second where the sample passed the
    first was refused ("pass a generator on that device")."""
    g = tr.graph(noisy, torch.randn(16, device=DEV), torch.Generator(device="cuda").manual_seed(1))
    for seed in range(3):
        request, twin = torch.Generator(device="cuda:0").manual_seed(seed), cuda_generator(seed)
        xi = torch.randn(16, device=DEV)
        assert torch.equal(g(xi, request), noisy(xi, twin))
        assert request.get_offset() == twin.get_offset() > 0


class LayerDrop(nn.Module):
    """Hugging Face's LayerDrop: in training mode, each layer is skipped when a number drawn on
    the host is below ``layerdrop`` (torch's CPU generator, or Python's ``random``)."""

    def __init__(self, layerdrop: float, source: str, always: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))
        self.layerdrop, self.source, self.always = layerdrop, source, always

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            if self.always:  # Wav2Vec2's form: drawn in eval mode too, used only in training
                p = torch.rand([])
                if self.training and p < self.layerdrop:  # at:layerdrop-use
                    continue
            elif self.training and (torch.rand([]) if self.source == "torch" else random.random()) < self.layerdrop:
                continue
            x = layer(x).tanh()
        return x


def host_jitter(h: torch.Tensor) -> torch.Tensor:  # a break: it draws on the host, at every call
    return h * (1.0 + float(torch.rand([]))) / float(h.abs().max().item() + 1.0)


@pytest.mark.parametrize("source", ["torch", "python"])
def test_a_draw_on_the_host_inside_a_capture_is_said_once(source: str, caplog) -> None:
    """A graph replays no host work: the capture's draw decides which layers run at every
    replay (eagerly each call draws anew). Said once per graph, naming the generator; not for a
    model that draws nothing in eval mode, nor for a break, which draws at every call."""
    torch.manual_seed(0)
    model = LayerDrop(0.5, source).to(DEV)
    x = torch.randn(8, 16, device=DEV)
    which = "torch's CPU generator" if source == "torch" else "Python's random module"
    with caplog.at_level(logging.WARNING, logger="torchreplay"):
        g = tr.graph(model.train(), x, sizes=[4, 8])
        g(x[:4])  # (a size captured at its first call: the same graph, said once)
    said = [r.getMessage() for r in caplog.records if "drew random numbers on the host" in r.getMessage()]
    assert len(said) == 1 and which in said[0] and "LayerDrop" in said[0], said
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="torchreplay"):
        tr.graph(LayerDrop(0.5, source).to(DEV).eval(), x)  # (no draw in eval mode)
        tr.graph(lambda h: host_jitter(h * 2) + 1, x, breaks=[host_jitter])
    said = [r.getMessage() for r in caplog.records if "drew random numbers on the host" in r.getMessage()]
    assert not said, said


class Encoded(nn.Module):
    """LayerDrop inside a submodule, as in Hugging Face's encoders: a layer, the encoder, a layer."""

    def __init__(self, layerdrop: float = 0.5) -> None:
        super().__init__()
        self.embed, self.head = nn.Linear(16, 16), nn.Linear(16, 16)
        self.encoder = LayerDrop(layerdrop, "torch", always=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(x)))


def test_a_number_drawn_on_the_host_that_decides_is_a_check_finding_and_an_auto_break(caplog) -> None:
    """LayerDrop's ``torch.rand([]) < p`` on a model on the GPU: ``tr.check`` said nothing (a CPU
    tensor, no sync), and ``breaks="auto"`` graphed it whole, so every replay skipped the layers
    the capture's draw chose. Now the check finds the number drawn on the host where the ``if``
    reads it, and "auto" breaks at the module around it, whose calls skip layers as eager's do.
    Drawn and not used (Wav2Vec2 in eval mode), or compared with 0.0 (LayerDrop off), is no
    finding and no break."""
    torch.manual_seed(0)
    model = Encoded().to(DEV)
    x = torch.randn(8, 16, device=DEV)
    found = [f for f in tr.check(model.train(), x) if f.kind == "rng"]
    assert len(found) == 1 and "drawn on the host" in found[0].reason, found
    assert found[0].code.startswith("if self.training and p < self.layerdrop:"), found
    assert not tr.check(model.eval(), x)  # (drawn, never read: nothing)
    g = tr.graph(model.eval(), x, breaks="auto")
    assert not g.auto and torch.allclose(g(x), model(x))  # (eval: graphed whole, no break)
    caplog.clear()  # (that capture drew, harmlessly: said once)
    with caplog.at_level(logging.WARNING, logger="torchreplay"):
        g = tr.graph(model.train(), x, breaks="auto")
    assert [b.path for b in g.auto] == ["encoder"]
    assert not [r for r in caplog.records if "drew random numbers on the host" in r.getMessage()]
    # LayerDrop off (Hugging Face's default): the draw decides nothing, so no break.
    off = Encoded(0.0).to(DEV).train()
    assert not [f for f in tr.check(off, x) if f.kind == "rng"]
    assert not tr.graph(off, x, breaks="auto").auto
    kept = set()
    for seed in range(12):
        xi = torch.randn(8, 16, device=DEV)
        torch.manual_seed(seed)
        y = g(xi)
        torch.manual_seed(seed)
        torch.testing.assert_close(y, model(xi))
        torch.manual_seed(seed)
        kept.add(round(float(g(x).sum()), 4))
    assert len(kept) > 1  # (one input, other layers kept per call: as eagerly, not the capture's)
