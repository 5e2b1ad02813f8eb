"""The arithmetic below the model: `ModelOps` (the layers' ops, plain torch) and the C++ ops
that replace them where they build. Imports nothing of chunkserve but config."""
