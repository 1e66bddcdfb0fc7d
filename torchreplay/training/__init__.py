"""Training through graphs: ``tr.make_graphed_callables`` (callables: capture; graphed_callable:
replay and the autograd node), ``tr.graph_step`` (step), capturable optimizers (optimizers), what
warm-up changes and its restore (state), and ``verify=`` (verify). Builds on ``core/``."""
