"""Breakable graphs (``tr.graph(fn, *args, breaks=[...])``): graph segments captured around the
calls that run eagerly. In progress: :mod:`~torchreplay.breaks.plan` (which calls are breaks,
what each reads at replay) is here; the capture driver is not built yet and nothing public uses
this package."""
