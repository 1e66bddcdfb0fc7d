"""``python -m torchreplay``: the same as the ``torchreplay`` command."""

from torchreplay.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
