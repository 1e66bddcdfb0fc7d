"""One captured shape: arguments flattened once (args), warm-up and capture with undo (capture),
memory pools and replay order (pool), static buffers, guards and the output policy (io), and the
replay hot path (graphed). Nothing here knows about sizes, training or compile."""
