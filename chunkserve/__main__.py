"""`python -m chunkserve ...` is the `chunkserve` command (what `torchrun -m chunkserve serve ...` runs)."""

from chunkserve.entrypoints.cli import main

if __name__ == "__main__":
    main()
