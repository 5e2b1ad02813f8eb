"""Model definitions and weight loading (tensors live here and in `worker/`)."""
